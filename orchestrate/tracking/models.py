"""The trained model, the MLflow 3 way: `model.onnx` with MLflow's ONNX flavor as a LoggedModel (a
signature and an input example from the data's sample batch), linked to the run at its step and to
its last evaluation's metrics (on the eval split), so that it is in the Models column,
`mlflow.search_logged_models`, loadable as `models:/<model_id>` with `mlflow.pyfunc.load_model`
and servable with `mlflow models serve`; with `tracking.register_model=NAME`, a new version of
NAME (`models:/NAME/latest` is MLflow's name for the newest), and the alias `best` on the version
whose evaluation is best by `sweep.metric` and `sweep.direction` (`models:/NAME@best`).
Logged through the run's client, so that the runner's rank 0 logs it as the driver would.
"""

import importlib.metadata
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BEST = "best"  # the alias of the registered version with the best evaluation ("latest" is MLflow's own)


@dataclass(frozen=True)
class Registration:
    """Where a final model is registered: a new version of `name`; the alias BEST moves to it when
    its linked `metric` (an evaluation metric: eval/loss, eval/accuracy) beats the holder's."""

    name: str
    metric: str
    minimize: bool

    def better(self, value: float, than: float | None) -> bool:
        return than is None or (value < than if self.minimize else value > than)


def output_like(proto, sample: np.ndarray) -> np.ndarray:
    """Zeros shaped and typed as the model's output for `sample` (its signature's output side),
    read from the graph, whose shapes the exports declare (backends.torch.declare_shape): no
    runtime is needed to log a model (ORT is an extra; the maintained `onnxruntime` serves it)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    tensor = proto.graph.output[0].type.tensor_type
    return np.zeros((len(sample), *(d.dim_value for d in tensor.shape.dim[1:])), tensor_dtype_to_np_dtype(tensor.elem_type))


def runtime_version() -> str | None:
    """The installed ONNX Runtime's version (the training build or the inference package), unimported."""
    for name in ("onnxruntime-training-cpu", "onnxruntime-training", "onnxruntime"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def providers() -> list[str]:
    """Where the model is served: on CUDA first where this environment's ORT has it (MLflow's default
    names CUDA first, and warns on every load where it is missing), else on the CPU."""
    from orchestrate import ort

    found = ort.providers() if ort.load() is not None else []
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in found] or ["CPUExecutionProvider"]


def log_model(client, run_id: str, path: Path, sample: np.ndarray, step: int, register: Registration | None = None,
              name: str = "model", evaluation=(), eval_dataset: tuple[str, str] | None = None) -> str:
    """`path` (an ONNX model) as a READY LoggedModel `name` of run `run_id`, output at `step`;
    the points of `evaluation` (MLflow Metrics) logged at that step, if any, linked to it with the
    eval split `eval_dataset` (name, digest); registered as `register` says. Returns its id."""
    import mlflow.onnx
    import onnx
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model, infer_signature

    from orchestrate.thirdparty import onnx_flavor_without_runtime

    proto = onnx.load(str(path))
    experiment_id = client.get_run(run_id).info.experiment_id
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id, model_type="onnx")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # What serving it needs, named: MLflow would otherwise infer it by loading the model in a
            # subprocess (5.5 s of every run's end, measured on the digits MLP).
            runtime = runtime_version()
            needs = [f"mlflow=={mlflow.__version__}", f"onnx=={onnx.__version__}",
                     f"onnxruntime=={runtime}" if runtime else "onnxruntime", f"numpy=={np.__version__}"]
            # The MLmodel file names its run and model, as MLflow's own log_model writes it.
            signature = infer_signature(sample, output_like(proto, sample))
            with onnx_flavor_without_runtime():
                mlflow.onnx.save_model(proto, f"{tmp}/model", signature=signature, input_example=sample,
                                       onnx_execution_providers=providers(), pip_requirements=needs,
                                       mlflow_model=Model(run_id=run_id, model_id=model.model_id))
            client.log_model_artifacts(model.model_id, f"{tmp}/model")
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    # The last evaluation's points again, with the model and the eval split named: the same key,
    # value, step and time are one point in the run's history, now also the model's metrics.
    linked = [m.__class__(m.key, m.value, m.timestamp, m.step, model_id=model.model_id,
                          dataset_name=eval_dataset[0] if eval_dataset else None,
                          dataset_digest=eval_dataset[1] if eval_dataset else None)
              for m in evaluation if m.step == step]  # a checkpoint between evaluations: none
    if linked:
        client.log_batch(run_id, metrics=linked)
    if register is not None:
        try:
            add_version(client, register, model.model_id, run_id, {m.key: m.value for m in linked})
        except Exception as e:  # noqa: BLE001 - the model is logged; the registry's refusal is the run's outcome
            raise NotRegistered(f"the model {model.model_id} was logged, not registered as {register.name} "
                                f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e
    return model.model_id


class NotRegistered(Exception):
    """The LoggedModel is READY, its registration as a new version (tracking.register_model) failed."""


def add_version(client, register: Registration, model_id: str, run_id: str, metrics: dict[str, float]) -> None:
    """The model as a new version of `register.name` (created if need be); the alias BEST moves to
    it when its `register.metric` beats the current holder's (a holder without it loses)."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(register.name)
    except MlflowException:
        try:
            client.create_registered_model(register.name)
        except MlflowException as e:  # a sweep's other trial created it in between
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    # The model's own artifact location, not `models:/<id>`: MLflow's SQL registry looks such a URI
    # up through the process-wide tracking URI (its own TODO), which a run does not set.
    location = client.get_logged_model(model_id).artifact_location
    version = client.create_model_version(register.name, location, run_id=run_id, model_id=model_id)
    if register.metric not in metrics:
        return
    try:
        holder = client.get_model_version_by_alias(register.name, BEST)
    except MlflowException:  # no version holds it yet
        holder = None
    # The holder's run's last value of the metric: its final model's evaluation (a version made
    # from an artifact location does not keep its model id in MLflow's SQL registry).
    theirs = client.get_run(holder.run_id).data.metrics.get(register.metric) if holder and holder.run_id else None
    if register.better(metrics[register.metric], theirs):
        client.set_registered_model_alias(register.name, BEST, version.version)
