"""A run leaves the process as it found it. Backends change process-wide settings on purpose
(torch's thread pools sized for the run, ORTModule's `ORTMODULE_*` options read from the
environment, Ray's settings, how much of ORT's output the console shows: `orchestrate.ort.quiet`),
and MLflow's client settings (orchestrate.tracking.settings); a later run in the same process (a
benchmark, a test, a sweep trial on Hydra's basic launcher, a Ray worker reused for the next
trial) must not inherit them. (While a run is open, a signal stops it as Ctrl-C does:
orchestrate.signals.)
"""

import contextlib
import logging
import os
import signal
from collections.abc import Iterator

import torch

from orchestrate import ort, thirdparty
from orchestrate.signals import STOP_SIGNALS, main_thread


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Restore torch's thread counts and TF32 flags, the environment variables, the
    logging setup (logger levels, handler filters, whether Python warnings go to logging), ORT's
    default logger severity and the stop signals' handlers (STOP_SIGNALS) on the way out (Ray Train's
    `fit` installs a SIGINT handler of its own and never takes it back)."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # trainer.tf32
    logs, severity = _logging_state(), ort.default_severity()
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS} if main_thread() else {}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            if signal.getsignal(signum) is not handler and handler is not None:
                signal.signal(signum, handler)
        _restore_logging(logs)
        if ort.default_severity() != severity:
            ort.set_default_severity(severity)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        for key in [k for k in os.environ if k not in environ]:
            del os.environ[key]
        for key, value in environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _logging_state() -> tuple[dict, dict, bool]:
    """The levels of the loggers there are, the filters of their handlers (and of logging's last
    resort), and whether Python warnings go to logging (`logging.captureWarnings`)."""
    loggers = [logging.getLogger(), *(x for x in list(logging.Logger.manager.loggerDict.values())
                                      if isinstance(x, logging.Logger))]
    handlers = {h for x in loggers for h in x.handlers} | ({logging.lastResort} if logging.lastResort else set())
    # logging keeps warnings' own showwarning here while it captures them (None: it does not).
    return {x: x.level for x in loggers}, {h: list(h.filters) for h in handlers}, \
        thirdparty.captures_warnings()


def _restore_logging(state: tuple[dict, dict, bool]) -> None:
    """Put back what _logging_state saw. Loggers and handlers made since are left as they are, but
    for the console filter `ort.quiet` put on a handler made during the run (ORT's import adds one to
    a root logger that had none)."""
    levels, filters, capturing = state
    for logger, level in levels.items():
        if logger.level != level:
            logger.setLevel(level)
    for handler, kept_filters in filters.items():
        if handler.filters != kept_filters:
            handler.filters[:] = kept_filters
    for handler in logging.getLogger().handlers:
        if handler not in filters:
            handler.filters[:] = [f for f in handler.filters if not isinstance(f, ort.HideOrtOutput)]
    if thirdparty.captures_warnings() != capturing:
        logging.captureWarnings(capturing)
