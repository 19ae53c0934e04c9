"""trainer.resume's lookup: which run and checkpoint a resume continues, and its plain errors."""

import shlex
import subprocess

import pytest

from orchestrate import app
from orchestrate.schema import ConfigError
from orchestrate.resume import config_key, find_resume
from orchestrate.tracking import ui_command


def test_the_config_key_ignores_tracking_and_resume_settings_only(make_cfg):
    base = make_cfg("backend=torch")
    assert config_key(base) == config_key(make_cfg("backend=torch", "trainer.resume=auto", "tracking.run_name=x"))
    assert config_key(base) != config_key(make_cfg("backend=torch", "optimizer.lr=0.5"))


def test_resume_errors_name_the_key(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="trainer.resume=abc: no MLflow store at"):
        find_resume(make_cfg("trainer.resume=abc"))
    assert not (tmp_path / "mlflow.db").exists()  # asking created nothing

    same = ("backend=torch", "trainer.checkpoint_period=0")
    finished = app.train(make_cfg(*same), tmp_path / "out")
    with pytest.raises(ConfigError, match="trainer.resume=abc: no such run in .*; allowed: auto or a run id"):
        find_resume(make_cfg("trainer.resume=abc"))
    with pytest.raises(ConfigError, match=r"another config \(differs at optimizer.lr\)"):
        find_resume(make_cfg(*same, "optimizer.lr=0.5", f"trainer.resume={finished.run_id}"))
    point = find_resume(make_cfg(*same, f"trainer.resume={finished.run_id}"))
    assert point.run_id == finished.run_id and point.step == 30  # its last (and only) checkpoint
    assert find_resume(make_cfg(*same, "trainer.resume=auto")) is None  # finished: nothing to go on with


def test_a_checkpoint_only_in_mlflow_is_downloaded(make_cfg, tmp_path):
    import shutil

    run = app.train(make_cfg("backend=torch"), tmp_path / "out")
    shutil.rmtree(tmp_path / "out")  # another machine: only the MLflow store has the checkpoint
    point = find_resume(make_cfg("backend=torch", f"trainer.resume={run.run_id}"))
    assert point.local is None and point.artifact == "checkpoints/step_0000030.pt"
    assert point.fetch(tmp_path / "new").read_bytes()[:2] == b"PK"  # a torch zip file


def test_the_ui_command_runs_as_printed_when_the_environment_is_not_active(monkeypatch):
    """`mlflow` is on the PATH only while the virtual environment is active: the printed command
    names this environment's own `mlflow` unless the PATH already finds it."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    command = shlex.split(ui_command("sqlite:///mlflow.db"))
    assert command[1:] == ["ui", "--backend-store-uri", "sqlite:///mlflow.db", "--host", "127.0.0.1", "--port", "5000"]
    done = subprocess.run([command[0], "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "version" in done.stdout


def test_a_resumed_run_opens_in_its_own_experiment_whatever_is_active(make_cfg, tmp_path):
    """MLflow refuses start_run(run_id=...) outside the active experiment: an earlier run in the
    same process (another experiment) must not stop a resume."""
    import mlflow

    from orchestrate.tracking import Tracker

    cfg = make_cfg("backend=torch")
    client = mlflow.tracking.MlflowClient(cfg.tracking.uri)
    stopped = client.create_run(client.create_experiment("where_it_ran")).info.run_id
    mlflow.set_tracking_uri(cfg.tracking.uri)
    mlflow.set_experiment("another")  # what an earlier run in this process left active
    try:
        with Tracker(cfg, run_name="x", tags={}, out_dir=tmp_path, resume_run_id=stopped) as tracker:
            assert tracker.run_id == stopped
        assert client.get_run(stopped).info.status == "FINISHED"
    finally:
        mlflow.set_tracking_uri("")
