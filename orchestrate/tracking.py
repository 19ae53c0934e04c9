"""MLflow tracking: one run per training job, the same metric names for every backend.

Metric names (MLflow's compare view overlays backends because these never change):
  train/loss, eval/loss, eval/accuracy, perf/samples_per_sec, perf/step_time_ms, lr
and once at the end: final/train_loss, final/eval_loss, final/eval_accuracy,
final/samples_per_sec, final/step_time_ms, final/wall_time_s.

A store that cannot be reached is refused up front (`reachable`, called by the command line's
check); one that goes away during a run does not stop it (orchestrate.outbox). Experiments are
tagged as model training for MLflow 3's UI (`mark_for_training`).
"""

import importlib.metadata
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import orchestrate
from orchestrate import errors
from orchestrate.meter import Diverged
from orchestrate.outbox import END_WAIT_S, UNSENT_FILE, Artifact, Outbox, cause, server_away, upload
from orchestrate.redact import redact, redacted_yaml, redact_text

log = logging.getLogger(__name__)


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


# One logging thread per run (the outbox's), whatever MLflow's asynchronous logging would start:
# many processes against one server stay within its connection pool. Set for sweep trials and
# runner workers.
ONE_LOGGING_THREAD = {"MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE": "1"}

# While a run is open, a request to an MLflow server that does not answer gives up within seconds
# (MLflow's defaults: 7 retries with growing pauses and a 120 s timeout, over two minutes): the
# outbox tries again on its own, and nothing else waits minutes. A value the user set is kept.
QUICK_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set environment variables (None: remove one); returns what they were, for set_env again."""
    before = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return before


MLFLOW_URI_MODULE = "mlflow.tracking._tracking_service.utils"  # holds `_tracking_uri`


def mlflow_uri() -> str | None:
    """MLflow's process-wide tracking URI as set (None: unset, or MLflow not imported yet)."""
    utils = sys.modules.get(MLFLOW_URI_MODULE)
    return utils._tracking_uri if utils is not None else None


def set_mlflow_uri(uri: str | None) -> None:
    """Put MLflow's process-wide tracking URI back to `uri` (what `mlflow_uri` returned), where
    MLflow's own `_use_tracking_uri` puts it back (None: never set). MLflow's `set_tracking_uri`
    also sets MLFLOW_TRACKING_URI: restore the environment after this."""
    utils = sys.modules.get(MLFLOW_URI_MODULE)
    if utils is not None and utils._tracking_uri != uri:
        utils.set_tracking_uri(uri)


# MLflow prints "View run <name> at: <server URL>" on the console whenever a run on an HTTP store
# ends; the run's summary names it already (and a sweep's own server is gone after the sweep).
NO_RUN_LINKS = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def quick_http() -> dict[str, str | None]:
    """QUICK_HTTP and NO_RUN_LINKS where the user set nothing; returns what to give `set_env` back."""
    return set_env({k: v for k, v in {**QUICK_HTTP, **NO_RUN_LINKS}.items() if k not in os.environ})


class RunLogger:
    """Logs into one MLflow run by its id: the run a Tracker opened, or (rank 0 of the runner's
    workers) a run that another process opened. Metrics and tags go out through an outbox
    (orchestrate.outbox): training never waits for the server, and an outage loses nothing.
    `close()` at the end: what the server did not take by then goes to `out_dir/mlflow_unsent.jsonl`."""

    def __init__(self, uri: str, run_id: str, out_dir: Path | None = None):
        from mlflow.tracking import MlflowClient

        self.client, self.uri, self.run_id = MlflowClient(tracking_uri=uri), uri, run_id
        self.env_before = quick_http()
        unsent = Path(out_dir or tempfile.gettempdir()) / (UNSENT_FILE if out_dir else f"{run_id}-{UNSENT_FILE}")
        self.outbox = Outbox(self.client, run_id, redact_text(uri), unsent)
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
        """The data's splits as the run's inputs (orchestrate.run_outputs); `record=False` only
        notes the eval split's name and digest (the runner's rank 0: the driver logged them)."""
        from orchestrate import run_outputs

        inputs = run_outputs.dataset_inputs(data, name)
        for given in inputs:
            if any(t.key == run_outputs.CONTEXT and t.value == "eval" for t in given.tags):
                self.eval_dataset = (given.dataset.name, given.dataset.digest)
        if record and inputs:
            try:
                self.client.log_inputs(self.run_id, datasets=inputs)
            except Exception as e:  # noqa: BLE001 - the run trains without its inputs listed
                log.warning(f"the data was not logged as the run's inputs ({cause(e)})")

    def log_model(self, path: Path, sample, step: int, register: str | None = None) -> str | None:
        """The trained model as an MLflow LoggedModel (orchestrate.run_outputs.log_model); a store
        that does not take it does not fail the run: the file stays in the output folder."""
        from orchestrate import run_outputs

        self.outbox.flush()  # the last evaluation's points are in the store before the model links them
        try:
            return run_outputs.log_model(self, path, sample, step, register)
        except Exception as e:  # noqa: BLE001 - the run trained; only its MLflow model is missing
            log.warning(f"{path} was not logged as an MLflow model ({cause(e)}); it stays in the output folder")
            return None

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.outbox.put([RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._upload(path, artifact_path)

    def log_artifacts(self, folder: Path, artifact_path: str | None = None) -> None:
        self._upload(folder, artifact_path)

    def _upload(self, path: Path, artifact_path: str | None) -> None:
        """Upload now (the file may be replaced soon: checkpoints rotate); while the server is away,
        or when it does not answer, the outbox uploads it later. Training goes on either way."""
        artifact = Artifact(str(path), artifact_path)
        if not self.outbox.away:
            try:
                upload(self.client, self.run_id, artifact)
                return
            except Exception as e:  # noqa: BLE001 - an upload never stops training
                if not server_away(e):
                    log.warning(f"{path} was not uploaded to MLflow ({cause(e)}); it stays in the output folder")
                    return
        self.outbox.put([artifact])

    def logged_history(self) -> dict[str, list[tuple[int, float]]]:
        """Every metric the run holds, as `key -> [(step, value)]`: a resumed run carries its
        curves on and does not log a step twice."""
        keys = self.client.get_run(self.run_id).data.metrics.keys()
        return {k: sorted((m.step, m.value) for m in self.client.get_metric_history(self.run_id, k)) for k in keys}

    def flush(self) -> bool:
        """Wait until everything logged so far is in the store, unless the server is away (then
        training does not wait: the outbox keeps it). True when everything was sent."""
        return self.outbox.flush()

    def close(self, wait_s: float = END_WAIT_S) -> bool:
        """The end of logging: send what is left (waiting up to `wait_s` for a server that is
        away), and give MLflow's HTTP settings back. True when everything was sent."""
        try:
            return self.outbox.close(wait_s)
        finally:
            set_env(self.env_before)


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
        # Absolute: MLflow keeps one store per URI string for the process, and a relative SQLite
        # path is another file once the working folder changes (a notebook, a test suite).
        uri = given[0] if given else absolute_uri(cfg.tracking.uri)
        # MLflow's quick HTTP settings from the run's first request on (RunLogger would set them
        # only once the run is open); __exit__ gives them back, and MLflow's process-wide URI (its
        # set_tracking_uri also sets MLFLOW_TRACKING_URI, which tracking.uri defaults to).
        self.uri_before = mlflow_uri()
        env_before, self.outbox = quick_http(), None
        env_before["MLFLOW_TRACKING_URI"] = os.environ.get("MLFLOW_TRACKING_URI")
        try:
            self._open(cfg, uri, given, run_name, tags, out_dir, resume_run_id)
        except BaseException:
            if self.outbox is not None:
                self.outbox.close()
            self._give_back(env_before)
            raise
        self.env_before = env_before

    def _give_back(self, env_before: dict[str, str | None]) -> None:
        set_mlflow_uri(self.uri_before)
        set_env(env_before)

    def _open(self, cfg: DictConfig, uri: str, given: tuple[str, str] | None, run_name: str, tags: dict[str, str],
              out_dir: Path, resume_run_id: str | None) -> None:
        mlflow = self.mlflow
        new_sqlite_store(uri)
        mlflow.set_tracking_uri(uri)
        tags = {"git_commit": git_commit(), "python": platform.python_version(), "host": platform.node(),
                "pid": str(os.getpid()), "out_dir": str(Path(out_dir).resolve()),
                **{f"version.{k}": v for k, v in versions().items()}, **tags, **redact(dict(cfg.tracking.tags))}
        # Written with the run itself, not through the outbox: a process killed in its first seconds
        # leaves a run that `trainer.resume=auto` can still tell apart (config_key) and end (host, pid).
        if resume_run_id:
            # The same run goes on: its params are this config already (config_key matched). MLflow
            # refuses to start a run outside the process's active experiment (an earlier run in this
            # process may have set another one): make the run's own experiment the active one.
            experiment_id = mlflow.tracking.MlflowClient(uri).get_run(resume_run_id).info.experiment_id
            mlflow.set_experiment(experiment_id=experiment_id)
            run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=cfg.tracking.system_metrics)
            for stale in ("error", "diverged_at"):
                if stale in run.data.tags:
                    # What stopped the earlier attempt no longer describes the run: it goes on.
                    mlflow.tracking.MlflowClient(uri).delete_tag(resume_run_id, stale)
        elif given:
            run = mlflow.start_run(run_id=given[1], log_system_metrics=cfg.tracking.system_metrics)
        else:
            # Made here (not by set_experiment, which says "Creating a new experiment" on the
            # console), tagged as model training.
            experiment_id = training_experiment(mlflow.tracking.MlflowClient(uri), cfg.tracking.experiment)
            mlflow.set_experiment(experiment_id=experiment_id)
            run = mlflow.start_run(run_name=cfg.tracking.run_name or run_name, tags=tags,
                                   log_system_metrics=cfg.tracking.system_metrics)
        super().__init__(uri, run.info.run_id, out_dir)
        if resume_run_id:
            self._send_unsent(Path(run.data.tags.get("out_dir", out_dir)) / UNSENT_FILE)
        if resume_run_id or given:  # an existing run: its tags now, in one request
            from mlflow.entities import RunTag

            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        mark_for_training(self.client, run.info.experiment_id)
        if not resume_run_id:
            items = list(flatten(cfg).items())
            for i in range(0, len(items), 100):
                mlflow.log_params(dict(items[i : i + 100]))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(redacted_yaml(cfg))
            (Path(tmp) / "requirements-freeze.txt").write_text(installed_packages())
            self.log_artifacts(Path(tmp))

    def _send_unsent(self, path: Path) -> None:
        """What the run's earlier attempt kept while its server was away (`orchestrate sync`'s
        work), before this attempt logs: its steps then count as logged."""
        if not path.is_file():
            return
        from orchestrate.sync import send_unsent

        try:
            print(f"sent {send_unsent(self.client, path)} item(s) that the run's last attempt could not ({path})",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - the file stays: `orchestrate sync` can send it later
            log.warning(f"{path} was not sent ({cause(e)}): `orchestrate sync {path.parent}` sends it later")

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        status = "FINISHED"
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"  # Ctrl-C, or SIGINT / SIGTERM (orchestrate.process.Stopped names it)
            self.set_tags({"error": f"interrupted ({str(exc) or exc_type.__name__})"})
        elif exc_type is not None:
            status = "FAILED"
            # A diverged run's own words (`loss became nan at step 12`); else the exception's name too.
            if issubclass(exc_type, Diverged):  # its own words; trainer.resume may go on with a lower rate
                self.set_tags({"error": str(exc), "diverged_at": str(exc.step)})
            else:
                self.set_tags({"error": errors.one_line(exc)[:5000]})
            errors.mark(exc, run=self.run_id)  # the boundary's line says which run is FAILED
        try:
            self.outbox.close()  # bounded: a server still away gets END_WAIT_S, then the file
        finally:
            try:
                self.mlflow.end_run(status)
            except Exception as e:  # noqa: BLE001 - the run's own outcome matters more than its status
                log.warning(f"MLflow at {self.outbox.uri} did not take the run's end ({status}: {cause(e)}): "
                            f"run {self.run_id} stays RUNNING there")
            finally:
                self._give_back(self.env_before)
        return False


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
            from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine_with_retry

            cache.mkdir(parents=True, exist_ok=True)
            fd, made = tempfile.mkstemp(dir=cache, suffix=".db")
            os.close(fd)
            os.unlink(made)  # SQLite makes the file
            engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{made}")
            chatty = logging.getLogger("mlflow.store.db.utils")  # "Creating initial MLflow database tables..."
            level = chatty.level
            chatty.setLevel(logging.WARNING)
            try:
                _initialize_tables(engine)  # MLflow's set-up: the tables, then its migrations to the latest
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


def reachable(uri: str, timeout_s: float = 5.0) -> str | None:
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
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    return set(getattr(_tracking_store_registry, "_registry", {}))


def absolute_uri(uri: str) -> str:
    """`sqlite:///mlflow.db` is relative to the working directory: make it absolute before handing
    it to a process that runs elsewhere (Ray Train workers run in their own folders)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


def open_ui(uri: str) -> str:
    """How to see the runs: a tracking server serves the UI at its own address (`mlflow ui
    --backend-store-uri http://...` would exit 1: an HTTP store is no store the UI can open);
    any other store through `ui_command`."""
    if uri.startswith(("http://", "https://")):
        return f"open the UI at     {redact_text(uri)}"
    return f"open the UI with   {ui_command(uri)}"


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
