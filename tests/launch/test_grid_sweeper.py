"""hydra/sweeper=orchestrate_grid (hydra_plugins/orchestrate_grid_sweeper): Hydra's basic sweeper,
the same grid in the same order, without composing every job before the first one runs unless
`validate_jobs: true`. In-process sweeps of Hydra's test app on Hydra's basic launcher."""

from pathlib import Path

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import MissingConfigException
from hydra.plugins.sweeper import Sweeper

from hydra_plugins.orchestrate_grid_sweeper.grid_sweeper import OrchestrateGridSweeper


def test_discovery() -> None:
    assert OrchestrateGridSweeper.__name__ in [x.__name__ for x in Plugins.instance().discover(Sweeper)]


def sweep_of(hydra_sweep_runner, tmp_path, task_function, *overrides: str):
    return hydra_sweep_runner(calling_file=None, calling_module="hydra.test_utils.a_module",
                              task_function=task_function, config_path="configs", config_name="compose.yaml",
                              overrides=["hydra/sweeper=orchestrate_grid", "hydra/launcher=basic", *overrides],
                              temp_dir=tmp_path / "sweep")  # removed by the runner once the sweep is done


def recorder(folder: Path):
    folder.mkdir(exist_ok=True)

    def task(cfg):
        (folder / f"{cfg.get('a', 'x')}-{cfg.get('b', 'x')}-{cfg.get('db', {}).get('driver', 'none')}.ran").touch()
        return cfg.get("a")

    return task


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_the_same_grid_in_the_same_order_as_hydras_basic_sweeper(hydra_sweep_runner, tmp_path):
    lines = ["+a=1,2", "+b=x,y,z"]
    with sweep_of(hydra_sweep_runner, tmp_path, recorder(tmp_path / "ran"), *lines) as sweep:
        ran = [list(r.overrides) for r in sweep.returns[0]]
    assert ran == BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)[0]
    assert len(list((tmp_path / "ran").glob("*.ran"))) == 6


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_a_job_that_does_not_compose_fails_when_launched_not_before(hydra_sweep_runner, tmp_path):
    """Job 1 names a config that does not exist: job 0 has run by the time the sweep fails."""
    with pytest.raises(MissingConfigException, match="nope"):
        with sweep_of(hydra_sweep_runner, tmp_path, recorder(tmp_path / "ran"), "+db=mysql,nope"):
            pass
    assert [p.name for p in (tmp_path / "ran").glob("*.ran")] == ["x-x-mysql.ran"]


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_validate_jobs_composes_every_job_before_any_runs(hydra_sweep_runner, tmp_path):
    with pytest.raises(MissingConfigException, match="nope"):
        with sweep_of(hydra_sweep_runner, tmp_path, recorder(tmp_path / "ran"), "+db=mysql,nope",
                      "hydra.sweeper.validate_jobs=true"):
            pass
    assert not list((tmp_path / "ran").glob("*.ran"))
