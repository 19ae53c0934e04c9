"""The MLflow side of a sweep: one parent run, one nested child run per trial, a local tracking
server in front of SQLite, and the summary (table and loss-curve chart) on the parent."""

import hashlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrate import plots

SWEEP_KEY = "orchestrate.sweep_key"
TRIAL_KEY = "orchestrate.trial"


def trial_name(overrides: list[str], fixed: list[str]) -> str:
    """What tells a trial apart: its overrides that the command line did not fix for every trial."""
    own = [o for o in overrides if o not in fixed]
    return ",".join(own) or "(defaults)"


def sweep_key(command_overrides: list[str], sweeper: dict) -> str:
    """Same command, same sweep definition: same key, hence the same parent run on a re-run."""
    text = json.dumps({"overrides": sorted(command_overrides), "sweeper": sweeper}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class TrackingServer:
    """`mlflow server` on 127.0.0.1 in front of a SQLite store. Many trials writing to one SQLite
    file at once fail ("database is locked", schema races); one server serialises their writes."""

    def __init__(self, sqlite_uri: str, artifact_root: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mlflow-server-", suffix=".log", delete=False)
        # A log-batch request can hold one pooled connection while it waits for a second. With
        # MLflow's default pool (5 + 10 overflow) and 8 trials each sending from 10 async-logging
        # threads, every connection ended up held by a waiting request: the server deadlocked
        # ("QueuePool limit ... reached"). A larger pool here, and one logging thread per trial
        # (tracking.ONE_LOGGING_THREAD), keep requests in flight below the pool's size. No job-runner workers:
        # 0.55 GiB instead of 2.6 GiB.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
               "MLFLOW_SQLALCHEMYSTORE_POOL_SIZE": "40"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", sqlite_uri, "--artifacts-destination", str(artifact_root)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.uri = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"the sweep's MLflow server did not start; its log: {self.log.name}")
                time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Trial:
    index: int
    overrides: list[str]
    name: str
    status: str = "PENDING"  # FINISHED, FAILED, SKIPPED (finished in an earlier attempt)
    run_id: str | None = None
    metrics: dict | None = None
    error: str = ""
    wall_time_s: float = 0.0


class ParentRun:
    """The sweep's MLflow parent run: found again by its key when a sweep is resumed."""

    @staticmethod
    def ensure_experiment(uri: str, experiment: str) -> None:
        """Create the store's tables and the experiment, writing to the store directly."""
        client = MlflowClient(tracking_uri=uri)
        if client.get_experiment_by_name(experiment) is None:
            client.create_experiment(experiment)
        # Write-ahead logging: readers (the launcher, the UI) no longer block the writer. The
        # setting is stored in the database file.
        path = uri.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            db.execute("PRAGMA journal_mode=WAL")

    def __init__(self, uri: str, experiment: str, key: str, resume: bool, definition: dict):
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        earlier = self.client.search_runs([self.experiment_id], f"tags.`{SWEEP_KEY}` = '{key}'",
                                          order_by=["attributes.start_time DESC"], max_results=1) if resume else []
        if earlier:
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.resumed = True
        else:
            run = self.client.create_run(self.experiment_id, run_name=f"sweep-{definition['name']}",
                                         tags={SWEEP_KEY: key, "orchestrate.role": "sweep"})
            self.run_id = run.info.run_id
            self.resumed = False
            for k, v in list(definition["params"].items())[:100]:
                self.client.log_param(self.run_id, f"sweep.{k}", str(v)[:6000])
            self.client.log_text(self.run_id, json.dumps(definition, indent=2, default=str), "sweep.json")

    def finished_trials(self) -> dict[str, "object"]:
        """Children of this parent that FINISHED, by trial name."""
        runs = self.client.search_runs([self.experiment_id], f"tags.`mlflow.parentRunId` = '{self.run_id}'",
                                       max_results=5000)
        return {r.data.tags.get(TRIAL_KEY): r for r in runs if r.info.status == "FINISHED"}

    def close(self, trials: list[Trial], metric: str) -> str:
        table = summary_table(trials, metric)
        self.client.log_text(self.run_id, table, "summary.md")
        curves = {}
        for t in trials:
            if t.run_id:
                history = {k: [(m.step, m.value) for m in self.client.get_metric_history(t.run_id, k)]
                           for k in ("train/loss", "eval/loss")}
                curves[f"#{t.index} {t.name}"] = history
        with tempfile.TemporaryDirectory() as tmp:
            png = plots.loss_curves(curves, Path(tmp) / "trials_loss_curves.png", title="sweep trials")
            self.client.log_artifact(self.run_id, str(png))
        failed = [t for t in trials if t.status == "FAILED"]
        self.client.log_metric(self.run_id, "sweep/trials_failed", len(failed))
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
        return table


def summary_table(trials: list[Trial], metric: str) -> str:
    """Markdown table: trial, overrides, status, final train loss, best eval metric, wall time."""
    lower_better = "loss" in metric
    head = f"| trial | overrides | status | final train loss | best {metric} | wall time (s) | error |"
    lines = [head, "|" + "---|" * 7]
    for t in trials:
        m = t.metrics or {}
        train = m.get("final/train_loss")
        best = m.get(f"best/{metric}")
        lines.append(f"| {t.index} | {t.name} | {t.status} | {'' if train is None else f'{train:.4f}'} | "
                     f"{'' if best is None else f'{best:.4f}'} | {t.wall_time_s:.1f} | {t.error[:120]} |")
    done = [t for t in trials if (t.metrics or {}).get(f"best/{metric}") is not None]
    if done:
        pick = (min if lower_better else max)(done, key=lambda t: t.metrics[f"best/{metric}"])
        lines.append(f"\nbest: trial {pick.index} ({pick.name}), {metric} = {pick.metrics[f'best/{metric}']:.4f}")
    return "\n".join(lines)


def child_metrics(client: MlflowClient, run) -> dict:
    """A finished child's final metrics plus the best value of each eval metric over the run."""
    metrics = {k: v for k, v in run.data.metrics.items() if k.startswith("final/")}
    for key, pick in (("eval/loss", min), ("eval/accuracy", max)):
        history = client.get_metric_history(run.info.run_id, key)
        if history:
            metrics[f"best/{key.replace('/', '_')}"] = pick(m.value for m in history)
    return metrics
