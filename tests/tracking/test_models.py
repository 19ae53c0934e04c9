"""What a run logs beside its metrics (orchestrate.tracking.models and .datasets), read back
through MLflow's public client from a real `mlflow server` (and a local SQLite store): the trained
model as a LoggedModel that loads with `mlflow.pyfunc` (and `mlflow models serve` answers with)
and predicts the eval split with the accuracy the run logged, registered with the alias `best` on
the best one; each checkpoint's model; the data as the run's inputs, whose digest tells two data
sets apart; MLflow's system metrics when asked for."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import mlflow
import numpy as np
import pytest

from orchestrate import app
from orchestrate.job import build_data
from tests.conftest import client_for
from tests.helpers import free_port


def accuracy_of(model, data) -> float:
    out = model.predict(data.x_eval.numpy())
    logits = out["logits"] if isinstance(out, dict) else np.asarray(out)
    return float((logits.argmax(-1) == data.y_eval.numpy()).mean())


@pytest.fixture(scope="module")
def registered(mlflow_server, tmp_path_factory):
    """Two runs of torch on the digits (the default data), both registered as digits-mlp, and one
    on the synthetic data; (client, first run, second run, synthetic run)."""
    from orchestrate.config import load_config

    common = ["backend=torch", "trainer=quick", "trainer.max_steps=60", f"tracking.uri={mlflow_server}",
              "tracking.experiment=outputs", "model.hidden=[32]"]
    runs = [app.train(load_config([*common, "tracking.register_model=digits-mlp", f"optimizer.lr={lr}"]),
                      tmp_path_factory.mktemp("run")) for lr in (0.003, 0.01)]
    other = app.train(load_config([*common, "data=synthetic"]), tmp_path_factory.mktemp("synthetic"))
    return client_for(mlflow_server), *runs, other


def test_the_model_is_a_logged_model_that_predicts_the_eval_split_with_the_logged_accuracy(registered, mlflow_server):
    client, first, _, _ = registered
    run = client.get_run(first.run_id)
    (output,) = [o for o in run.outputs.model_outputs if o.step == 60]
    model = client.get_logged_model(output.model_id)
    assert model.name == "model"
    assert str(model.status).endswith("READY") and model.source_run_id == first.run_id
    found = client.search_logged_models([run.info.experiment_id])
    assert output.model_id in {m.model_id for m in found}
    linked = {m.key: m for m in model.metrics}
    assert linked["eval/accuracy"].value == run.data.metrics["final/eval_accuracy"]
    assert linked["eval/accuracy"].dataset_name == "Digits"
    # The same point in the run's history once: linking it to the model added none.
    assert [m.step for m in client.get_metric_history(first.run_id, "eval/accuracy")].count(60) == 1
    mlflow.set_tracking_uri(mlflow_server)
    try:
        loaded = mlflow.pyfunc.load_model(f"models:/{output.model_id}")
    finally:
        mlflow.set_tracking_uri(None)
    data = build_data(client_config().data)
    assert accuracy_of(loaded, data) == pytest.approx(run.data.metrics["final/eval_accuracy"], abs=1 / len(data.y_eval))


@pytest.mark.parametrize("backend", ["torch", "ondevice"])
def test_each_checkpoint_is_a_model_at_its_step_that_predicts_with_that_step_s_accuracy(backend, make_cfg, tmp_path):
    """tracking.log_checkpoints: every checkpoint before the last is also a LoggedModel
    `checkpoint-<step>` (the last step's is the run's own `model`), linked to its step and loading
    with `mlflow.pyfunc` to predict the eval split with the accuracy logged at that step."""
    cfg = make_cfg(f"backend={backend}", "data=digits", "trainer.max_steps=45", "model.hidden=[32]")
    result = app.train(cfg, tmp_path / "out")
    client = client_for(cfg.tracking.uri)
    outputs = {o.step: client.get_logged_model(o.model_id) for o in client.get_run(result.run_id).outputs.model_outputs}
    assert {step: m.name for step, m in outputs.items()} == {15: "checkpoint-15", 30: "checkpoint-30", 45: "model"}
    accuracy = dict(result.history["eval/accuracy"])
    data = build_data(cfg.data)
    for step in (15, 30):
        assert {m.key: m.value for m in outputs[step].metrics}["eval/accuracy"] == accuracy[step]
        mlflow.set_tracking_uri(cfg.tracking.uri)
        try:
            loaded = mlflow.pyfunc.load_model(f"models:/{outputs[step].model_id}")
        finally:
            mlflow.set_tracking_uri(None)
        assert accuracy_of(loaded, data) == pytest.approx(accuracy[step], abs=1 / len(data.y_eval))
    assert accuracy[15] != accuracy[45]  # the checkpoints are the models of their own steps


def test_checkpoints_not_logged_are_no_models(make_cfg, tmp_path):
    cfg = make_cfg("backend=torch", "tracking.log_checkpoints=false")
    result = app.train(cfg, tmp_path / "out")
    outputs = client_for(cfg.tracking.uri).get_run(result.run_id).outputs.model_outputs
    assert [o.step for o in outputs] == [30]


def client_config():
    from orchestrate.config import load_config

    return load_config([])


def test_each_final_model_is_a_new_version_and_best_goes_to_the_best_evaluation(registered):
    client, first, second, _ = registered
    versions = sorted(client.search_model_versions("name = 'digits-mlp'"), key=lambda v: int(v.version))
    assert [v.run_id for v in versions] == [first.run_id, second.run_id]
    losses = [client.get_run(r.run_id).data.metrics["final/eval_loss"] for r in (first, second)]
    assert losses[0] != losses[1]
    best = versions[losses.index(min(losses))]  # sweep.metric eval_loss, minimize: the defaults
    assert client.get_model_version_by_alias("digits-mlp", "best").version == best.version


def test_registered_in_a_local_store_best_stays_with_the_better_model(make_cfg, tmp_path):
    """The default SQLite store (where MLflow reserves the alias `latest`): a worse run's model is a
    new version (`models:/NAME/latest`) and `best` stays where it was."""
    import mlflow

    common = ["backend=torch", "data=digits", "model.hidden=[32]", "tracking.register_model=local-mlp"]
    good = app.train(make_cfg(*common, "optimizer.lr=0.01"), tmp_path / "good")
    worse = app.train(make_cfg(*common, "optimizer.lr=0.00001"), tmp_path / "worse")
    uri = make_cfg().tracking.uri
    client = client_for(uri)
    assert good.metrics["eval_loss"] < worse.metrics["eval_loss"]
    assert client.get_model_version_by_alias("local-mlp", "best").run_id == good.run_id
    assert {v.version: v.run_id for v in client.search_model_versions("name = 'local-mlp'")} == {
        1: good.run_id, 2: worse.run_id}
    mlflow.set_tracking_uri(uri)
    try:
        newest = mlflow.pyfunc.load_model("models:/local-mlp/latest")
    finally:
        mlflow.set_tracking_uri(None)
    assert newest.metadata.run_id == worse.run_id

# The runner: rank 0 logs the model in its worker (here the one worker, in the driver's process),
# and the driver's run fails with what the registry said.
@pytest.mark.parametrize("backend", [("backend=torch",), ("backend=runner", "trainer.num_workers=1")],
                         ids=["torch", "runner"])
def test_a_registration_the_registry_refuses_fails_the_run_with_its_model_logged(backend, make_cfg, tmp_path,
                                                                                  monkeypatch):
    """A name that passes the up-front check can still be refused at the end (a registry that is
    read-only, or down): the command fails (the run FAILED, saying why) and the model is logged."""
    from mlflow.exceptions import MlflowException

    from orchestrate.tracking import models

    def refuse(*args, **kwargs):
        raise MlflowException("the registry is read-only")

    monkeypatch.setattr(models, "add_version", refuse)
    cfg = make_cfg(*backend, "data=synthetic", "model.hidden=[16]", "tracking.register_model=refused-mlp")
    with pytest.raises(models.NotRegistered, match=r"was logged, not registered as refused-mlp \(MlflowException: "
                                                    r"the registry is read-only\)"):
        app.train(cfg, tmp_path / "out")
    client = client_for(cfg.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "FAILED" and "not registered as refused-mlp" in run.data.tags["error"]
    (model,) = [m for m in client.search_logged_models([run.info.experiment_id]) if m.name == "model"]
    assert (model.source_run_id, str(model.status)) == (run.info.run_id, "READY")


def test_the_data_is_on_the_run_and_its_digest_tells_data_sets_apart(registered):
    client, first, second, other = registered
    def inputs(result):
        return {[t.value for t in d.tags if t.key == "mlflow.data.context"][0]: (d.dataset.name, d.dataset.digest)
                for d in client.get_run(result.run_id).inputs.dataset_inputs}

    digits, again, synthetic = inputs(first), inputs(second), inputs(other)
    assert set(digits) == {"train", "eval"} and digits == again  # the same data: the same digests
    assert synthetic["train"][0] == "Synthetic" and synthetic["train"][1] != digits["train"][1]
    assert json.loads(client.get_run(first.run_id).inputs.dataset_inputs[0].dataset.profile)["features_shape"]


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_the_same_predictions(registered, mlflow_server):
    client = registered[0]
    best = client.get_model_version_by_alias("digits-mlp", "best")
    version = best.version
    port = free_port()
    # As from an activated environment: the scoring server is started as `uvicorn` from the PATH.
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server,
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    serve = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/digits-mlp/{version}",
                              "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).close()
                break
            except OSError:
                assert serve.poll() is None and time.monotonic() < deadline, "mlflow models serve did not start"
                time.sleep(1)
        data = build_data(client_config().data)
        x = data.x_eval.numpy()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations",
                                         json.dumps({"inputs": x.tolist()}).encode(),
                                         {"Content-Type": "application/json"})
        served = json.loads(urllib.request.urlopen(request, timeout=60).read())["predictions"]
        logits = np.asarray(served["logits"] if isinstance(served, dict) else served)
        accuracy = float((logits.argmax(-1) == data.y_eval.numpy()).mean())
        assert accuracy == pytest.approx(client.get_run(best.run_id).data.metrics["final/eval_accuracy"],
                                         abs=1 / len(data.y_eval))
    finally:
        serve.terminate()
        serve.wait(timeout=30)


def test_system_metrics_when_asked_for_and_only_then(registered, make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    result = app.train(make_cfg("backend=torch", "tracking.system_metrics=true", "trainer.max_steps=600",
                                "trainer.evaluation_period=0", "trainer.checkpoint_period=0"), tmp_path)
    keys = client_for(make_cfg().tracking.uri).get_run(result.run_id).data.metrics
    assert any(k.startswith("system/cpu_utilization") for k in keys), sorted(keys)
    client, first, _, _ = registered  # off by default
    assert not any(k.startswith("system/") for k in client.get_run(first.run_id).data.metrics)


def test_a_model_is_logged_where_no_onnx_runtime_is_installed(make_cfg, tmp_path, monkeypatch):
    """The base install has no ONNX Runtime (ORT's training build is an extra, the inference package
    another): the trained model.onnx is a READY LoggedModel all the same, its requirements naming
    onnxruntime for whoever serves it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.split(".")[0] == "onnxruntime" else find_spec(name, *args))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails as it would there
    result = app.train(make_cfg("backend=torch", "trainer.max_steps=5"), tmp_path / "run")
    client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
    (output,) = client.get_run(result.run_id).outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert str(model.status).endswith("READY")
    requirements = mlflow.artifacts.download_artifacts(artifact_uri=f"{model.artifact_location}/requirements.txt",
                                                       dst_path=str(tmp_path))
    assert "onnxruntime" in [line.split("==")[0] for line in open(requirements).read().split()]
