"""What a sweep's fast start relies on: its trials composed once per choice of config groups
(Composer) exactly as Hydra composes each, data sets built once per process, models built once
per check. A refused sweep leaves no store, server or Ray behind: tests/sweeps/test_plan.py."""


import pytest
from omegaconf import OmegaConf

from orchestrate import app, job
from orchestrate.config import Composer, ConfigSource, load_config
from tests.conftest import here

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
    composer = Composer()
    composer(["backend=torch"])  # something already composed, to be copied rather than changed
    assert composed(composer, overrides) == composed(load_config, overrides)
    assert composed(composer, overrides) == composed(load_config, overrides)  # the cached base is untouched


def test_a_users_primary_config_composes_to_what_hydra_composes(tmp_path):
    """A primary config of the user's own that adds orchestrate's groups with `hydra.searchpath`
    (the README's my_project/conf/train.yaml): `backend=...` is a group there too."""
    (tmp_path / "train.yaml").write_text("defaults:\n  - config\n  - _self_\nhydra:\n  searchpath: "
                                         "[pkg://orchestrate.conf]\ntracking:\n  experiment: wine\n")
    source = ConfigSource(config_path=str(tmp_path), config_name="train")
    for overrides in (["backend=ondevice", "optimizer.lr=0.1"], ["model=cnn", "trainer.max_steps=3"]):
        assert (composed(Composer(source), overrides)
                == composed(lambda o: load_config(o, source), overrides))
        assert Composer(source)(overrides).tracking.experiment == "wine"


def test_trials_that_differ_in_values_compose_once():
    composer = Composer()
    for lr in (0.1, 0.2, 0.3):
        assert composer(["backend=torch", f"optimizer.lr={lr}"]).optimizer.lr == lr
    composer(["backend=ondevice", "optimizer.lr=0.1"])
    assert len(composer.composed) == 2


def test_a_data_set_is_built_once_per_config():
    a = job.build_data(load_config(["data=synthetic"]).data)
    assert job.build_data(load_config(["data=synthetic"]).data) is a
    assert job.build_data(load_config(["data=synthetic", "data.num_samples=64"]).data) is not a


def test_a_check_builds_a_model_once_per_model_data_and_seed():
    cache = app.CheckCache()
    for lr in (0.1, 0.2):
        app.check(load_config(here(["data=synthetic", "trainer=quick", f"optimizer.lr={lr}"])), cache)
    app.check(load_config(here(["data=synthetic", "trainer=quick", "model.hidden=[4]"])), cache)
    assert len(cache.models) == 2
