"""The contract every backend keeps, run over every conf/backend/*.yaml (as Hydra's launchers
share one LauncherTestSuite): it trains, tracks, checkpoints and exports the same way, and every
shipped model (conf/model/*.yaml) exports the same model.onnx whichever backend trained it."""

import importlib.metadata
import os
import re

import numpy as np
import onnx
import onnxruntime  # the inference runtime: ORT's training build, or the `serve` extra's package
import pytest
import torch

from orchestrate import app, extras, schema
from orchestrate.backends.torch import export_onnx
from orchestrate.config import load_config
from tests.conftest import BACKENDS, ROOT, client_for, here, long, metric_steps
from tests.helpers import fit_untracked

METRICS = ["train/loss", "eval/loss", "eval/accuracy", "perf/samples_per_sec", "perf/step_time_ms", "lr"]


def backend_target(backend: str) -> type:
    return schema.target_of(load_config([f"backend={backend}"]).backend, "backend")


def starts_ort_or_ray(backend: str) -> bool:
    """ORTModule (graph build, C++ extensions) and Ray (a cluster, worker processes) are slow to
    start; backend=auto (`chooses`) starts ORTModule too, to probe it."""
    from orchestrate.backends.ortmodule import ORTModuleBackend

    target = backend_target(backend)
    return issubclass(target, ORTModuleBackend) or target.distributed or target.chooses


def checkpoint_reader(client, run_id: str):
    """The backend that reads the run's checkpoints: the one its `backend` tag names (backend=auto
    writes those of the backend it chose, and tags the run with that one)."""
    return schema.build(load_config([f"backend={client.get_run(run_id).data.tags['backend']}"]).backend, "backend")


@pytest.fixture(scope="module", params=BACKENDS)
def trained(request, mlflow_server, tmp_path_factory):
    """One short run per backend on the synthetic task, tracked by the MLflow server (the runner on
    the session's Ray)."""
    if backend_target(request.param).distributed:
        request.getfixturevalue("ray_shared")
    out = tmp_path_factory.mktemp(request.param)
    cfg = load_config(here([f"backend={request.param}", "data=synthetic", "trainer=quick", "trainer.max_steps=40",
                            "trainer.checkpoint_period=20", "trainer.evaluation_period=20", "optimizer.lr=0.01",
                            f"tracking.uri={mlflow_server}", "tracking.experiment=contract"]))
    result = app.train(cfg, out)
    return request.param, cfg, result, client_for(mlflow_server)


def test_loss_goes_down(trained):
    _, _, result, client = trained
    losses = [v for _, v in metric_steps(client, result.run_id, "train/loss")]
    assert len(losses) == 8  # every display_loss_steps=5 of 40 steps
    assert losses[-1] < 0.7 * losses[0]


def test_metrics_params_and_tags_in_mlflow(trained):
    backend, cfg, result, client = trained
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    for key in METRICS:
        assert metric_steps(client, result.run_id, key), f"{key} missing"
    assert [s for s, _ in metric_steps(client, result.run_id, "eval/loss")] == [20, 40]
    for key in ["final/train_loss", "final/eval_loss", "final/eval_accuracy", "final/samples_per_sec"]:
        assert key in run.data.metrics
    assert run.data.params["trainer.max_steps"] == "40"
    assert run.data.params["backend._target_"] == cfg.backend._target_
    tags = run.data.tags
    if backend_target(backend).chooses:  # backend=auto: tagged with the backend it chose, and `auto`
        chosen = backend_target(tags["backend"])
        assert tags["auto"] == "true" and not (chosen.chooses or chosen.distributed)
    else:
        assert tags["backend"] == backend
    assert tags["device"].startswith("cpu")
    assert {"git_commit", "version.torch", "version.onnx", "version.mlflow"} <= set(tags)
    assert ("version.onnxruntime-training-cpu" in tags) == extras.ORT.present()


def test_the_run_logs_the_cpu_budget_it_trained_with(trained):
    """Every backend splits the cores alike (orchestrate.cpu): the run's params say how, threads +
    loader processes within the cores (the runner's: one worker's backend.cpus_per_worker)."""
    backend, cfg, result, client = trained
    params = client.get_run(result.run_id).data.params
    cores, loader = int(params["cpu.cores"]), int(params["cpu.loader_processes"])
    assert cores == (cfg.backend.cpus_per_worker if backend_target(backend).distributed else len(os.sched_getaffinity(0)))
    assert loader == 0  # the synthetic data is in memory: no loader
    assert 1 <= int(params["cpu.threads"]) <= cores


def test_artifacts_in_mlflow(trained):
    _, _, result, client = trained
    top = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "requirements-freeze.txt", "model.onnx", "loss_curves.png", "checkpoints"} <= top
    checkpoints = [a.path for a in client.list_artifacts(result.run_id, "checkpoints")]
    assert len(checkpoints) == 2  # steps 20 and 40
    freeze = open(client.download_artifacts(result.run_id, "requirements-freeze.txt")).read().split()
    assert f"torch=={importlib.metadata.version('torch')}" in freeze
    assert ("onnxruntime-training-cpu==1.19.2" in freeze) == extras.ORT.present()


def eval_accuracy(model: torch.nn.Module, cfg) -> float:
    data = schema.build(cfg.data, "data")
    with torch.no_grad():
        return (model(data.x_eval).argmax(-1) == data.y_eval).float().mean().item()


def test_checkpoint_reloads_to_the_logged_accuracy(trained):
    """The last checkpoint, loaded into a fresh model, reproduces the final eval accuracy."""
    _, cfg, result, client = trained
    backend = checkpoint_reader(client, result.run_id)
    latest = sorted((result.out_dir / "checkpoints").glob("step_*"))
    assert [p.name.split(".")[0] for p in latest] == ["step_0000020", "step_0000040"]
    params = backend.read_checkpoint(latest[-1])
    model = schema.build(cfg.model, "model")
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in params.items()})
    logged = client.get_run(result.run_id).data.metrics["final/eval_accuracy"]
    assert eval_accuracy(model, cfg) == pytest.approx(logged, abs=1e-6)


def test_onnx_model_infers_like_the_trained_model(trained):
    _, cfg, result, client = trained
    data = schema.build(cfg.data, "data")
    session = onnxruntime.InferenceSession(str(result.out_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: data.x_eval.numpy()})[0]
    accuracy = float((logits.argmax(-1) == data.y_eval.numpy()).mean())
    assert accuracy == pytest.approx(client.get_run(result.run_id).data.metrics["final/eval_accuracy"], abs=1e-6)
    assert accuracy > 0.5  # 4 classes: well above chance after 40 steps


def test_the_run_s_models_load_from_mlflow_and_predict_with_the_logged_accuracy(trained, mlflow_server):
    """The final model (`model`, at the last step) and the checkpoint before it (`checkpoint-20`) are
    LoggedModels of the run: `mlflow.pyfunc.load_model("models:/<id>")` predicts the eval split
    with the accuracy the run logged at their steps."""
    import mlflow

    _, cfg, result, client = trained
    data = schema.build(cfg.data, "data")
    outputs = {o.step: client.get_logged_model(o.model_id) for o in client.get_run(result.run_id).outputs.model_outputs}
    assert {step: m.name for step, m in outputs.items()} == {20: "checkpoint-20", 40: "model"}
    accuracy = dict(metric_steps(client, result.run_id, "eval/accuracy"))
    mlflow.set_tracking_uri(mlflow_server)
    try:
        for step, model in outputs.items():
            predicted = mlflow.pyfunc.load_model(f"models:/{model.model_id}").predict(data.x_eval.numpy())
            logits = predicted["logits"] if isinstance(predicted, dict) else np.asarray(predicted)
            assert float((logits.argmax(-1) == data.y_eval.numpy()).mean()) == pytest.approx(accuracy[step], abs=1e-6)
    finally:
        mlflow.set_tracking_uri(None)


def test_onnx_model_has_the_signature_of_torchs_export(trained, tmp_path):
    _, cfg, result, _ = trained
    export_onnx(schema.build(cfg.model, "model"), schema.build(cfg.data, "data").sample_input(), tmp_path / "torch.onnx")
    assert signature(result.out_dir / "model.onnx") == signature(tmp_path / "torch.onnx")


def test_backend_config_names_itself(trained):
    backend, cfg, _, _ = trained
    assert cfg.backend.name == backend


# ---- a diverging run stops (or skips), on every backend ------------------------------------------
def diverging(backend: str, tmp_path, request, *overrides: str, display: int = 1):
    """10 steps of which the batches from step 7 on are nan (the runner: rank 0's share of 2
    workers only); a checkpoint every 3 steps. Displayed every step, every step is read on the
    host; displayed every 4, the PyTorch loops decide steps 5, 7 and 10 on the device and learn of
    the nan at step 8."""
    if backend_target(backend).distributed:
        request.getfixturevalue("ray_shared")
        overrides = ("trainer.num_workers=2", "trainer.batch_size=32", *overrides)
    cfg = load_config(here([f"backend={backend}", "data=synthetic", "data._target_=tests.helpers.NanFrom",
                            "+data.start=6", "trainer=quick", "trainer.max_steps=10",
                            f"trainer.display_loss_steps={display}", "trainer.evaluation_period=0",
                            "trainer.checkpoint_period=3", "trainer.max_num_checkpoints=5",
                            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides]))
    return cfg


# Each backend, displayed every step and every 4. The backends that run another's loop (auto and
# the runner) have their second case in `make test-long`: the loop's own case stands for it.
def displays(slow_if=lambda backend, display: False):
    def marks(b: str, d: int) -> list:
        if d > 1 and (backend_target(b).distributed or backend_target(b).chooses):
            return [pytest.mark.slow, long(f"the loop's own case, [torch-{d}]")]
        return [pytest.mark.slow] if slow_if(b, d) else []

    return [pytest.param(b, d, marks=marks(b, d)) for b in BACKENDS for d in (1, 4)]


DISPLAYS = displays()


@pytest.mark.parametrize(("backend", "display"), DISPLAYS)
def test_a_diverging_run_stops_at_that_step_failed_with_the_checkpoint_before_it(backend, display, tmp_path, request):
    from orchestrate.meter import Diverged

    with pytest.raises(Diverged, match="^loss became nan at step 7$"):
        app.train(diverging(backend, tmp_path, request, display=display), tmp_path / "out")
    client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error"] == "loss became nan at step 7"
    logged = [s for s, _ in metric_steps(client, run.info.run_id, "train/loss")]
    assert logged == (list(range(1, 7)) if display == 1 else [4])  # all finite
    kept = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*"))
    assert [k.split(".")[0] for k in kept] == ["step_0000003", "step_0000006"]  # none after the nan


@pytest.mark.parametrize(("backend", "display"), displays(slow_if=lambda b, d: backend_target(b).distributed))
def test_a_run_that_skips_non_finite_steps_drops_their_updates_and_counts_them(backend, display, tmp_path, request):
    result = app.train(diverging(backend, tmp_path, request, "trainer.on_nonfinite=skip", display=display),
                       tmp_path / "out")
    client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(result.run_id).info.status == "FINISHED"
    assert metric_steps(client, result.run_id, "train/skipped_steps") == [(s, s - 6.0) for s in range(7, 11)]
    # Steps 7-10 changed nothing: the last checkpoint holds the weights of the one at step 6.
    engine = checkpoint_reader(client, result.run_id)
    folder = result.out_dir / "checkpoints"
    at_6, at_10 = (engine.read_checkpoint(next(folder.glob(f"step_{s:07d}.*"))) for s in (6, 10))
    assert at_6.keys() == at_10.keys()
    for name in at_6:
        np.testing.assert_array_equal(at_6[name], at_10[name], err_msg=name)


# ---- every shipped model exports one model.onnx, whatever the backend ----------------------------
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


def paired_data(model: str) -> list[str]:
    """The data set a model's yaml names in its leading comment ("pair it with data=NAME"), as an
    override; none (the config's default data) if it names none."""
    comment = re.match(r"(#.*\n)*", (ROOT / "conf" / "model" / f"{model}.yaml").read_text())[0]  # the leading lines
    found = re.search(r"data=(\w+)", comment)
    return [f"data={found[1]}"] if found else []


def signature(path) -> list[tuple]:
    """Each graph input and output of an ONNX file: name, element type, shape (None for a symbolic
    dimension)."""
    graph = onnx.load(str(path)).graph
    return [(kind, v.name, v.type.tensor_type.elem_type, [d.dim_value if d.HasField("dim_value") else None
                                                          for d in v.type.tensor_type.shape.dim])
            for kind, values in (("input", graph.input), ("output", graph.output)) for v in values]


def single_process(backend: str) -> bool:
    return not schema.target_of(load_config([f"backend={backend}"]).backend, "backend").distributed


# Every single-process backend but torch (whose loop ends with export_onnx, the reference) with
# every model, 2 steps each; the runner's model.onnx is its engine's (the workers run the engine's
# loop), checked once more here with the BatchNorm model.
def signature_marks(backend: str) -> list:
    """A compiler (`warmup_floor_s`: torch.compile) compiles each model for minutes on 2 cores and
    exports the plain model as torch does: its cases are the long tier's."""
    if backend_target(backend).warmup_floor_s:
        return [pytest.mark.slow, long(f"test_onnx_model_has_the_signature_of_torchs_export[{backend}] (torch's "
                                       "export of the plain model, which the loop shares)")]
    return [pytest.mark.slow] if starts_ort_or_ray(backend) else []


SIGNATURE_CASES = [pytest.param(b, m, (), marks=signature_marks(b), id=f"{b}-{m}")
                   for b in BACKENDS if b != "torch" and single_process(b) for m in MODELS]
SIGNATURE_CASES += [pytest.param("runner", "cnn", ("backend.engine=ondevice", "trainer.num_workers=2"),
                                 marks=pytest.mark.slow, id="runner-ondevice-cnn")]


@pytest.mark.parametrize("backend,model,overrides", SIGNATURE_CASES)
def test_model_onnx_is_the_same_whichever_backend_trained_it(backend, model, overrides, tmp_path, request):
    """Compared with torch's export of the untrained model (what backend=torch writes at its end,
    test_onnx_model_has_the_signature_of_torchs_export): training changes no shape."""
    if backend_target(backend).distributed:
        request.getfixturevalue("ray_shared")
    overrides = [f"backend={backend}", f"model={model}", *paired_data(model), "trainer=quick", "trainer.max_steps=2",
                 "trainer.batch_size=8", "trainer.evaluation_period=0", "trainer.checkpoint_period=0", *overrides]
    cfg = load_config(overrides)
    export_onnx(schema.build(cfg.model, "model"), schema.build(cfg.data, "data").sample_input(), tmp_path / "torch.onnx")
    reference = signature(tmp_path / "torch.onnx")
    assert all(dims and dims[0] is None for *_, dims in reference), reference  # the batch stays symbolic
    job = fit_untracked(overrides, tmp_path / "out")  # every pairing listed trains (none is refused)
    assert signature(job.out_dir / "model.onnx") == reference


def test_no_backend_imports_the_app():
    """Backends may read configs (orchestrate.config) but never import orchestrate.app, which
    imports the job, the tracker and through them the backends again: no circle of imports."""
    import ast

    found = []
    for path in sorted((ROOT / "orchestrate" / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n == "orchestrate.app"]
    assert found == []
