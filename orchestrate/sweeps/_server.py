"""The sweep's own MLflow server: `mlflow server` on 127.0.0.1 in front of a SQLite store, started
by the sweep callbacks in the launching process and stopped when the sweep closes."""

import signal
import tempfile
from pathlib import Path

from orchestrate.cluster.mlflow_server import HEALTH_TIMEOUT_S, MlflowServer, ServerError, health
from orchestrate.tracking.stores import training_experiment, write_ahead


def own_server(uri: str, tracking_server: bool) -> bool:
    """Whether a sweep that writes to `uri` runs its own server in front of it: a SQLite store,
    unless `hydra.callbacks.sweep_tracking.tracking_server=false`."""
    return uri.startswith("sqlite:") and tracking_server


def prepare_store(sqlite_uri: str, experiment: str, served_artifacts: bool = False) -> None:
    """Create the store's tables and the experiment, writing to the SQLite file directly: the
    experiment's artifact root is then ./mlruns, as for a single run. With `served_artifacts`
    (trials on other hosts), the tables only: the sweep's server creates the experiment, whose
    artifacts it then takes over HTTP (mlflow-artifacts:/), which every host can reach."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    if served_artifacts:
        client.search_experiments(max_results=1)  # MLflow makes the tables when it opens the store
    else:
        training_experiment(client, experiment)
    write_ahead(sqlite_uri)


class WarmServer:
    """The warm stack's MLflow server (`orchestrate up`, orchestrate.cluster.warm) in front of the sweep's
    store: used as the sweep's own would be, never stopped by it."""

    warm = True

    def __init__(self, uri: str, artifacts: str):
        self.uri, self.artifacts = uri, Path(artifacts)

    def answers(self, timeout_s: float = 2.0) -> bool:
        return health(self.uri, timeout_s)

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        pass

    def stop(self) -> None:
        pass


def warm_server(sqlite_uri: str, runtime) -> WarmServer | None:
    """The warm stack's server, if `runtime` (orchestrate.cluster.runtime) has one that fronts `sqlite_uri`."""
    warm = runtime.server_for(sqlite_uri)
    return WarmServer(*warm) if warm else None


class TrackingServer(MlflowServer):
    """`mlflow server` on a free port of 127.0.0.1 (or of `host`: this machine's address toward
    a Ray cluster whose hosts run the trials, orchestrate.sweeps.remote) in front of a SQLite store, its output in a
    temporary log file (kept, and named, only when the server failed). Many trials writing to one
    SQLite file at once fail ("database is locked", schema races); one server serialises their
    writes. With `wait=False` the server is only started: `wait_healthy` waits for it."""

    warm = False

    def __init__(self, sqlite_uri: str, artifact_root: Path, wait: bool = True, host: str = "127.0.0.1",
                 port: int | None = None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mlflow-server-", suffix=".log", delete=False)
        self.failed = False
        super().__init__(sqlite_uri, artifact_root, host=host, port=port, log=self.log, wait=False, detached=True)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        try:
            super().wait_healthy(timeout_s)
        except ServerError as e:
            self.failed = True
            self.stop()
            raise RuntimeError(f"the sweep's MLflow server did not start ({e}); its log: {self.log.name}") from None

    def stop(self) -> None:
        super().stop()
        self.log.close()
        # -SIGTERM is the stop above (also of a server a refused sweep started early), -SIGINT a Ctrl-C; anything else,
        # or a server that never answered, is the server's own failure: keep its log.
        if not self.failed and self.proc.returncode in (0, -signal.SIGTERM, -signal.SIGINT):  # SIGINT: Ctrl-C
            Path(self.log.name).unlink(missing_ok=True)
        elif self.healthy:
            print(f"the sweep's MLflow server exited with code {self.proc.returncode}; its log: {self.log.name}")
