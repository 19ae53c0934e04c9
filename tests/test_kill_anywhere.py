"""Kill -9 anywhere, then `trainer.resume=auto`: a few of scripts/kill_anywhere.py's points, one of
each kind (the script runs many; docs/kill_anywhere.md has its table).
Each point is a real command killed with SIGKILL and the same command resumed, as a user would."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The script is the one place its logic lives; it is a file, not part of the package.
_spec = importlib.util.spec_from_file_location("kill_anywhere", ROOT / "scripts" / "kill_anywhere.py")
kill_anywhere = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kill_anywhere)
Point = kill_anywhere.Point

# The representative subset CI runs: the on-device backend (the quickest to start) at four kinds
# of point, against one reference run. Runner workers and torch are tests/test_app.py's and
# tests/backends/test_runner.py's subjects too; the script runs every kind on every backend.
POINTS = [
    Point("ondevice", "before-ckpt", "step", 5),  # nothing to resume: a new run, the killed one ended KILLED
    Point("ondevice", "ckpt-write", "ckpt-partial", 20),  # a half-written temporary checkpoint
    Point("ondevice", "eval", "eval", 16),  # evaluated, not yet logged
    Point("ondevice", "last-steps", "ckpt-done", 30),  # after the final checkpoint, before the export
]


@pytest.mark.slow
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path):
    outcomes = kill_anywhere.run_all(POINTS, tmp_path)
    print("\n" + kill_anywhere.table(outcomes))
    for o in outcomes:
        label = f"{o.point.backend} {o.point.label}: {'; '.join(o.notes)}"
        assert o.killed and o.resumed, label
        # Every step's loss and every evaluation exactly once in the finished run...
        assert o.steps_once, label
        # ...the killed run itself once it had a checkpoint to go on from.
        assert o.same_run == (o.point.category != "before-ckpt"), label
        assert o.none_running, label  # no run left RUNNING by the kill
        # These backends are deterministic on CPU: the losses and weights of a run that never stopped.
        assert o.loss_diff == 0 and o.weight_diff == 0, label
