"""The trained model, the MLflow 3 way: `model.onnx` with MLflow's ONNX flavor as a LoggedModel (a
signature and an input example from the data's sample batch), linked to the run at its step and to
its last evaluation's metrics (on the eval split), so that it is in the Models column,
`mlflow.search_logged_models`, loadable as `models:/<model_id>` with `mlflow.pyfunc.load_model`
and servable with `mlflow models serve`; with `tracking.register_model=NAME`, a new version of
NAME with the alias `latest`. Logged through the run's client, so that the runner's rank 0 logs
it as the driver would.
"""

import tempfile
from pathlib import Path

import numpy as np

ALIAS = "latest"  # the alias each newly registered version takes


def log_model(logger, path: Path, sample: np.ndarray, step: int, register: str | None = None,
              name: str = "model") -> str:
    """`path` (an ONNX model) as a READY LoggedModel `name` of the logger's run, output at `step`,
    the evaluation at that step (if there was one) linked to it; registered as a new version of
    `register`. Returns the model's id."""
    import mlflow.onnx
    import onnx
    import onnxruntime
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import infer_signature

    client, run_id = logger.client, logger.run_id
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    output = session.run(None, {session.get_inputs()[0].name: sample})[0]
    experiment_id = client.get_run(run_id).info.experiment_id
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id, model_type="onnx")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # Served on what this onnxruntime build has (MLflow's default names CUDA first, and warns
            # on every load where it is missing).
            providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                         if p in onnxruntime.get_available_providers()]
            # What serving it needs, named: MLflow would otherwise infer it by loading the model in a
            # subprocess (5.5 s of every run's end, measured on the digits MLP).
            needs = [f"mlflow=={mlflow.__version__}", f"onnx=={onnx.__version__}",
                     f"onnxruntime=={onnxruntime.__version__}", f"numpy=={np.__version__}"]
            mlflow.onnx.save_model(onnx.load(str(path)), f"{tmp}/model", signature=infer_signature(sample, output),
                                   input_example=sample, onnx_execution_providers=providers, pip_requirements=needs)
            client.log_model_artifacts(model.model_id, f"{tmp}/model")
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    # The last evaluation's points again, with the model and the eval split named: the same key,
    # value, step and time are one point in the run's history, now also the model's metrics.
    linked = [m.__class__(m.key, m.value, m.timestamp, m.step, model_id=model.model_id,
                          dataset_name=logger.eval_dataset[0] if logger.eval_dataset else None,
                          dataset_digest=logger.eval_dataset[1] if logger.eval_dataset else None)
              for m in logger.last_eval.values() if m.step == step]  # a checkpoint between evaluations: none
    if linked:
        client.log_batch(run_id, metrics=linked)
    if register:
        from mlflow.exceptions import MlflowException

        try:
            client.get_registered_model(register)
        except MlflowException:
            client.create_registered_model(register)
        version = client.create_model_version(register, f"models:/{model.model_id}", run_id=run_id,
                                              model_id=model.model_id)
        client.set_registered_model_alias(register, ALIAS, version.version)
    return model.model_id
