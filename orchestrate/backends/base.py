"""The interface every backend implements. Small on purpose: the shared bookkeeping (batches,
schedule, metrics, checkpoints files) lives in `orchestrate.job.Job`, which `fit` receives."""

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np


class Backend(ABC):
    """A way to train: the config's `backend` group builds one (its keys are the fields of the
    dataclass that subclasses this)."""

    name: str  # the conf/backend file's name; tags the MLflow run and prefixes the progress bar
    distributed = False  # True: the backend runs trainer.num_workers workers with gradient accumulation
    resumable = False  # True: `fit` continues from `job.resume_from` (trainer.resume)

    def check(self, job) -> None:
        """Refuse impossible combinations (raise `orchestrate.schema.ConfigError`) before any compute."""

    def check_workers(self, job) -> None:
        """Single-process backends refuse the runner's settings (called before `check`)."""
        from orchestrate.schema import ConfigError

        t = job.trainer
        if not self.distributed and (t.num_workers > 1 or t.gradient_accumulation_steps > 1):
            raise ConfigError(f"trainer.num_workers={t.num_workers} and trainer.gradient_accumulation_steps="
                              f"{t.gradient_accumulation_steps} need backend=runner; backend={self.name} trains "
                              "in one process with one batch per step")

    def connect(self, job) -> None:
        """Reach what the run needs outside this process (the runner: a Ray cluster that can place
        its workers), raising ConfigError if it cannot be had. Called before the MLflow run opens."""

    @abstractmethod
    def fit(self, job) -> None:
        """Train `job.model` on `job.data` for `job.trainer.max_steps` steps, calling
        `job.record` every step, `job.evaluate` and `job.checkpoint` at their periods, and
        `job.save_model` once at the end. A resumable backend starts after the step stored in
        `job.resume_from` when that is set, with the state it holds."""

    @abstractmethod
    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        """The model parameters stored in one of this backend's checkpoints, by name."""
