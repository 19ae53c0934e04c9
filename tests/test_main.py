"""The command line: `python -m orchestrate ...` end to end, and bad input refused with one
plain message, exit code 2, before anything is written."""

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from orchestrate.__main__ import main
from tests.conftest import BACKENDS, metric_steps


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "orchestrate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_cli_trains_digits(backend, tmp_path):
    """The README's command on the digits task, with the embedded MLflow store in the cwd."""
    done = run_cli(f"backend={backend}", "trainer.max_steps=150", "trainer.progress=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MLflow run" in done.stdout and "mlflow ui --backend-store-uri" in done.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_id in done.stdout
    assert run.data.tags["backend"] == backend
    assert run.data.metrics["final/eval_accuracy"] > 0.9
    losses = [v for _, v in metric_steps(client, run.info.run_id, "train/loss")]
    assert losses[-1] < losses[0] / 3


BAD_INPUT = [
    (["trainer.stepz=5"], "trainer.stepz: unknown key; allowed keys in trainer: max_steps, batch_size"),
    (["trainer.max_steps=abc"], "trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer"),
    (["backend=tensorflow"], "backend=tensorflow: no such choice; allowed: ondevice, ortmodule, runner, torch"),
    (["backend.bogus=1"], "backend.bogus: unknown key; allowed keys in backend: _target_, name"),
    (["trainer.lr_schedule=wavy"], "trainer.lr_schedule: Invalid value 'wavy', expected one of [constant, linear, cosine]"),
    (["trainer.max_steps=0"], "trainer.max_steps=0: must be at least 1"),
    (["optimizer=fused_adam"], "optimizer=fused_adam (onnxruntime.training.optim.FusedAdam) needs CUDA"),
    (["trainer.precision=fp16"], "trainer.precision=fp16 needs CUDA, and this machine has none"),
    (["trainer.device=cuda"], "trainer.device=cuda needs CUDA, and this machine has none"),
    (["backend=ortmodule", "backend.fp16_optimizer=true"], "backend.fp16_optimizer=true (FP16_Optimizer) needs CUDA"),
    (["backend=ondevice", "backend.frozen_params=[encoder.*]"], "backend.frozen_params: 'encoder.*' matches no parameter"),
    (["backend=ondevice", "optimizer._target_=torch.optim.Adam"], "the on-device API offers torch.optim.AdamW and torch.optim.SGD"),
    (["backend=ondevice", "data=synthetic", "data.loss=huber"], "data.loss='huber' is not one of cross_entropy, mse, bce_with_logits, l1"),
    (["model=char_transformer", "data=python_source", "data.files=[no_such_module.py]"], "data.files: no_such_module.py not found"),
    (["model.hidden_size=3"], "model.hidden_size: unknown key; allowed keys in model: _target_, in_features"),
    (["model._target_=orchestrate.tasks.models.Nope"], "model._target_"),
    (["trainer.batch_size=5000"], "trainer.batch_size=5000 x 1 worker(s) is larger than the training set"),
    (["trainer.resume=0123abc"], "trainer.resume=0123abc: no MLflow store at sqlite:///mlflow.db, so no such run"),
]


@pytest.mark.parametrize("overrides,message", BAD_INPUT, ids=[" ".join(o) for o, _ in BAD_INPUT])
def test_bad_input_is_one_plain_message_exit_2_nothing_written(overrides, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["orchestrate", *overrides])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err, err
    assert len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no outputs/


def test_bad_input_exit_code_from_a_real_process(tmp_path):
    done = run_cli("backend=nope", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: backend=nope: no such choice; allowed: ondevice, ortmodule, runner, torch"
    assert list(tmp_path.iterdir()) == []
