"""A sweep's trials worked out before anything runs (orchestrate.sweeps.plan), and the entry
point's check of every one of them, whatever the launcher: one message, exit code 2, in seconds,
nothing written, and nothing the sweep started while it checked (its MLflow server, Ray) left
running."""

import os
import re
import subprocess
import sys
import time

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from orchestrate.sweeps import plan
from tests.conftest import ROOT, multirun_config
from tests.helpers import exit_code


def test_a_grid_expands_as_hydras_basic_sweeper_expands_it():
    cfg = multirun_config(["sweep=lr_grid", "backend=torch,ondevice", "trainer.max_steps=5"])
    lines = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()] + list(cfg.hydra.overrides.task)
    assert plan.is_grid(cfg)
    assert plan.trials(cfg) == BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)[0]
    assert plan.trials(cfg)[:2] == [["optimizer.lr=0.001", "sweep=lr_grid", "backend=torch", "trainer.max_steps=5"],
                                    ["optimizer.lr=0.001", "sweep=lr_grid", "backend=ondevice", "trainer.max_steps=5"]]
    assert len(plan.trials(cfg)) == 6


def test_an_optuna_search_space_is_checked_at_each_choice_and_both_ends_of_each_interval():
    # lr_optuna.yaml: optimizer.lr: tag(log, interval(1e-4, 3e-2)); trainer.batch_size: choice(32, 64, 128);
    # Optuna samples a range's integers from its start to its stop, both included.
    cfg = multirun_config(["+experiment=lr_search", "trainer.warmup_steps=range(0, 1000, 10)"])
    assert not plan.is_grid(cfg)
    trials = plan.trials(cfg)
    values = lambda key: {o for t in trials for o in t if o.startswith(f"{key}=")}  # noqa: E731
    assert values("optimizer.lr") == {"optimizer.lr=0.0001", "optimizer.lr=0.03"}
    assert values("trainer.batch_size") == {f"trainer.batch_size={b}" for b in (32, 64, 128)}
    assert values("trainer.warmup_steps") == {"trainer.warmup_steps=0", "trainer.warmup_steps=1000"}
    assert len(trials) == 3  # each value in one candidate, not every combination


def main(*args: str, cwd, ray_tmp) -> subprocess.CompletedProcess:
    """The command in `cwd`; a Ray it starts keeps its session in `ray_tmp`, where it is found."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(ray_tmp)}
    return subprocess.run([sys.executable, "-m", "orchestrate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def left_running(pattern: str) -> str:
    return subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout


@pytest.mark.parametrize("args, message", [
    # The default backend (ortmodule) as typed: where ORT is missing, every trial would be refused for that.
    pytest.param(["-m", "trainer.max_steps=0,10", "data=synthetic", "trainer=quick"],
                 r"error: trial 0 \(trainer.max_steps=0 data=synthetic trainer=quick\): trainer.max_steps=0: must be at "
                 r"least 1", marks=pytest.mark.ort),
    # A bad choice: the message a single run `backend=tensorflow` gets.
    (["-m", "backend=torch,tensorflow"],
     r"error: backend=tensorflow: no such choice; allowed: auto, compile, ondevice, ortmodule, runner, torch"),
    # Optuna's choices are each checked...
    pytest.param(["+experiment=lr_search", "+sweep", "trainer.max_steps=choice(10, 0)"],
                 r"error: trial \d+ \([^)]*trainer.max_steps=0[^)]*\): trainer.max_steps=0: must be at least 1",
                 marks=[pytest.mark.ort, pytest.mark.slow]),  # 10 s; "optuna interval" stands for it in the default tier
    # ...and an interval at its ends: Optuna would sample floats for an integer key.
    (["+experiment=lr_search", "+sweep", "trainer.max_steps=interval(10, 100)"],
     r"error: trainer.max_steps: Value '10.0' of type 'float' could not be converted to Integer"),
    # A trial bigger than the local Ray instance could ever start.
    (["-m", "optimizer.lr=0.1,0.2", "hydra.launcher.cpus_per_trial=64"],
     r"error: hydra.launcher.cpus_per_trial=64: a trial asks for more CPUs than the local Ray instance has \(\d+\); "
     r"allowed: 0 to \d+, or hydra.launcher.address of a larger cluster"),
], ids=["refused value", "bad choice", "optuna choice", "optuna interval", "trial too big"])
def test_a_bad_trial_stops_the_sweep_before_anything_runs(args, message, tmp_path, tmp_path_factory):
    ray_tmp = tmp_path_factory.mktemp("ray")
    began = time.monotonic()
    done = main(*args, cwd=tmp_path, ray_tmp=ray_tmp)
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.fullmatch(message, done.stderr.strip())
    assert time.monotonic() - began < 30
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no multirun/ folder
    # The server and Ray it started beside the check (orchestrate.sweeps.early) are gone: Ray's
    # processes end with the thread that started them, those its raylet started in their own time.
    pattern = f"{ray_tmp}|mlflow server.*{tmp_path}"
    deadline = time.monotonic() + 60
    while left_running(pattern):
        assert time.monotonic() < deadline, left_running(pattern)
        time.sleep(0.2)


def test_a_dry_run_of_a_sampling_sweep_prints_its_space_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """Optuna picks each trial from the results before it: a dry run has no next trial to show,
    so it shows the space it would sample from (checked at every choice and interval end)."""
    monkeypatch.chdir(tmp_path)
    assert exit_code(monkeypatch, "+experiment=lr_search", "+sweep", "+dry_run") == 0
    out = capsys.readouterr().out
    assert "dry run: OrchestrateOptunaSweeper would run 8 trial(s), each drawn from: optimizer.lr=tag(log, interval(" in out
    assert list(tmp_path.iterdir()) == []
