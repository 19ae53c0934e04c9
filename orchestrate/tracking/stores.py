"""MLflow stores: is a tracking URI one a run can log to (`unreachable`, asked before anything
runs), a new SQLite store made fast (`new_sqlite_store`), the URI as another process must see it
(`absolute_uri`), the experiment a run goes into (`training_experiment`), and how a user opens
the UI on it (`open_ui`)."""

import logging
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from orchestrate.tracking.outbox import cause
from orchestrate.tracking.redact import redact_text

log = logging.getLogger(__name__)


# MLflow 3's UI shows an experiment as its kind says: model training ("custom_model_development")
# opens on the runs table and the charts. MLflow sets the tag only on experiments its UI creates.
EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"


def mark_for_training(client, experiment_id: str) -> None:
    """Tag an experiment as model training, unless it says its kind already."""
    if EXPERIMENT_KIND not in client.get_experiment(experiment_id).tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)


def training_experiment(client, name: str) -> str:
    """The id of the experiment `name`, created if need be, tagged as model training."""
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name, tags={EXPERIMENT_KIND: MODEL_TRAINING})
    mark_for_training(client, found.experiment_id)
    return found.experiment_id


SERVED_ARTIFACTS = "mlflow-artifacts:"  # an artifact location behind an MLflow server (`--serve-artifacts`)


def artifacts_on_this_disk(location: str) -> bool:
    """Whether an experiment's artifact location is a folder of this machine (a path, file://),
    which only processes on this machine can write."""
    return "://" not in location.replace("file://", "", 1) and not location.startswith(SERVED_ARTIFACTS)


def unusable_experiment(uri: str, name: str, direct: bool = True) -> str | None:
    """One sentence when a run cannot log into experiment `name` of the store at `uri`: it is in
    MLflow's deleted state (MLflow refuses runs there, and keeps the name until `mlflow gc`), or
    its artifacts are served by an MLflow server (mlflow-artifacts:/, as a sweep on a cluster's
    hosts makes it, orchestrate.sweeps.remote) and the run writes to the database itself
    (`direct`: not through a sweep's server), through which MLflow cannot reach them. None
    otherwise, and for a store not made yet (nothing opens it here)."""
    if "://" not in uri or uri.startswith("file://"):
        if not Path(uri.removeprefix("file://")).exists():
            return None
    elif uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return None
    from mlflow.tracking import MlflowClient

    # Absolute: MLflow keeps one store per URI string for the process (another folder's mlflow.db).
    found = MlflowClient(tracking_uri=absolute_uri(uri)).get_experiment_by_name(name)
    if found is None:
        return None
    if found.artifact_location.startswith(SERVED_ARTIFACTS) and direct and not uri.startswith(("http:", "https:")):
        return (f"tracking.experiment={name}: its artifacts are kept behind an MLflow server ({found.artifact_location}: "
                f"a sweep on a cluster's hosts made it), which tracking.uri={redact_text(uri)} cannot reach; serve the "
                f"store (`mlflow server --backend-store-uri {redact_text(uri)}`, from the folder that holds mlartifacts) "
                "and set tracking.uri=http://127.0.0.1:5000, or choose another experiment name")
    if found.lifecycle_stage != "deleted":
        return None
    return (f"tracking.experiment={name}: the experiment (id {found.experiment_id}) is deleted in "
            f"{redact_text(uri)}; restore it (`mlflow experiments restore --experiment-id {found.experiment_id}` with "
            f"MLFLOW_TRACKING_URI={redact_text(uri)}) or choose another name")


def write_ahead(sqlite_uri: str) -> None:
    """Write-ahead logging: readers (a sweep's summary, the UI) no longer block the writer (a
    sweep's or the warm stack's server). The setting is stored in the database file."""
    import sqlite3

    with sqlite3.connect(sqlite_uri.removeprefix("sqlite:///")) as db:
        db.execute("PRAGMA journal_mode=WAL")


def new_sqlite_store(uri: str) -> None:
    """A SQLite store that does not exist yet starts as a copy of an empty one at MLflow's latest
    schema. MLflow would otherwise create the tables and replay its schema migrations on every new
    store: about 2 s of every first run in a folder (and of every test). The empty store is made
    once per MLflow version, by MLflow's own table set-up, and kept in the user's cache folder;
    MLflow adds the Default experiment (with this store's artifact root) when it opens the copy.
    Anything unexpected leaves the store to MLflow, as before."""
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
    if path in ("", ":memory:") or os.path.exists(path):
        return
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orchestrate"
    template = cache / f"mlflow-{mlflow.__version__}-empty-store.db"
    try:
        if not template.exists():
            from mlflow.store.db.utils import create_sqlalchemy_engine_with_retry

            from orchestrate.thirdparty import mlflow_initialize_tables

            cache.mkdir(parents=True, exist_ok=True)
            fd, made = tempfile.mkstemp(dir=cache, suffix=".db")
            os.close(fd)
            os.unlink(made)  # SQLite makes the file
            engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{made}")
            chatty = logging.getLogger("mlflow.store.db.utils")  # "Creating initial MLflow database tables..."
            level = chatty.level
            chatty.setLevel(logging.WARNING)
            try:
                mlflow_initialize_tables(engine)  # MLflow's set-up: the tables, then its migrations to the latest
            finally:
                chatty.setLevel(level)
                engine.dispose()
            os.replace(made, template)  # whole or not at all, even with runs starting beside this one
        fd, copy = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".db-new")
        os.close(fd)
        shutil.copyfile(template, copy)
        try:
            os.link(copy, path)  # never over a store another process has just made
        except FileExistsError:
            pass
        finally:
            os.unlink(copy)
    except Exception as e:  # noqa: BLE001 - MLflow makes the store itself, only slower
        log.debug(f"no store template for {path} ({cause(e)}): MLflow creates it")


DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


SERVER_WAIT_S = 20.0  # the longest a sweep's trial waits for the sweep's MLflow server (restarting: found gone)


def wait_for(uri: str, timeout_s: float = SERVER_WAIT_S) -> str | None:
    """`unreachable(uri)` asked again until it is None or `timeout_s` passed (a server restarting: a
    sweep's, started again on its port once found gone); its last answer."""
    import time

    deadline = time.monotonic() + timeout_s
    while (why := unreachable(uri, min(5.0, timeout_s))) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    return why


def unreachable(uri: str, timeout_s: float = 5.0) -> str | None:
    """None when a run could log to the tracking URI `uri`; else one sentence with the URI and the
    cause. Asks only what answers within `timeout_s`: an HTTP server's /health, a database's
    login (PostgreSQL) or port, a SQLite file's folder. Other stores (databricks, ...) pass."""
    from urllib.parse import urlsplit

    shown = f"tracking.uri={redact_text(uri)}"
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    known = store_schemes()
    if known and scheme not in known:
        return (f"{shown}: MLflow has no tracking store for {scheme}://; allowed: a folder, "
                + ", ".join(f"{s}://" for s in sorted(known) if s))
    if scheme in ("http", "https"):
        import urllib.error
        import urllib.request

        parts = urlsplit(uri)
        host = parts.netloc.rpartition("@")[2]  # credentials are MLflow's business, not the health check's
        url = f"{parts.scheme}://{host}{parts.path.rstrip('/')}/health"
        try:
            urllib.request.urlopen(url, timeout=timeout_s).close()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                return None  # a server that wants credentials: MLflow's client sends them, this check does not
            return f"{shown}: {url} answers HTTP {e.code} ({e.reason}): not an MLflow server"
        except (OSError, ValueError) as e:
            return f"{shown}: no MLflow server answers at {url} within {timeout_s:g} s ({cause(getattr(e, 'reason', e))})"
        return None
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path in ("", ":memory:"):
            return None
        file = Path(os.path.abspath(path))
        if not file.parent.is_dir():
            return f"{shown}: the folder {file.parent} does not exist (SQLite creates the file, not its folder)"
        if not os.access(file if file.exists() else file.parent, os.W_OK):
            return f"{shown}: {file if file.exists() else file.parent} is not writable"
        return None
    if scheme == "postgresql":
        try:
            import psycopg2
        except ImportError:
            psycopg2 = None
        if psycopg2 is not None:
            dsn = "postgresql://" + uri.split("://", 1)[1]  # libpq reads the URI; no SQLAlchemy driver part
            try:
                psycopg2.connect(dsn, connect_timeout=max(1, round(timeout_s))).close()
            except psycopg2.Error as e:
                return f"{shown}: {redact_text(str(e).strip().splitlines()[0])}"
            return None
    if scheme in DATABASE_PORTS:
        parts = urlsplit(uri)
        address = (parts.hostname or "localhost", parts.port or DATABASE_PORTS[scheme])
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except OSError as e:
            return f"{shown}: nothing answers at {address[0]}:{address[1]} within {timeout_s:g} s ({cause(e)})"
        return None
    if scheme in ("", "file"):
        folder = Path(os.path.abspath(urlsplit(uri).path if scheme else uri))
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent  # MLflow creates the missing folders below the first that exists
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            return f"{shown}: {folder} is not a writable folder"
    return None


def store_schemes() -> set[str]:
    """The URI schemes MLflow has a tracking store for (its own and its plugins'); empty if this
    MLflow keeps them elsewhere."""
    from orchestrate.thirdparty import mlflow_store_schemes

    return mlflow_store_schemes()


def absolute_uri(uri: str) -> str:
    """`sqlite:///mlflow.db` is relative to the working directory: make it absolute before handing
    it to a process that runs elsewhere (Ray Train workers run in their own folders)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


UI_ADDRESS = "http://127.0.0.1:5000"  # where `ui_command`'s UI listens


def runs_page(address: str, experiment_id: str) -> str:
    """The experiment's runs table (its Dataset and Models columns) in MLflow's UI: a fresh browser
    opened on the bare address lands on MLflow 3's GenAI overview (traces, token usage) instead."""
    return f"{address.rstrip('/')}/#/experiments/{experiment_id}/runs"


def open_ui(uri: str, experiment_id: str | None = None) -> str:
    """How to see the runs: a tracking server serves the UI at its own address (`mlflow ui
    --backend-store-uri http://...` would exit 1: an HTTP store is no store the UI can open),
    opened on the experiment's runs page; any other store through `ui_command`, runnable as
    printed, with the page to open on a second line."""
    if uri.startswith(("http://", "https://")):
        return f"open the UI at     {runs_page(redact_text(uri), experiment_id) if experiment_id else redact_text(uri)}"
    line = f"open the UI with   {ui_command(uri)}"
    return line + (f"\nthen open          {runs_page(UI_ADDRESS, experiment_id)}" if experiment_id else "")


def runs_pages(sqlite_uri: str) -> list[str]:
    """`make ui`'s lines before it starts the UI on `sqlite_uri`: each experiment's runs page
    (MLflow's own Default experiment left out when empty)."""
    if not Path(sqlite_uri.removeprefix("sqlite:///")).is_file():
        return [f"no runs yet in {sqlite_uri}"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    found = sorted(client.search_experiments(), key=lambda e: int(e.experiment_id))  # oldest first
    return [f"{e.name}: {runs_page(UI_ADDRESS, e.experiment_id)}" for e in found
            if e.name != "Default" or client.search_runs([e.experiment_id], max_results=1)]


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
