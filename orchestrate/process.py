"""A run leaves the process as it found it. Backends change process-wide settings on purpose
(torch's thread pools sized for the run, ORTModule's `ORTMODULE_*` options read from the
environment, Ray's settings); a later run in the same process (a benchmark, a test, a sweep trial
on Hydra's basic launcher, a Ray worker reused for the next trial) must not inherit them."""

import contextlib
import os
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Restore torch's thread counts and the environment variables on the way out."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        for key in [k for k in os.environ if k not in environ]:
            del os.environ[key]
        for key, value in environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
