"""MLflow tracking: one run per training job, the same metric names for every backend.

Metric names (MLflow's compare view overlays backends because these never change):
  train/loss, eval/loss, eval/accuracy, perf/samples_per_sec, perf/step_time_ms, lr
and once at the end: final/train_loss, final/eval_loss, final/eval_accuracy,
final/samples_per_sec, final/step_time_ms, final/wall_time_s.
"""

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import orchestrate
from orchestrate.redact import redact, redacted_yaml


VERSIONED = ["torch", "onnxruntime-training-cpu", "onnxruntime-training", "onnx", "mlflow", "ray", "hydra-core"]


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as `a.b.c -> value`, the form MLflow params take, secrets hidden
    (orchestrate.redact)."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = str(node)[:6000]

    walk(redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)), "")
    return out


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def installed_packages() -> str:
    """`name==version` of every installed distribution, as `pip freeze` lists them (read from the
    packages' metadata: a `pip freeze` subprocess cost 0.8 s of every run's start)."""
    found = {(d.metadata["Name"] or "").lower(): d.version for d in importlib.metadata.distributions()}
    return "".join(f"{name}=={version}\n" for name, version in sorted(found.items()) if name)


def versions() -> dict[str, str]:
    found = {}
    found["orchestrate"] = orchestrate.__version__
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


# One async-logging thread per process: points reach the store in the order they were logged (a
# crash leaves no gap before the last one), and many processes stay within the server's pool.
ONE_LOGGING_THREAD = {"MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE": "1"}


class RunLogger:
    """Logs into one MLflow run by its id: the run a Tracker opened, or (rank 0 of the runner's
    workers) a run that another process opened."""

    def __init__(self, uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self.client, self.uri, self.run_id = MlflowClient(tracking_uri=uri), uri, run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # Asynchronous: the training loop does not wait for the store (about 1 ms a call on SQLite).
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()],
                              synchronous=False)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, folder: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)

    def logged_history(self) -> dict[str, list[tuple[int, float]]]:
        """Every metric the run holds, as `key -> [(step, value)]`: a resumed run carries its
        curves on and does not log a step twice."""
        keys = self.client.get_run(self.run_id).data.metrics.keys()
        return {k: sorted((m.step, m.value) for m in self.client.get_metric_history(self.run_id, k)) for k in keys}

    def flush(self) -> None:
        """Wait until every metric logged so far is in the store. This client's own store: the
        fluent `mlflow.flush_async_logging()` flushes the store of the process-wide tracking URI,
        which in a runner worker (or any process that logs by run id) is another store."""
        self.client._tracking_client.store.flush_async_logging()


class Tracker(RunLogger):
    """Opens (or, resuming, reopens) the job's MLflow run and logs into it. Use as a context
    manager: an exception marks the run FAILED (with the error text in the `error` tag), Ctrl-C
    marks it KILLED, a clean exit FINISHED.

    A run handed over by the environment (`MLFLOW_RUN_ID` and `MLFLOW_TRACKING_URI`, MLflow's own
    variables, set for each trial by the sweep callbacks in `orchestrate.sweeps`) is logged into
    instead of a new one: that is how a trial becomes a nested child of its sweep's parent run."""

    def __init__(self, cfg: DictConfig, run_name: str, tags: dict[str, str], out_dir: Path,
                 resume_run_id: str | None = None):
        import mlflow

        self.mlflow = mlflow
        given = handed_over_run()
        uri = given[0] if given else cfg.tracking.uri
        mlflow.set_tracking_uri(uri)
        if resume_run_id:
            # The same run goes on: its params are this config already (config_key matched). MLflow
            # refuses to start a run outside the process's active experiment (an earlier run in this
            # process may have set another one): make the run's own experiment the active one.
            experiment_id = mlflow.tracking.MlflowClient(uri).get_run(resume_run_id).info.experiment_id
            mlflow.set_experiment(experiment_id=experiment_id)
            run = mlflow.start_run(run_id=resume_run_id)
        elif given:
            run = mlflow.start_run(run_id=given[1])
        else:
            mlflow.set_experiment(cfg.tracking.experiment)
            run = mlflow.start_run(run_name=cfg.tracking.run_name or run_name)
        super().__init__(uri, run.info.run_id)
        self.set_tags({"git_commit": git_commit(), "python": platform.python_version(), "host": platform.node(),
                       "pid": str(os.getpid()), "out_dir": str(Path(out_dir).resolve()),
                       **{f"version.{k}": v for k, v in versions().items()}, **tags, **redact(dict(cfg.tracking.tags))})
        if not resume_run_id:
            items = list(flatten(cfg).items())
            for i in range(0, len(items), 100):
                mlflow.log_params(dict(items[i : i + 100]))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(redacted_yaml(cfg))
            (Path(tmp) / "requirements-freeze.txt").write_text(installed_packages())
            self.log_artifacts(Path(tmp))

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.flush()
        finally:
            if exc_type is None:
                self.mlflow.end_run("FINISHED")
            elif issubclass(exc_type, KeyboardInterrupt):
                self.mlflow.set_tag("error", "interrupted (KeyboardInterrupt)")
                self.mlflow.end_run("KILLED")
            else:
                self.mlflow.set_tag("error", f"{exc_type.__name__}: {exc}"[:5000])
                self.mlflow.end_run("FAILED")
        return False


def absolute_uri(uri: str) -> str:
    """`sqlite:///mlflow.db` is relative to the working directory: make it absolute before handing
    it to a process that runs elsewhere (Ray Train workers run in their own folders)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


def ui_command(uri: str) -> str:
    """The command that opens MLflow's UI on this store, runnable as printed: a bare `mlflow` only
    when that is this environment's (the virtual environment is active), else its full path."""
    store = uri if "://" in uri else os.path.abspath(uri)
    script = Path(sys.executable).parent / "mlflow"
    if shutil.which("mlflow") == str(script):
        mlflow = "mlflow"
    else:
        mlflow = str(script) if script.exists() else f"{sys.executable} -m mlflow"
    return f"{mlflow} ui --backend-store-uri {store} --host 127.0.0.1 --port 5000"


def handed_over_run() -> tuple[str, str] | None:
    """(tracking URI, run id) when the environment hands this process a run to log into."""
    run_id, uri = os.environ.get("MLFLOW_RUN_ID"), os.environ.get("MLFLOW_TRACKING_URI")
    return (uri, run_id) if run_id and uri else None


def finished_run_metrics() -> dict[str, float] | None:
    """The metrics of the handed-over run if it has already FINISHED (a sweep being resumed hands
    a trial that finished in an earlier attempt its old run: there is nothing to train), else None."""
    given = handed_over_run()
    if given is None:
        return None
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=given[0]).get_run(given[1])
    return dict(run.data.metrics) if run.info.status == "FINISHED" else None
