"""Shared fixtures: a real MLflow tracking server on 127.0.0.1, and configs composed from conf/
pointed at a test's temporary folder (the lightning-hydra-template way)."""

from pathlib import Path

import pytest
from hydra.types import RunMode
from mlflow.tracking import MlflowClient

from orchestrate import app
from orchestrate.sweeps._server import TrackingServer

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = sorted(p.stem for p in (ROOT / "conf" / "backend").glob("*.yaml"))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with a SQLite store (the one sweeps start); yields its URI."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    server = TrackingServer(f"sqlite:///{folder}/mlflow.db", folder / "artifacts")
    yield server.uri
    server.stop()


@pytest.fixture
def make_cfg(tmp_path):
    """compose(overrides) on the synthetic task with the quick trainer, tracking in tmp_path."""

    def make(*overrides: str, uri: str | None = None):
        base = ["data=synthetic", "trainer=quick", f"tracking.uri={uri or f'sqlite:///{tmp_path}/mlflow.db'}"]
        return app.load_config([*base, *overrides])

    return make


def multirun_config(overrides: list[str]):
    """The config a `-m` command line composes, with its `hydra` node (sweeper, launcher, overrides)."""
    return app.load_config(overrides, run_mode=RunMode.MULTIRUN, with_hydra=True)


def client_for(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri)


def metric_steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
