"""Every file in experiments/ composes and trains a few steps (so that no experiment rots)."""

from pathlib import Path

import pytest

from orchestrate import app
from orchestrate.config import load_config
from tests.conftest import ROOT

EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml"))


def test_experiments_are_global_package_files():
    for name in EXPERIMENTS:
        assert (ROOT / "experiments" / f"{name}.yaml").read_text().startswith("# @package _global_")


@pytest.mark.slow  # most experiments train through ORTModule (the default backend)
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_a_few_steps(name, tmp_path):
    cfg = load_config([f"+experiment={name}", "trainer.max_steps=4", "trainer.display_loss_steps=2",
                           "trainer.evaluation_period=4", "trainer.checkpoint_period=4", "trainer.warmup_steps=0",
                           "trainer.progress=false",
                           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])
    result = app.train(cfg, Path(tmp_path) / "out")
    assert len(result.history["train/loss"]) == 2
    assert (result.out_dir / "model.onnx").is_file()


def test_sweep_words_are_read_before_hydra():
    from orchestrate.cli import rewrite_sweep_words

    assert rewrite_sweep_words(["backend=ortmodule", "+sweep"]) == ["--multirun", "backend=ortmodule", "sweep=lr_grid"]
    assert rewrite_sweep_words(["+experiment=backend_shootout", "+sweep"]) == ["--multirun", "+experiment=backend_shootout"]
    assert rewrite_sweep_words(["+sweep=lr_optuna"]) == ["--multirun", "sweep=lr_optuna"]
    assert rewrite_sweep_words(["+sweep", "+dry_run"])[0] == "--multirun"
    assert "hydra.launcher.dry_run=true" in rewrite_sweep_words(["+sweep", "+dry_run"])
    assert rewrite_sweep_words(["-m", "optimizer.lr=1e-3,1e-2"]) == ["-m", "optimizer.lr=1e-3,1e-2"]
