"""scripts/scale.py: a pruned Optuna sweep on a loopback multi-node cluster, its slot occupancy
and wall time against the ideal (docs/scale.md has the 200-trial figures). CI checks the
occupancy arithmetic; `make test-long` runs a small sweep through the whole script."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import long

ROOT = Path(__file__).resolve().parents[1]
# The script is the one place its logic lives; it is a file, not part of the package.
_spec = importlib.util.spec_from_file_location("scale", ROOT / "scripts" / "scale.py")
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)


def test_occupancy_counts_busy_slots_between_the_first_start_and_the_last_end():
    # 2 slots over 10 s: one busy the whole time, the other for 6 s of it (two trials with a gap).
    share, busy = scale.occupancy([(100.0, 110.0), (100.0, 103.0), (105.0, 108.0)], slots=2)
    assert share == pytest.approx((10 + 3 + 3) / 20)
    assert busy[-1] == (10.0, 0) and max(n for _, n in busy) == 2
    assert [n for t, n in busy if t == 3.0] == [1]  # the gap: one slot idle from 3 s to 5 s


@pytest.mark.slow
@pytest.mark.cluster
@long(stands_for="tests/test_scale.py::test_occupancy_counts_busy_slots_between_the_first_start_and_the_last_end")
def test_a_small_pruned_sweep_on_two_nodes_loses_no_trial_and_no_metric(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale.py"), "--trials", "12", "--nodes", "2",
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (figures,) = json.loads(out.read_text())["sweeps"]
    assert figures["trials"] == figures["finished"] == 12
    assert figures["lost"] == figures["twice"] == 0
    assert 0 < figures["occupancy"] <= 1 and figures["wall_over_ideal"] >= 1
    assert figures["summary_after_s"] >= 0 and figures["driver_peak_rss_mb"] > 0
