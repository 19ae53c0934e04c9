"""MLflow tracking: one run per training job, the same metric names for every backend.

Metric names (MLflow's compare view overlays backends because these never change):
  train/loss, eval/loss, eval/accuracy, perf/samples_per_sec, perf/step_time_ms, lr
and once at the end: final/train_loss, final/eval_loss, final/eval_accuracy,
final/samples_per_sec, final/step_time_ms, final/wall_time_s.
"""

import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orchestrate.schema import ConfigError


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


# One async-logging thread per process: points reach the store in the order they were logged (a
# crash leaves no gap before the last one), and many processes stay within the server's pool.
ONE_LOGGING_THREAD = {"MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE": "1"}


class RunLogger:
    """Logs into one MLflow run by its id: the run a Tracker opened, or (rank 0 of the runner's
    workers) a run that another process opened."""

    def __init__(self, uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self.client, self.run_id = MlflowClient(tracking_uri=uri), run_id

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
        import mlflow

        mlflow.flush_async_logging()


class Tracker(RunLogger):
    """Opens (or, resuming, reopens) the job's MLflow run and logs into it. Use as a context
    manager: an exception marks the run FAILED (with the error text in the `error` tag), Ctrl-C
    marks it KILLED, a clean exit FINISHED."""

    def __init__(self, cfg: DictConfig, run_name: str, tags: dict[str, str], out_dir: Path,
                 resume_run_id: str | None = None):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(cfg.tracking.uri)
        mlflow.set_experiment(cfg.tracking.experiment)
        if resume_run_id:
            # The same run goes on: its params are this config already (config_key matched).
            run = mlflow.start_run(run_id=resume_run_id)
        else:
            # A sweep's trial runs in another process than its parent run: nest it by the parent tag.
            parent = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}
            run = mlflow.start_run(run_name=cfg.tracking.run_name or run_name, tags=parent)
        super().__init__(cfg.tracking.uri, run.info.run_id)
        self.set_tags({"git_commit": git_commit(), "python": platform.python_version(), "host": platform.node(),
                       "pid": str(os.getpid()), "config_key": config_key(cfg), "out_dir": str(Path(out_dir).resolve()),
                       **{f"version.{k}": v for k, v in versions().items()}, **tags, **cfg.tracking.tags})
        if not resume_run_id:
            items = list(flatten(cfg).items())
            for i in range(0, len(items), 100):
                mlflow.log_params(dict(items[i : i + 100]))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
            (Path(tmp) / "requirements-freeze.txt").write_text(freeze)
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
    store = uri if "://" in uri else os.path.abspath(uri)
    return f"mlflow ui --backend-store-uri {store} --host 127.0.0.1 --port 5000"


# ---- resume ----------------------------------------------------------------------------------
# Keys that may differ between a run and its continuation; every other key must be the same.
RESUME_FREE = ("trainer.resume", "trainer.progress")


def config_key(cfg: DictConfig) -> str:
    """A hash of the config that decides the training (tracking settings left out): a run is
    only continued by the same config."""
    items = sorted((k, v) for k, v in flatten(cfg).items()
                   if not k.startswith("tracking.") and k not in RESUME_FREE)
    return hashlib.sha1(repr(items).encode()).hexdigest()[:16]


@dataclass
class ResumePoint:
    """Where a run stopped: its latest finished checkpoint, on disk or as an MLflow artifact."""

    run_id: str
    step: int
    local: Path | None  # the checkpoint file in the run's output folder, when it is still there
    artifact: str | None  # else its artifact path in the run
    uri: str

    def fetch(self, folder: Path) -> Path:
        """Copy the checkpoint into `folder` (the new output folder's checkpoints): the next
        resume finds it there even if this attempt stops before its own first checkpoint."""
        import shutil

        folder.mkdir(parents=True, exist_ok=True)
        if self.local is not None:
            return Path(shutil.copy2(self.local, folder / self.local.name))
        from mlflow.tracking import MlflowClient

        got = MlflowClient(tracking_uri=self.uri).download_artifacts(self.run_id, self.artifact, str(folder))
        return Path(got)


def _step_of(name: str) -> int:
    return int(Path(name).name.split("_")[1].split(".")[0])


def find_resume(cfg: DictConfig) -> ResumePoint | None:
    """Resolve `trainer.resume` (auto or a run id) to a checkpoint; bad input is a ConfigError.
    Reads the store only: nothing is written, so it can run before the command starts."""
    want = cfg.trainer.resume
    if not want:
        return None
    uri = cfg.tracking.uri
    store = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if store is not None and not os.path.exists(store):  # do not create an empty store by asking
        if want == "auto":
            return None
        raise ConfigError(f"trainer.resume={want}: no MLflow store at {uri}, so no such run")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client, key = MlflowClient(tracking_uri=uri), config_key(cfg)
    if want == "auto":
        experiment = client.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            return None
        runs = client.search_runs([experiment.experiment_id], f"tags.config_key = '{key}'",
                                  order_by=["attributes.start_time DESC"], max_results=50)
        runs = [r for r in runs if r.info.status != "FINISHED"]
        for run in runs:
            point = _latest_checkpoint(client, run, uri)
            if point is not None:
                return point
        return None
    try:
        run = client.get_run(want)
    except MlflowException:
        raise ConfigError(f"trainer.resume={want}: no such run in {uri}; allowed: auto or a run id") from None
    if run.data.tags.get("config_key") != key:
        now = flatten(cfg)
        differ = [k for k, v in run.data.params.items()
                  if not k.startswith("tracking.") and k not in RESUME_FREE and now.get(k) != v]
        raise ConfigError(f"trainer.resume={want}: that run was started with another config (differs at "
                          f"{', '.join(differ[:5]) or 'its keys'}); resume it with the same overrides")
    point = _latest_checkpoint(client, run, uri)
    if point is None:
        raise ConfigError(f"trainer.resume={want}: that run has no checkpoint to resume from "
                          "(set trainer.checkpoint_period to checkpoint during a run)")
    return point


def _latest_checkpoint(client, run, uri: str) -> ResumePoint | None:
    folder = Path(run.data.tags.get("out_dir", "/nonexistent")) / "checkpoints"
    local = sorted(folder.glob("step_*")) if folder.is_dir() else []
    if local:
        return ResumePoint(run.info.run_id, _step_of(local[-1].name), local[-1], None, uri)
    logged = sorted((a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")), key=_step_of)
    if logged:
        return ResumePoint(run.info.run_id, _step_of(logged[-1]), None, logged[-1], uri)
    return None
