"""The sweep's own MLflow server: `mlflow server` on 127.0.0.1 in front of a SQLite store, started
by the sweep callbacks in the launching process and stopped when the sweep closes."""

import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def prepare_store(sqlite_uri: str, experiment: str) -> None:
    """Create the store's tables and the experiment, writing to the SQLite file directly: the
    experiment's artifact root is then ./mlruns, as for a single run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    if client.get_experiment_by_name(experiment) is None:
        client.create_experiment(experiment)
    # Write-ahead logging: readers (the sweep's summary, the UI) no longer block the writer. The
    # setting is stored in the database file.
    with sqlite3.connect(sqlite_uri.removeprefix("sqlite:///")) as db:
        db.execute("PRAGMA journal_mode=WAL")


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
