"""MLflow tracking: one run per training job, the same metric names for every backend.

Metric names (MLflow's compare view overlays backends because these never change):
  train/loss, eval/loss, eval/accuracy, perf/samples_per_sec, perf/step_time_ms, lr
and once at the end: final/train_loss, final/eval_loss, final/eval_accuracy,
final/samples_per_sec, final/step_time_ms, final/wall_time_s.
"""

import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


VERSIONED = ["torch", "onnxruntime-training-cpu", "onnxruntime-training", "onnx", "mlflow", "ray", "hydra-core"]


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as `a.b.c -> value`, the form MLflow params take."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = str(node)[:6000]

    walk(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "")
    return out


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    found = {}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


class Tracker:
    """One MLflow run. Use as a context manager: an exception marks the run FAILED (with the
    error text in the `error` tag), Ctrl-C marks it KILLED, a clean exit FINISHED."""

    def __init__(self, cfg: DictConfig, run_name: str, tags: dict[str, str]):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(cfg.tracking.uri)
        mlflow.set_experiment(cfg.tracking.experiment)
        # A sweep's trial runs in another process than its parent run: nest it by the parent tag.
        parent = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}
        self.run = mlflow.start_run(run_name=cfg.tracking.run_name or run_name, tags=parent)
        self.run_id = self.run.info.run_id
        self.log_checkpoints = cfg.tracking.log_checkpoints
        all_tags = {"git_commit": git_commit(), "python": platform.python_version(), "host": platform.node(),
                    "pid": str(os.getpid()),
                    **{f"version.{k}": v for k, v in versions().items()}, **tags, **cfg.tracking.tags}
        mlflow.set_tags(all_tags)
        params = flatten(cfg)
        items = list(params.items())
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i : i + 100]))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
            (Path(tmp) / "requirements-freeze.txt").write_text(freeze)
            mlflow.log_artifacts(tmp)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # Asynchronous: the training loop does not wait for the store (about 1 ms a call on SQLite).
        self.mlflow.log_metrics(metrics, step=step, synchronous=False)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.mlflow.log_artifact(str(path), artifact_path)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.mlflow.flush_async_logging()
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


class RunLogger:
    """Logs into a run that another process opened (rank 0 of the runner's workers)."""

    def __init__(self, uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self.client, self.run_id = MlflowClient(tracking_uri=uri), run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()],
                              synchronous=False)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        import mlflow

        mlflow.flush_async_logging()


def absolute_uri(uri: str) -> str:
    """`sqlite:///mlflow.db` is relative to the working directory: make it absolute before handing
    it to a process that runs elsewhere (Ray Train workers run in their own folders)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


def ui_command(uri: str) -> str:
    store = uri if "://" in uri else os.path.abspath(uri)
    return f"mlflow ui --backend-store-uri {store} --host 127.0.0.1 --port 5000"
