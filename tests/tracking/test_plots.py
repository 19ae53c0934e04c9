"""Loss curves (orchestrate.tracking.plots): drawn without a display, matplotlib's notices in the log only."""

import os
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# The logging Hydra sets up for a run (a console handler and the job's log file), then a chart
# drawn by a matplotlib with no font cache yet, as on a fresh machine (a new MPLCONFIGDIR).
DRAW = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from orchestrate.tracking.plots import loss_curves

    folder = Path(sys.argv[1])
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(logging.StreamHandler(sys.stderr))
    root.addHandler(logging.FileHandler(folder / "run.log"))
    loss_curves({"a": {"train/loss": [(1, 2.0), (2, 1.0)]}}, folder / "curves.png", "loss")
    print(len(root.handlers[0].filters))
""")


def test_a_fresh_machine_s_font_cache_notice_goes_to_the_log_not_the_console(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLCONFIGDIR": str(tmp_path / "mpl")}
    done = subprocess.run([sys.executable, "-c", DRAW, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert "generated new fontManager" in (tmp_path / "run.log").read_text()
    assert "fontManager" not in done.stderr, done.stderr
    assert done.stdout.strip() == "0"  # the console handler is left as it was found
