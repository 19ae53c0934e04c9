"""A run leaves the process as it found it. Backends change process-wide settings on purpose
(torch's thread pools sized for the run, ORTModule's `ORTMODULE_*` options read from the
environment, Ray's settings, how much of ORT's output the console shows: `orchestrate.ort.quiet`),
and MLflow's client settings (orchestrate.tracking.settings); a later run in the same process (a
benchmark, a test, a sweep trial on Hydra's basic launcher, a Ray worker reused for the next
trial) must not inherit them. While a run is open, SIGTERM and SIGHUP stop it as Ctrl-C does
(`stop_on_signals`).
"""

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

import torch

from orchestrate import ort, thirdparty


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Restore torch's thread counts and TF32 flags, the environment variables, the
    logging setup (logger levels, handler filters, whether Python warnings go to logging), ORT's
    default logger severity and the stop signals' handlers (STOP_SIGNALS) on the way out (Ray Train's
    `fit` installs a SIGINT handler of its own and never takes it back)."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # trainer.tf32
    logs, severity = _logging_state(), ort.default_severity()
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS} if _main_thread() else {}
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


# What Ctrl-C (SIGINT), `docker stop`, Slurm's scancel and `ray job stop` (SIGTERM), and a closed
# terminal or a dropped SSH session (SIGHUP) send.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_signals() -> list[signal.Signals]:
    """The STOP_SIGNALS a run takes here: all of them, but SIGHUP where it is ignored (`nohup`:
    the user asked the run to outlive the terminal)."""
    return [s for s in STOP_SIGNALS if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)]


class Stopped(KeyboardInterrupt):
    """A run stopped by a signal: a KeyboardInterrupt, so everything that cleans up after Ctrl-C
    (the MLflow run marked KILLED, Ray shut down, a half-written checkpoint removed) does so alike."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGHUP (`stop_signals`) raise Stopped in the main
    thread (Python's default SIGTERM and SIGHUP end the process on the spot: the MLflow run would
    stay RUNNING, Ray's processes orphaned). The first signal stops the run; later ones, while it closes (the MLflow run's end,
    Ray's shutdown, each bounded), are reported and ignored: SIGKILL still ends it at once. The
    previous handlers come back on the way out. Elsewhere than the main thread (signals are
    delivered there only) nothing changes."""
    global _received, _stop
    if not _main_thread():
        yield
        return
    outer, _received = _received, []

    def stop(signum, frame) -> None:
        if _received:
            print(f"{signal.Signals(signum).name}: stopping already (closing the MLflow run); "
                  "SIGKILL ends the process at once", file=sys.stderr, flush=True)
            return
        _received.append(signum)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in stop_signals()}
    outer_stop, _stop = _stop, stop
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _received, _stop = outer, outer_stop


# Module state: the signal that stopped the run in the innermost stop_on_signals block, and that
# block's handler (which reinstall_handlers puts back: a signal handler is process-wide); the
# block sets both and puts the outer block's back.
_received: list[int] = []
_stop = None


def stopped_by() -> Stopped | None:
    """The Stopped of the signal that stopped the run, for code that sees only a plain
    KeyboardInterrupt (Ray's wait for a result turns the handler's exception into one)."""
    return Stopped(_received[0]) if _received else None


def reinstall_handlers() -> None:
    """Put the run's signal handlers (`stop_signals`) back in force, beneath Python too: `ray.init` sets
    a Python SIGTERM handler of its own (`sys.exit(15)`: the run would end FAILED), and Ray's core
    worker a native failure-signal handler that prints a stack trace and aborts, which Python would
    never hear of. Outside a stop_on_signals block, Python's current handlers are set again."""
    if not _main_thread():
        return
    for signum in stop_signals():
        handler = _stop if _stop is not None else signal.getsignal(signum)
        if handler is not None:
            signal.signal(signum, handler)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


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
