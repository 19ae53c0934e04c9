"""Kills of every kind at random moments in a pruned sweep on a 2-node Ray cluster, then the same
command (scripts/chaos_sweep.py, whose table is docs/chaos_sweep.md): fewer trials than the script's
default. Long tier; CI's tier runs the issue's case (three kills of the driver, then the command)."""

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import long
from tests.helpers import loopback_cluster

ROOT = Path(__file__).resolve().parents[1]
# The script is the one place its logic lives; it is a file, not part of the package.
_spec = importlib.util.spec_from_file_location("chaos_sweep", ROOT / "scripts" / "chaos_sweep.py")
chaos_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos_sweep)

IN_CI = "tests/sweeps/test_runs.py::test_three_kills_then_the_same_command_leave_every_trial_once_and_no_run_running"


@pytest.mark.slow
@long(IN_CI)
def test_a_sweep_killed_at_random_ends_with_every_trial_once_and_no_run_running(tmp_path):
    with loopback_cluster(nodes=2, cpus_per_node=1) as (address, env):
        result = chaos_sweep.run(trials=12, kills=4, seed=1, folder=tmp_path, address=address, env=env, window_s=12)
    report = chaos_sweep.table(result)
    assert result["exit_code"] == 0, report
    assert result["runs_running"] == 0 and result["study_running"] == 0, report
    assert result["study_finished"] == 12 and result["summary_rows"] == result["study_points"], report
    assert result["points_twice"] == 0 and result["study_without_run"] == 0, report
    assert len(result["kills"]) == 4, report
