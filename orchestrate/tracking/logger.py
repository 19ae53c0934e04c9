"""Logging into one MLflow run by its id, through MLflow's client only (no process-wide tracking
URI or active run: two runs in one process, or a notebook's own MLflow use, never mix). Metrics,
tags and artifacts that could not be uploaded at once go out through the run's outbox
(orchestrate.tracking.outbox): training never waits for the server, and an outage loses nothing.

Metric names (MLflow's compare view overlays backends because these never change):
  train/loss, eval/loss, eval/accuracy, perf/samples_per_sec, perf/step_time_ms, lr
and once at the end: final/train_loss, final/eval_loss, final/eval_accuracy,
final/samples_per_sec, final/step_time_ms, final/wall_time_s, final/warmup_s, final/peak_rss_mb
(final/peak_cuda_mb on CUDA): orchestrate.schema.SWEEP_METRICS, what a sweep may rank by.
"""

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from orchestrate.tracking import datasets, models
from orchestrate.tracking.outbox import END_WAIT_S, UNSENT_FILE, Artifact, Model, Outbox, cause
from orchestrate.tracking.redact import redact_text
from orchestrate.tracking.settings import quick_http, set_env

log = logging.getLogger(__name__)

STAGING = ".mlflow_outbox"  # the run's files waiting in its outbox, in its output folder


class RunLogger:
    """Logs into one MLflow run by its id: the run a Tracker opened, or (rank 0 of the runner's
    workers) a run that another process opened. Metrics and tags go out through an outbox
    (orchestrate.tracking.outbox): training never waits for the server, and an outage loses nothing.
    `close()` at the end: what the server did not take by then goes to `out_dir/mlflow_unsent.jsonl`."""

    def __init__(self, uri: str, run_id: str, out_dir: Path | None = None):
        from mlflow.tracking import MlflowClient

        self.client, self.uri, self.run_id = MlflowClient(tracking_uri=uri), uri, run_id
        self.env_before = quick_http()
        unsent = Path(out_dir or tempfile.gettempdir()) / (UNSENT_FILE if out_dir else f"{run_id}-{UNSENT_FILE}")
        self.outbox = Outbox(self.client, run_id, redact_text(uri), unsent)
        # Files waiting in the outbox (RunLogger.stage), beside the unsent file: those it could not
        # send are named there, for `orchestrate sync`.
        self.staging = unsent.parent / f"{STAGING}-{run_id[:8]}"
        self.staged = 0
        self.last_eval: dict[str, Any] = {}  # the last evaluation's points: the trained model's metrics
        self.eval_dataset: tuple[str, str] | None = None  # (name, digest) of the eval split, once known

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # Each point carries the time it was logged, also when it is sent later.
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.last_eval.update({m.key: m for m in points if m.key.startswith("eval/")})
        self.outbox.put(points)

    def log_datasets(self, data, name: str, record: bool = True) -> None:
        """The data's splits as the run's inputs (orchestrate.tracking.datasets); `record=False` only
        notes the eval split's name and digest (the runner's rank 0: the driver logged them)."""
        inputs = datasets.dataset_inputs(data, name)
        for given in inputs:
            if any(t.key == datasets.CONTEXT and t.value == "eval" for t in given.tags):
                self.eval_dataset = (given.dataset.name, given.dataset.digest)
        if record and inputs:
            try:
                self.client.log_inputs(self.run_id, datasets=inputs)
            except Exception as e:  # noqa: BLE001 - the run trains without its inputs listed
                log.warning(f"the data was not logged as the run's inputs ({cause(e)})")

    @property
    def not_registered(self) -> list[str]:
        """The models logged whose registration the store refused: the run fails with them."""
        return self.outbox.not_registered

    def log_model(self, path: Path, sample, step: int, register: "models.Registration | None" = None,
                  name: str = "model") -> None:
        """The model at `path` (ONNX; it may be removed once this returns) as the MLflow LoggedModel
        `name` (orchestrate.tracking.models), through the outbox: training goes on at once, and the
        model is logged after everything logged before it, its evaluation's points among them. A
        store that does not take it does not fail the run (the outbox says so)."""
        self.outbox.put([Model(str(self.stage(path)), sample, step, name, tuple(self.last_eval.values()),
                               self.eval_dataset, register)])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.outbox.put([RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._upload(path, artifact_path)

    def log_artifacts(self, folder: Path, artifact_path: str | None = None) -> None:
        self._upload(folder, artifact_path)

    def _upload(self, path: Path, artifact_path: str | None) -> None:
        """Through the outbox, after everything logged before it: training never waits for an
        upload, nor for a server that is away. A file is staged first: a checkpoint rotated away
        meanwhile, or a temporary folder removed, still goes up."""
        self.outbox.put([Artifact(str(self.stage(Path(path))), artifact_path, staged=True)])

    def stage(self, path: Path) -> Path:
        """Links to the file (or the folder's files) at `path`, copies where the file system refuses
        links, under a folder of their own in the run's outbox folder: uploaded under their own
        names, whatever happens to `path` meanwhile; the outbox removes them once sent."""
        self.staged += 1
        return stage(path, self.staging / f"{self.staged:06d}")

    def logged_history(self) -> dict[str, list[tuple[int, float]]]:
        """Every metric the run holds, as `key -> [(step, value)]`: a resumed run carries its
        curves on and does not log a step twice."""
        keys = self.client.get_run(self.run_id).data.metrics.keys()
        return {k: sorted((m.step, m.value) for m in self.client.get_metric_history(self.run_id, k)) for k in keys}

    def flush(self) -> bool:
        """Wait until every metric and tag logged so far is in the store (files and models follow
        on their own), unless the server is away (then training does not wait: the outbox keeps
        them). True when they were all sent."""
        return self.outbox.flush()

    def close(self, wait_s: float = END_WAIT_S) -> bool:
        """The end of logging: send what is left (waiting up to `wait_s` for a server that is
        away), and give MLflow's HTTP settings back. True when everything was sent."""
        try:
            return self.end_outbox(wait_s)
        finally:
            set_env(self.env_before)

    def end_outbox(self, wait_s: float = END_WAIT_S) -> bool:
        """Send what is left, waiting up to `wait_s` for a server that is away (Outbox.close); the
        staged files go once everything was sent. True when it was."""
        sent = self.outbox.close(wait_s)
        if sent:
            shutil.rmtree(self.staging, ignore_errors=True)
        return sent


def stage(path: Path, folder: Path) -> Path:
    """`path` (a file, or a folder's files) linked into `folder` under its own name, copied where
    the file system refuses links: it stays whatever happens to `path` meanwhile."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / path.name
    if path.is_dir():
        shutil.copytree(path, target, copy_function=link_or_copy)
    else:
        link_or_copy(path, target)
    return target


def link_or_copy(source, target) -> None:
    """A hard link (free, and the file survives its original's removal); a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
