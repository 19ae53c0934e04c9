"""A run leaves the process as it found it. Backends change process-wide settings on purpose
(torch's thread pools sized for the run, ORTModule's `ORTMODULE_*` options read from the
environment, Ray's settings, how much of ORT's output the console shows: `orchestrate.ort.quiet`),
and the MLflow run sets MLflow's process-wide tracking URI; a later run in the same process (a
benchmark, a test, a sweep trial on Hydra's basic launcher, a Ray worker reused for the next
trial) must not inherit them."""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import torch

from orchestrate import ort


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Restore torch's thread counts, the environment variables, MLflow's tracking URI, the
    logging setup (logger levels, handler filters, whether Python warnings go to logging) and ORT's
    default logger severity on the way out."""
    threads, environ, mlflow_uri = torch.get_num_threads(), dict(os.environ), _mlflow_uri()
    logs, severity = _logging_state(), ort.default_severity()
    try:
        yield
    finally:
        _restore_logging(logs)
        if ort.default_severity() != severity:
            ort.set_default_severity(severity)
        utils = sys.modules.get(MLFLOW_URI_MODULE)
        if utils is not None and utils._tracking_uri != mlflow_uri:
            # Where MLflow's own `_use_tracking_uri` puts it back (None: never set).
            utils.set_tracking_uri(mlflow_uri)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        for key in [k for k in os.environ if k not in environ]:
            del os.environ[key]
        for key, value in environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


MLFLOW_URI_MODULE = "mlflow.tracking._tracking_service.utils"  # holds `_tracking_uri`


def _mlflow_uri() -> str | None:
    """MLflow's process-wide tracking URI as set (None: unset, or MLflow not imported yet)."""
    utils = sys.modules.get(MLFLOW_URI_MODULE)
    return utils._tracking_uri if utils is not None else None


def _logging_state() -> tuple[dict, dict, bool]:
    """The levels of the loggers there are, the filters of their handlers (and of logging's last
    resort), and whether Python warnings go to logging (`logging.captureWarnings`)."""
    loggers = [logging.getLogger(), *(x for x in list(logging.Logger.manager.loggerDict.values())
                                      if isinstance(x, logging.Logger))]
    handlers = {h for x in loggers for h in x.handlers} | ({logging.lastResort} if logging.lastResort else set())
    # logging keeps warnings' own showwarning here while it captures them (None: it does not).
    return {x: x.level for x in loggers}, {h: list(h.filters) for h in handlers}, \
        logging._warnings_showwarning is not None


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
    if (logging._warnings_showwarning is not None) != capturing:
        logging.captureWarnings(capturing)
