"""A run leaves the process as it found it. Backends change process-wide settings on purpose
(torch's thread pools sized for the run, ORTModule's `ORTMODULE_*` options read from the
environment, Ray's settings), and the MLflow run sets MLflow's process-wide tracking URI; a later run in the same process (a benchmark, a test, a sweep trial
on Hydra's basic launcher, a Ray worker reused for the next trial) must not inherit them."""

import contextlib
import os
import sys
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Restore torch's thread counts, the environment variables and MLflow's tracking URI on the
    way out."""
    threads, environ, mlflow_uri = torch.get_num_threads(), dict(os.environ), _mlflow_uri()
    try:
        yield
    finally:
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
