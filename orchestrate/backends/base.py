"""The interface every backend implements (`Backend`), and the backends of conf/backend/ by what
they can do (`backend_configs`).

Small on purpose: what loops share lives beside them (`orchestrate.job.Job`: settings and built
objects; `orchestrate.meter.Meter`: steps and metrics; `orchestrate.checkpoints`). A new backend
is one file in this folder plus one file in conf/backend/ whose `_target_` names its class.
"""

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
from omegaconf import DictConfig


class Backend(ABC):
    """A way to train: the config's `backend` group builds one (its keys are the fields of the
    dataclass that subclasses this; their values are set in the backend's yaml file)."""

    name: str  # the conf/backend file's name; tags the MLflow run and prefixes the progress bar
    distributed = False  # True: runs trainer.num_workers workers itself (the runner)
    resumable = False  # True: `load_checkpoint` reads its checkpoints, `fit` goes on from `job.resume_state`
    data_parallel = False  # True: `fit` runs on the runner's workers (as a `backend.engine`)
    averaging = False  # True: can average parameters every N updates (the runner's `average_every`)
    precisions = ("fp32",)  # the trainer.precision values this backend trains in
    chooses = False  # True: picks another backend to train with (backend=auto), which it never probes itself
    # The least its first steps take beyond the steps themselves (a compilation), in seconds: a
    # run that another backend finishes sooner than that is not probed with it (backend=auto).
    warmup_floor_s = 0.0
    extra = None  # the optional part of orchestrate it trains through (orchestrate.extras: ORT), if any

    def unavailable(self, key: str = "backend") -> str | None:
        """Why this environment cannot train with this backend, in one line naming the install that
        would let it (a package it lacks: orchestrate.extras), or None. `key` names the choice in
        that line (`backend`, the runner's `backend.engine`). Asked first when a job is built."""
        return self.extra.missing(f"{key}={self.name}") if self.extra is not None else None

    def check(self, job) -> None:  # noqa: B027
        """Refuse impossible combinations (raise `orchestrate.schema.ConfigError`) before any compute."""

    def check_precision(self, job) -> None:
        """Refuse a trainer.precision this backend does not train in, naming those it does."""
        from orchestrate.schema import ConfigError

        precision = job.trainer.precision.value
        if precision not in self.precisions:
            raise ConfigError(f"trainer.precision={precision}: backend={self.name} trains in "
                              f"{', '.join(self.precisions)}; {precision} with backend={', '.join(backends_taking(precision))}")

    def check_workers(self, job) -> None:
        """Single-process backends refuse the runner's settings (called before `check`)."""
        from orchestrate.schema import ConfigError

        t = job.trainer
        if not self.distributed and (t.num_workers > 1 or t.gradient_accumulation_steps > 1):
            raise ConfigError(f"trainer.num_workers={t.num_workers} and trainer.gradient_accumulation_steps="
                              f"{t.gradient_accumulation_steps} need backend=runner; backend={self.name} trains "
                              "in one process with one batch per step")
        if not self.distributed and t.pipeline_parallel_size > 1:
            raise ConfigError(f"trainer.pipeline_parallel_size={t.pipeline_parallel_size}: pipeline stages need "
                              f"backend=runner (one stage per worker); backend={self.name} trains the whole model in one "
                              "process (drop it, or set backend=runner trainer.num_workers=<a multiple of it>)")
        if not self.distributed and t.min_workers is not None:
            raise ConfigError(f"trainer.min_workers={t.min_workers}: an elastic worker count needs backend=runner; "
                              f"backend={self.name} trains in one process (drop it with ~trainer.min_workers)")

    def check_resume(self, job) -> None:
        """trainer.resume needs a backend that loads its checkpoints to continue (`resumable`)."""
        from orchestrate.schema import ConfigError

        if job.cfg.trainer.resume and not self.resumable:
            raise ConfigError(f"trainer.resume={job.cfg.trainer.resume}: backend={self.name} cannot load its "
                              f"checkpoints to continue; allowed with backend={', '.join(backends('resumable'))}")

    @classmethod
    def start_early(cls, cfg: DictConfig, runtime) -> contextlib.AbstractContextManager:
        """Begin, while the command checks the config (`cfg`: the run's whole config; `runtime`:
        how the command started, orchestrate.cluster.runtime), what `connect` will wait for (the
        runner: a local Ray instance); stopped again if the body raises (the config was refused).
        Nothing by default."""
        return contextlib.nullcontext()

    def budget(self, job):
        """The CPU budget this backend trains with on `job` (orchestrate.cpu: the cores split
        between training threads and loader processes, `backend.intra_op_threads` winning): what
        the run logs as params and its summary shows. The runner's is one worker's."""
        from orchestrate import cpu

        return cpu.budget(self, job.data, given=job.parallel.cores, busy=job.busy_cores)

    def connect(self, job) -> contextlib.AbstractContextManager:
        """Hold what the run needs outside this process for as long as the run lasts (the runner:
        a Ray cluster that can place its workers), raising ConfigError if it cannot be had.
        Entered before the MLflow run opens."""
        return contextlib.nullcontext()

    @abstractmethod
    def fit(self, job) -> None:
        """Train `job.model` on `job.data` for `job.trainer.max_steps` steps, reporting every
        step to `job.meter` (record, evaluate) and `job.checkpoints` (save), and exporting the
        model with `job.export_model` at the end (on the logging rank). A resumable backend
        starts after the step stored in `job.resume_state` when that is set.

        A `data_parallel` backend's loop runs on every rank of the runner at once (`job.parallel`
        is then the runner's `Workers`, `job.device` the rank's device) and keeps these rules, or
        the ranks wait on each other for ever:
        - Collective calls, made by every rank at the same steps in the same order: the forward
          and backward of the model that `job.parallel.wrap` returned (DDP's gradient AllReduce;
          micro-batches inside `job.parallel.accumulating`), `job.parallel.all_reduce_`,
          `job.parallel.replica_metrics` and `job.parallel.agree`. A rank that stops before
          `max_steps` does so only when every rank does (`agree` on it first).
        - Every rank calls `job.meter.record` before each update and applies the update only as
          its answer says (with the gradients about to be applied: on the runner every rank
          decides from the all-reduced ones, alike).
        - Every rank calls `job.meter` (`steps`, `record`, `evaluate`, `log`) and
          `job.checkpoints.save` at the same steps: the meter logs to MLflow and the checkpoints
          are written only on the logging rank, and each rank reports to Ray Train on `save`.
        - Batches come from `job.train_batch(step, micro)`: each rank's own share of the same
          global batch, in the same seeded order; the model is built from the same seed on every
          rank (the same initial weights).
        - Only the logging rank (`job.parallel.logging`, rank 0) exports the model
          (`job.export_model`).
        """

    @abstractmethod
    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        """The model parameters stored in one of this backend's checkpoints, by name."""

    def load_checkpoint(self, source: Path | bytes) -> dict:
        """One of this backend's checkpoints (its file, or the file's bytes) as `job.resume_state`:
        everything `fit` needs to go on after the step it holds (`state["step"]`). Only a
        resumable backend has one. The state must pickle and must not name a file: the runner
        sends it to workers on other nodes through Ray's object store."""
        raise NotImplementedError(f"backend={self.name} cannot continue from a checkpoint")


def backends(*flags: str, unless: tuple[str, ...] = ()) -> list[str]:
    """The backends (conf/backend names, a user's own folders included) whose class sets every one
    of `flags` and none of `unless`, e.g. `backends("resumable")`: the names a message offers,
    found rather than listed by hand, so that a new backend file needs no message edited."""
    return list(backend_configs(*flags, unless=unless))


def backend_configs(*flags: str, unless: tuple[str, ...] = ()) -> dict[str, DictConfig]:
    """`backends(*flags, unless=...)` with each one's config, by name (each file composed once)."""
    from orchestrate import schema
    from orchestrate.config import group_options

    found = {}
    for name in group_options("backend"):
        node = backend_config(name)
        try:
            target = schema.target_of(node, "backend")
        except schema.ConfigError:  # a backend file whose class does not import offers nothing
            continue
        if all(getattr(target, flag, False) for flag in flags) and not any(getattr(target, f, False) for f in unless):
            found[name] = node
    return found


def backends_taking(precision: str) -> list[str]:
    """The single-process backends (conf/backend names) that train in `precision`."""
    from orchestrate import schema

    return [name for name, node in backend_configs(unless=("distributed",)).items()
            if precision in schema.target_of(node, "backend").precisions]


def backend_config(name: str) -> DictConfig:
    """conf/backend/<name>.yaml as the config composes it (so a user's own backend file works too)."""
    from orchestrate.config import load_config

    return load_config([f"backend={name}"]).backend
