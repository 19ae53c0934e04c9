"""orchestrate.sweeps.headstart and what it relies on: a sweep's trials composed once per choice
of config groups (app.Composer) exactly as Hydra composes each, data sets built once per process,
models built once per check, and a refused sweep that leaves no store, server or Ray behind."""

import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from orchestrate import app, job
from tests.conftest import ROOT

CASES = [
    ["optimizer.lr=0.01", "backend=torch"],
    ["backend=ondevice", "trainer.max_steps=5", "+trainer.nope=1"],
    ["model=cnn", "model.channels=[4]"],
    ["~trainer.seed"],
    ["+experiment=char_lm", "optimizer.lr=1e-3"],
    ["optimizer=sgd", "optimizer.momentum=0.5", "tracking.uri=sqlite:///x.db"],
    ["trainer.max_steps=nope"],
    ["model.hidden=[8,8]", "data=synthetic", "data.num_features=5"],
]


def composed(compose, overrides: list[str]) -> str:
    try:
        return OmegaConf.to_yaml(compose(overrides))
    except Exception as e:  # the same error, or the same config
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("overrides", CASES, ids=[" ".join(c) for c in CASES])
def test_a_trial_composes_to_what_hydra_composes(overrides):
    composer = app.Composer()
    composer(["backend=torch"])  # something already composed, to be copied rather than changed
    assert composed(composer, overrides) == composed(app.load_config, overrides)
    assert composed(composer, overrides) == composed(app.load_config, overrides)  # the cached base is untouched


def test_a_users_primary_config_composes_to_what_hydra_composes(tmp_path):
    """A primary config of the user's own that adds orchestrate's groups with `hydra.searchpath`
    (the README's my_project/conf/train.yaml): `backend=...` is a group there too."""
    (tmp_path / "train.yaml").write_text("defaults:\n  - config\n  - _self_\nhydra:\n  searchpath: "
                                         "[pkg://orchestrate.conf]\ntracking:\n  experiment: wine\n")
    source = app.ConfigSource(config_path=str(tmp_path), config_name="train")
    for overrides in (["backend=ondevice", "optimizer.lr=0.1"], ["model=cnn", "trainer.max_steps=3"]):
        assert (composed(app.Composer(source), overrides)
                == composed(lambda o: app.load_config(o, source), overrides))
        assert app.Composer(source)(overrides).tracking.experiment == "wine"


def test_trials_that_differ_in_values_compose_once():
    composer = app.Composer()
    for lr in (0.1, 0.2, 0.3):
        assert composer(["backend=torch", f"optimizer.lr={lr}"]).optimizer.lr == lr
    composer(["backend=ondevice", "optimizer.lr=0.1"])
    assert len(composer.composed) == 2


def test_a_data_set_is_built_once_per_config():
    a = job.build_data(app.load_config(["data=synthetic"]).data)
    assert job.build_data(app.load_config(["data=synthetic"]).data) is a
    assert job.build_data(app.load_config(["data=synthetic", "data.num_samples=64"]).data) is not a


def test_a_check_builds_a_model_once_per_model_data_and_seed():
    checked = {}
    for lr in (0.1, 0.2):
        app.check(app.load_config(["data=synthetic", "trainer=quick", f"optimizer.lr={lr}"]), checked)
    app.check(app.load_config(["data=synthetic", "trainer=quick", "model.hidden=[4]"]), checked)
    assert len(checked["models"]) == 2


def processes(pattern: str) -> set[int]:
    done = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return {int(p) for p in done.stdout.split()}


def test_a_refused_sweep_stops_what_it_started_early(tmp_path, tmp_path_factory):
    """The server and Ray start with the command; a trial refused by the check stops them, in
    seconds, and removes the store: nothing is left in the folder or running."""
    ray_tmp = tmp_path_factory.mktemp("ray")  # the Ray it starts keeps its session there: found by it
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrate", "-m", "trainer.max_steps=10,0", "data=synthetic",
                           "trainer=quick"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(ray_tmp)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == ("error: trial 1 (trainer.max_steps=0 data=synthetic trainer=quick): "
                                   "trainer.max_steps=0: must be at least 1")
    assert time.monotonic() - began < 30
    assert list(tmp_path.iterdir()) == []
    # Ray's processes end with the thread that started them; those its raylet started (workers,
    # agents) notice their raylet is gone within seconds.
    deadline = time.monotonic() + 60
    while processes(f"mlflow server.*{tmp_path}") or processes(str(ray_tmp)):
        assert time.monotonic() < deadline, subprocess.run(["pgrep", "-af", f"{ray_tmp}|mlflow server.*{tmp_path}"],
                                                           capture_output=True, text=True).stdout
        time.sleep(0.2)
