"""The data-parallel context a backend's loop runs in: one process and no other workers unless
the runner's workers replace it (orchestrate.backends.runner.collective.Workers). A leaf: the job and
every loop use it, and it imports nothing of orchestrate but the meter's non-finite test."""

import contextlib
from collections.abc import Callable, Iterable

import torch

from orchestrate.meter import nonfinite


class Parallel:
    """One process and no other workers: the context a loop runs in unless the runner's workers
    replace it (`orchestrate.backends.runner.collective.Workers`, which all-reduces across ranks).
    Loops call these hooks unconditionally; alone, each one does nothing."""

    rank = 0
    world_size = 1
    stages = 1  # pipeline stages the model is cut into (the runner's `Stages`: trainer.pipeline_parallel_size)
    device: torch.device | None = None  # None: trainer.device
    logging = True  # this process logs, evaluates and checkpoints (rank 0)
    average_every = 0  # N: average the parameters every N updates instead of all-reducing gradients
    cores: float | None = None  # the CPUs this process's loop may use; None: what it finds (orchestrate.cpu.cores)
    # How the job learns the cores other processes keep busy (orchestrate.cpu.busy_elsewhere); None:
    # it measures them itself, once (Job.busy_cores). backend=auto's probes share the run's.
    busy: Callable[[], float] | None = None

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the model (of each pipeline stage): the ranks over the stages."""
        return self.world_size // self.stages

    @property
    def replica(self) -> int:
        """Which replica this rank is (rank r: stage r // replicas of replica r % replicas)."""
        return self.rank % self.replicas

    def part(self, model: torch.nn.Module, sample: Callable[[], torch.Tensor]) -> torch.nn.Module:
        """The part of `model` this process trains: all of it (a pipeline stage on the runner's
        stages; `sample()`, an input batch, sizes what crosses between them)."""
        return model

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the loop trains it (DDP across workers)."""
        return model

    def assemble(self, step: int, optimizer, trainer):
        """At every step, before its evaluation and checkpoint: the whole model where they read it,
        and what a checkpoint holds of the optimizer. Alone the model is whole: the optimizer itself
        (the runner's stages bring the model together on rank 0 and return the whole model's
        optimizer state there)."""
        return optimizer

    def checkpoint_extra(self) -> dict:
        """What a checkpoint holds beyond the model, optimizer, schedule and this process's RNG: nothing alone."""
        return {}

    def own_part(self, state: dict) -> dict:
        """A checkpoint's state as this process's optimizer takes it: all of it (a pipeline stage:
        its part of the optimizer state)."""
        return state

    def norms(self, found: dict[str, float]) -> dict[str, float]:
        """The whole model's norms from this process's (alone: the same)."""
        return found

    def accumulating(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward: no gradient AllReduce until the `last`."""
        return contextlib.nullcontext()

    def all_reduce_(self, flat: torch.Tensor) -> None:
        """Sum `flat` across workers, in place."""

    def replica_metrics(self, params: Iterable[torch.Tensor]) -> dict[str, float]:
        """At display steps: how far apart the workers' parameters are (nothing to compare alone)."""
        return {}

    def sum_(self, values: list[float]) -> list[float]:
        """`values` summed element by element over the workers: alone, themselves."""
        return values

    def agree(self, flag: bool) -> bool:
        """True when `flag` is true on every worker: alone, the flag itself."""
        return flag

    def update_allowed(self, finite: bool, grads: Callable[[], list[torch.Tensor]]) -> bool:
        """Whether this step's update goes ahead, decided alike on every rank: `finite` is this
        rank's own loss (and gradient norm); `grads()` the gradients about to be applied. Alone,
        `finite` itself."""
        return finite

    def hold(self, loss: torch.Tensor, grads: Callable[[], list[torch.Tensor]]) -> torch.Tensor:
        """`update_allowed` decided on the device, without waiting for it: a float flag, 1.0 to
        hold the update (the fused optimizers' `found_inf`). Alone: this step's loss is nan or inf."""
        return nonfinite(loss)
