"""orchestrate's Hydra launcher: each trial of a sweep is a Ray task, tracked as a nested MLflow run.

Shaped like Hydra's own launcher plugins: this thin public class and its `*Conf` dataclass; the
work is in `orchestrate.launch._core`, imported only when a sweep launches. Why not
`hydra-ray-launcher`: it raises the first trial's error only after every trial ran, cannot stop at
the first failure, and knows nothing of MLflow (parent run, nested trials, resuming a sweep).
"""

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class OrchestrateRayLauncherConf:
    _target_: str = "hydra_plugins.orchestrate_ray_launcher.ray_launcher.OrchestrateRayLauncher"
    address: Optional[str] = None  # Ray cluster to join ("auto", "ray://host:10001"); None: start a local one
    num_cpus: Optional[int] = None  # CPUs of the local Ray instance; None: all cores
    cpus_per_trial: float = 1  # Ray resources each trial asks for; concurrency = cores / cpus_per_trial
    gpus_per_trial: float = 0
    fail_fast: bool = False  # stop the sweep (cancel pending trials) at the first failed trial
    resume: bool = True  # re-running the same sweep skips its FINISHED trials, under the same parent run
    dry_run: bool = False  # print the plan (trials, overrides, resources) and run nothing
    tracking_server: bool = True  # SQLite store: route every trial's writes through one local MLflow server


ConfigStore.instance().store(group="hydra/launcher", name="orchestrate_ray", node=OrchestrateRayLauncherConf,
                             provider="orchestrate")


class OrchestrateRayLauncher(Launcher):
    def __init__(self, **conf: Any) -> None:
        self.conf = OrchestrateRayLauncherConf(**conf)
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        self.sweep = None  # orchestrate.launch._core.Sweep, made at the first launch

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from orchestrate.launch import _core

        return _core.launch(self, job_overrides, initial_job_idx)
