"""Shared fixtures: a real MLflow tracking server on 127.0.0.1, and configs composed from conf/
pointed at a test's temporary folder (the lightning-hydra-template way)."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrate import app

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = sorted(p.stem for p in (ROOT / "conf" / "backend").glob("*.yaml"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with a SQLite store; yields its tracking URI."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder}/mlflow.db", "--artifacts-destination", str(folder / "artifacts")],
        cwd=folder, env=env, stdout=open(folder / "server.log", "w"), stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"mlflow server did not start:\n{(folder / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield uri
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def make_cfg(tmp_path):
    """compose(overrides) on the synthetic task with the quick trainer, tracking in tmp_path."""

    def make(*overrides: str, uri: str | None = None):
        base = ["data=synthetic", "trainer=quick", f"tracking.uri={uri or f'sqlite:///{tmp_path}/mlflow.db'}"]
        return app.load_config([*base, *overrides])

    return make


def client_for(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri)


def metric_steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
