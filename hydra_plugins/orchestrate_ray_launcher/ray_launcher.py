"""A Hydra launcher that runs each job of a sweep (`--multirun`) as a Ray task, for any Hydra app:
select it with `hydra/launcher=orchestrate_ray` and set its options under `hydra.launcher.*`.

Shaped like Hydra's own launcher plugins: this thin public class and its `*Conf` dataclass (stored
in the ConfigStore as hydra/launcher=orchestrate_ray); the work is in `orchestrate.launch._core`,
imported only when a sweep launches, so that discovering plugins stays cheap and imports no Ray.
Why not `hydra-ray-launcher`: it raises the first job's error only after every job ran, cannot stop
at the first failure, asks Ray for no resources per job, and waits forever for jobs that the
cluster cannot hold.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class OrchestrateRayLauncherConf:
    # The class Hydra instantiates with these settings.
    _target_: str = "hydra_plugins.orchestrate_ray_launcher.ray_launcher.OrchestrateRayLauncher"
    # A running Ray cluster to join ("auto", "ray://host:10001", "127.0.0.1:6379"); null: the one in
    # $RAY_ADDRESS if set, else a new local instance bound to 127.0.0.1.
    address: Optional[str] = None
    # CPUs of a new local instance; null: all cores. Ignored when joining a cluster.
    num_cpus: Optional[int] = None
    # CPUs each job asks Ray for, which sets how many run at once (2 CPUs, 0.5 each: 4 at once).
    cpus_per_trial: float = 1
    # GPUs each job asks for (fractions share a GPU); Ray sets CUDA_VISIBLE_DEVICES in the job.
    gpus_per_trial: float = 0
    # Run every job in a new worker process (Ray's max_calls=1), not one that ran an earlier job:
    # no job inherits another's imports, caches or memory (a comparison's timings and memory peaks).
    process_per_trial: bool = False
    # Stop the sweep at the first failed job: cancel the jobs still pending or running, raise its error.
    fail_fast: bool = False
    # A job's resources not free anywhere within this many seconds (too few on every node, no GPU,
    # a cluster busy with other work) stop the sweep with one message, not an endless wait.
    placement_timeout_s: float = 60
    # Print the plan (jobs, where, resources, each job's overrides) and run nothing.
    dry_run: bool = False


ConfigStore.instance().store(group="hydra/launcher", name="orchestrate_ray", node=OrchestrateRayLauncherConf,
                             provider="orchestrate")


class OrchestrateRayLauncher(Launcher):
    """Runs each job of a sweep as a Ray task; see `orchestrate.launch._core`."""

    def __init__(self, **conf: Any) -> None:
        self.conf = OrchestrateRayLauncherConf(**conf)
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        self.ready = False  # Ray started or joined and a job's placement checked (orchestrate.launch._core.ready)
        self.in_flight: set = set()  # the Ray tasks of jobs submitted and not returned, across `launch` calls

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from orchestrate.launch import _core

        return _core.launch(self, job_overrides, initial_job_idx)

    def cancel(self) -> None:
        """End every job still running or queued (a sweeper stopping early: Ctrl-C)."""
        from orchestrate.launch import _core

        _core.cancel_in_flight(self)

    def slots(self) -> int:
        """How many jobs run at once: as many as the cluster fits, by the resources each asks
        for (Ray is started or joined first). Asynchronous sweepers keep that many launched."""
        from orchestrate.launch import _core

        _core.ready(self)
        return _core.slots(self.conf)

    def queued(self) -> int:
        """How many jobs beyond `slots` an asynchronous sweeper keeps launched, waiting in Ray's
        queue for the next free slot (see `orchestrate.launch._core.queued`)."""
        from orchestrate.launch import _core

        _core.ready(self)
        return _core.queued(self.conf)
