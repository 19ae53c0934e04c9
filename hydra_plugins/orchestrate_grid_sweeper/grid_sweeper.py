"""A grid sweeper for any Hydra app: Hydra's basic sweeper (the same grid, batches and job order),
except that it does not compose every job's config before the first batch launches (unless
`validate_jobs: true`).

Hydra's basic sweeper composes every job of a batch before launching it, to catch a bad override
early ("this can be a bit slow for large jobs", its source says): about 0.1-0.2 s a job, minutes
before the first job of a grid of thousands starts. Launchers compose each job again when they run
it, so without that a bad job fails on its own when it is launched, and the sweep starts at once.
orchestrate's command line checks every trial of a sweep before Hydra starts, from configs
composed once per choice of config groups (orchestrate.config.Composer).

Shaped like Hydra's own plugins: this thin public class and its `*Conf` dataclass, stored in the
ConfigStore as hydra/sweeper=orchestrate_grid.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore


@dataclass
class OrchestrateGridSweeperConf:
    # The class Hydra instantiates with these settings.
    _target_: str = "hydra_plugins.orchestrate_grid_sweeper.grid_sweeper.OrchestrateGridSweeper"
    # Jobs launched together (the launcher gets one batch at a time); null: every job in one batch.
    max_batch_size: Optional[int] = None
    # The grid, as Hydra's basic sweeper takes it: key -> comma-separated values, range(...), ...
    params: Optional[dict[str, str]] = None
    # Compose every job of a batch before launching it, as Hydra's basic sweeper always does; false:
    # the launcher composes each job when it runs it, and a bad job fails alone.
    validate_jobs: bool = False


ConfigStore.instance().store(group="hydra/sweeper", name="orchestrate_grid", node=OrchestrateGridSweeperConf,
                             provider="orchestrate")


class OrchestrateGridSweeper(BasicSweeper):
    """Hydra's BasicSweeper, without its composition of every job up front unless `validate_jobs`."""

    def __init__(self, max_batch_size: Optional[int], params: Optional[dict[str, str]] = None,
                 validate_jobs: bool = False) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.validate_jobs = validate_jobs

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        if self.validate_jobs:
            super().validate_batch_is_legal(batch)
