"""MLflow tracking: trainer.resume's lookup (which run and checkpoint a resume continues, and its
plain errors), a tracking store that is unreachable or goes away mid-run, the experiment's kind."""

import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest

from orchestrate import app
from orchestrate.config import load_config
from orchestrate.outbox import UNSENT_FILE
from orchestrate.schema import ConfigError
from orchestrate.resume import config_key, find_resume
from orchestrate.tasks.data import Synthetic
from orchestrate.tracking import EXPERIMENT_KIND, RunLogger, Tracker, open_ui, reachable, training_experiment, ui_command
from tests.conftest import client_for, metric_steps


def test_the_config_key_ignores_tracking_and_resume_settings_only(make_cfg):
    base = make_cfg("backend=torch")
    assert config_key(base) == config_key(make_cfg("backend=torch", "trainer.resume=auto", "tracking.run_name=x"))
    assert config_key(base) != config_key(make_cfg("backend=torch", "optimizer.lr=0.5"))


def test_resume_errors_name_the_key(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="trainer.resume=abc: no MLflow store at"):
        find_resume(make_cfg("trainer.resume=abc"))
    assert not (tmp_path / "mlflow.db").exists()  # asking created nothing

    same = ("backend=torch", "trainer.checkpoint_period=0")
    finished = app.train(make_cfg(*same), tmp_path / "out")
    with pytest.raises(ConfigError, match="trainer.resume=abc: no such run in .*; allowed: auto or a run id"):
        find_resume(make_cfg("trainer.resume=abc"))
    with pytest.raises(ConfigError, match=r"another config \(differs at optimizer.lr\)"):
        find_resume(make_cfg(*same, "optimizer.lr=0.5", f"trainer.resume={finished.run_id}"))
    point = find_resume(make_cfg(*same, f"trainer.resume={finished.run_id}"))
    assert point.run_id == finished.run_id and point.step == 30  # its last (and only) checkpoint
    assert find_resume(make_cfg(*same, "trainer.resume=auto")) is None  # finished: nothing to go on with


def test_a_checkpoint_only_in_mlflow_is_downloaded(make_cfg, tmp_path):
    import shutil

    run = app.train(make_cfg("backend=torch"), tmp_path / "out")
    shutil.rmtree(tmp_path / "out")  # another machine: only the MLflow store has the checkpoint
    point = find_resume(make_cfg("backend=torch", f"trainer.resume={run.run_id}"))
    assert point.local is None and point.artifact == "checkpoints/step_0000030.pt"
    assert point.fetch(tmp_path / "new").read_bytes()[:2] == b"PK"  # a torch zip file


def test_the_ui_command_runs_as_printed_when_the_environment_is_not_active(monkeypatch):
    """`mlflow` is on the PATH only while the virtual environment is active: the printed command
    names this environment's own `mlflow` unless the PATH already finds it."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    command = shlex.split(ui_command("sqlite:///mlflow.db"))
    assert command[1:] == ["ui", "--backend-store-uri", "sqlite:///mlflow.db", "--host", "127.0.0.1", "--port", "5000"]
    done = subprocess.run([command[0], "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "version" in done.stdout


def test_a_tracking_server_is_opened_at_its_own_address():
    """The UI of runs on a server is the server: no `mlflow ui` pointed at it (that exits 1)."""
    assert open_ui("http://127.0.0.1:5055") == "open the UI at     http://127.0.0.1:5055"
    assert open_ui("sqlite:///mlflow.db").startswith("open the UI with   ") and " ui --backend-store-uri sqlite" \
        in open_ui("sqlite:///mlflow.db")


def test_a_resumed_run_opens_in_its_own_experiment_whatever_is_active(make_cfg, tmp_path):
    """MLflow refuses start_run(run_id=...) outside the active experiment: an earlier run in the
    same process (another experiment) must not stop a resume."""
    import mlflow

    from orchestrate.tracking import Tracker

    cfg = make_cfg("backend=torch")
    client = mlflow.tracking.MlflowClient(cfg.tracking.uri)
    stopped = client.create_run(client.create_experiment("where_it_ran")).info.run_id
    mlflow.set_tracking_uri(cfg.tracking.uri)
    mlflow.set_experiment("another")  # what an earlier run in this process left active
    try:
        with Tracker(cfg, run_name="x", tags={}, out_dir=tmp_path, resume_run_id=stopped) as tracker:
            assert tracker.run_id == stopped
        assert client.get_run(stopped).info.status == "FINISHED"
    finally:
        mlflow.set_tracking_uri("")


# ---- the tracking store: unreachable up front, away and back during a run, the experiment's kind --

def test_an_unreachable_tracking_uri_stops_the_command_in_seconds(tmp_path):
    """Nothing listens there: one message naming the URI and the cause, exit 2, nothing trained or
    written (MLflow's own client would retry for over two minutes first)."""
    from tests.helpers import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    assert uri in reachable(uri) and time.monotonic() - began < 10  # the check itself: well within 10 s
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrate", f"tracking.uri={uri}", "data=synthetic", "trainer=quick"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: tracking.uri={uri}: no MLflow server answers at {uri}/health")
    assert "Connection refused" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    # About 5 s on an idle machine, most of it importing torch; the bound leaves room for a loaded
    # CI runner (26 s seen with 14 processes on 2 cores) and is still far from MLflow's retries.
    assert took < 60, f"took {took:.1f} s"
    assert list(tmp_path.iterdir()) == []  # no outputs/, no store


OUTAGE: dict = {}  # the outage test's server, and the batches at which it goes away and comes back


class OutageData(Synthetic):
    """The synthetic data set, which stops the test's MLflow server when training asks for batch
    `stop_at`, and at batch `restart_at`, once the run has said the server is away, starts it
    again on the same port and store."""

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if OUTAGE and position == OUTAGE["stop_at"]:
            OUTAGE["server"].stop()
        if OUTAGE and position == OUTAGE["restart_at"]:
            assert OUTAGE["away"].wait(60), "the run never said that the server went away"
            OUTAGE["server"] = OUTAGE["start"]()
        return super().train_batch(position, batch_size, seed, rank, world_size)


class Said(logging.Handler):
    """Sets `event` when a log record says `words`."""

    def __init__(self, words: str, event: threading.Event):
        super().__init__()
        self.words, self.event = words, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


def test_a_server_that_goes_away_mid_run_gets_every_step_exactly_once(make_cfg, tmp_path, caplog):
    from orchestrate.server import MlflowServer

    store, artifacts = f"sqlite:///{tmp_path}/server.db", tmp_path / "artifacts"
    log = open(tmp_path / "server.log", "w")
    first = MlflowServer(store, artifacts, log=log)
    away = threading.Event()
    said = Said("does not answer", away)
    logging.getLogger("orchestrate.outbox").addHandler(said)
    OUTAGE.update(server=first, stop_at=60, restart_at=120, away=away,
                  start=lambda: MlflowServer(store, artifacts, port=first.port, log=log))
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrate"):
            result = app.train(make_cfg("data._target_=tests.test_tracking.OutageData", "trainer.max_steps=200",
                                        "trainer.display_loss_steps=1", "trainer.evaluation_period=50",
                                        "trainer.checkpoint_period=50", "trainer.max_num_checkpoints=4", uri=first.uri), tmp_path / "out")
        client = client_for(first.uri)
        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED"
        for key in ("train/loss", "lr", "perf/step_time_ms", "perf/samples_per_sec"):
            assert [s for s, _ in metric_steps(client, result.run_id, key)] == list(range(1, 201)), key
        assert [s for s, _ in metric_steps(client, result.run_id, "eval/loss")] == [50, 100, 150, 200]
        # Logged while the server was away (steps 61 to 120): the values the run computed.
        assert metric_steps(client, result.run_id, "train/loss") == result.history["train/loss"]
        # The checkpoint saved during the outage was uploaded once the server was back.
        uploaded = [a.path for a in client.list_artifacts(result.run_id, "checkpoints")]
        assert "checkpoints/step_0000100.pt" in uploaded and "checkpoints/step_0000200.pt" in uploaded
        said_away = [r for r in caplog.records if "does not answer" in r.getMessage()]
        said_back = [r for r in caplog.records if "answers again" in r.getMessage()]
        assert len(said_away) == 1 and len(said_back) == 1, caplog.text
        assert first.uri in said_away[0].getMessage() and not (tmp_path / "out" / UNSENT_FILE).exists()
    finally:
        logging.getLogger("orchestrate.outbox").removeHandler(said)
        OUTAGE.pop("server").stop()
        OUTAGE.clear()
        log.close()


def test_a_run_left_without_its_server_writes_what_it_kept_to_a_file(tmp_path, caplog):
    """The server is gone and does not come back: logging never waits for it, and the end of the
    run waits a bounded time, then writes the kept points and tags to the output folder and says so."""
    from tests.helpers import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens: a server that went away for good
    retries = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    logger = RunLogger(uri, "0123456789abcdef", tmp_path / "out")
    began = time.monotonic()
    for step in range(1, 11):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    logger.set_tags({"after": "outage"})
    assert time.monotonic() - began < 1  # the training loop did not wait for the server
    with caplog.at_level(logging.WARNING, logger="orchestrate"):
        assert not logger.close(wait_s=3)
    rows = [json.loads(line) for line in (tmp_path / "out" / UNSENT_FILE).read_text().splitlines()]
    assert [(r["metric"], r["step"], r["value"]) for r in rows if "metric" in r] == [
        ("train/loss", step, 1.0 / step) for step in range(1, 11)]
    assert {"run_id": "0123456789abcdef", "tag": "after", "value": "outage"} in rows
    assert "did not take 11 item(s) of run 0123456789abcdef" in caplog.text
    assert os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") == retries  # MLflow's settings given back


def test_experiments_orchestrate_creates_are_model_training_experiments(make_cfg, tmp_path):
    """MLflow 3's UI opens a model-training experiment on its runs table and charts: the
    experiment carries `mlflow.experimentKind`, also one that existed without it."""
    cfg = make_cfg()
    client = client_for(cfg.tracking.uri)
    with Tracker(cfg, run_name="x", tags={}, out_dir=tmp_path) as new:
        pass
    created = client.get_experiment(client.get_run(new.run_id).info.experiment_id)
    assert created.name == cfg.tracking.experiment
    assert created.tags[EXPERIMENT_KIND] == "custom_model_development"

    older = client.create_experiment("made_elsewhere")  # e.g. by an older orchestrate: no kind
    assert training_experiment(client, "made_elsewhere") == older
    assert client.get_experiment(older).tags[EXPERIMENT_KIND] == "custom_model_development"
    genai = client.create_experiment("genai", tags={EXPERIMENT_KIND: "genai_development"})
    assert training_experiment(client, "genai") == genai  # a kind someone chose stays
    assert client.get_experiment(genai).tags[EXPERIMENT_KIND] == "genai_development"
    made = training_experiment(client, "a_sweep")
    assert client.get_experiment(made).tags[EXPERIMENT_KIND] == "custom_model_development"


def test_a_new_sqlite_store_is_a_copy_of_an_empty_one_made_once(tmp_path, monkeypatch):
    """The empty store at MLflow's schema is made the first time (in the user's cache folder), then
    copied: each new store opens at once in MLflow, and is its own file."""
    from mlflow.tracking import MlflowClient

    from orchestrate.tracking import new_sqlite_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("a", "b"):
        new_sqlite_store(f"sqlite:///{tmp_path / name}.db")
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / name}.db")
        training_experiment(client, f"from {name}")
        assert [e.name for e in client.search_experiments()] == [f"from {name}", "Default"]
    (template,) = (tmp_path / "cache" / "orchestrate").glob("mlflow-*-empty-store.db")
    made = template.stat().st_mtime_ns
    new_sqlite_store(f"sqlite:///{tmp_path / 'c'}.db")
    assert template.stat().st_mtime_ns == made  # made once
    new_sqlite_store(f"sqlite:///{tmp_path / 'a'}.db")  # an existing store is left as it is
    assert [e.name for e in MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'a'}.db").search_experiments()] == [
        "from a", "Default"]


def test_mlflow_s_own_variables_are_the_defaults_and_an_override_wins(tmp_path, monkeypatch, capsys):
    """MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME, as MLflow's client and Lightning's
    MLFlowLogger read them; `tracking.uri=` on the command line (or tracking=server) still wins,
    and the run's summary says where it logged."""
    env_uri = f"sqlite:///{tmp_path}/env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    cfg = load_config(["backend=torch", "data=synthetic", "trainer=quick", "trainer.checkpoint_period=0"])
    assert (cfg.tracking.uri, cfg.tracking.experiment) == (env_uri, "from-env")
    result = app.train(cfg, tmp_path / "out")
    run = client_for(env_uri).get_run(result.run_id)
    assert client_for(env_uri).get_experiment(run.info.experiment_id).name == "from-env"
    assert f"(experiment 'from-env' in {env_uri})" in capsys.readouterr().out
    assert load_config(["tracking.uri=sqlite:///other.db"]).tracking.uri == "sqlite:///other.db"
    assert load_config(["tracking=server"]).tracking.uri == "http://127.0.0.1:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    assert (load_config([]).tracking.uri, load_config([]).tracking.experiment) == (
        "sqlite:///mlflow.db", "orchestrate")


def test_what_a_run_kept_for_a_server_that_never_came_back_is_synced_into_its_run_once(tmp_path, capsys):
    """The server goes away before the run's end and is still away when the run ends (the kept
    points go to mlflow_unsent.jsonl); it comes back; `orchestrate sync RUN_FOLDER` logs them into
    the same run, each point once, and a second sync sends nothing."""
    from orchestrate import sync
    from orchestrate.server import MlflowServer
    from tests.helpers import free_port

    # The run is made in the server's store directly (one server start, not two); the server's
    # port answers nothing until the server starts, after the run and the first sync.
    store, artifacts, port = f"sqlite:///{tmp_path}/server.db", tmp_path / "artifacts", free_port()
    client = client_for(store)
    run_id = client.create_run(client.create_experiment("sync")).info.run_id
    away = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        logger = RunLogger(away, run_id, tmp_path / "out")
        for step in range(1, 21):
            logger.log_metrics({"train/loss": 1.0 / step}, step=step)
        logger.set_tags({"after": "outage"})
        assert not logger.close(wait_s=2)
        assert (tmp_path / "out" / UNSENT_FILE).is_file()

        assert sync.main([str(tmp_path / "out"), "--tracking-uri", away]) == 1  # still away: kept
        assert "did not take it" in capsys.readouterr().err and (tmp_path / "out" / UNSENT_FILE).is_file()

        server = MlflowServer(store, artifacts, port=port, log=log)
        try:
            assert sync.main([str(tmp_path / "out"), "--tracking-uri", server.uri]) == 0
            assert "sent 21 item(s)" in capsys.readouterr().out
            assert sync.main([str(tmp_path / "out"), "--tracking-uri", server.uri]) == 0
            assert "nothing to send (sent already)" in capsys.readouterr().out
            history = client_for(server.uri).get_metric_history(run_id, "train/loss")
            assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in range(1, 21)]
            assert client_for(server.uri).get_run(run_id).data.tags["after"] == "outage"
        finally:
            server.stop()


def test_sync_refuses_what_it_cannot_place_with_one_line(tmp_path, capsys, monkeypatch):
    from orchestrate import sync

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert sync.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nowhere'}: no such folder"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / UNSENT_FILE).write_text("{}\n")
    assert sync.main([str(tmp_path / "run")]) == 2
    assert "Give --tracking-uri" in capsys.readouterr().err
    (tmp_path / "run" / UNSENT_FILE).write_text('{"run_id": "x", "metric": "loss"}\n')
    assert sync.main([str(tmp_path / "run"), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'run' / UNSENT_FILE}:1: not a line the outbox writes")
    assert not (tmp_path / "m.db").exists()  # refused before any store was opened


def test_a_resumed_run_first_sends_what_its_last_attempt_kept(make_cfg, tmp_path):
    """trainer.resume's reopened run takes its earlier attempt's mlflow_unsent.jsonl (found through
    the run's out_dir tag) before it logs: those steps then count as logged, once."""
    from tests.helpers import free_port

    cfg = make_cfg("backend=torch")
    with Tracker(cfg, run_name="first", tags={}, out_dir=tmp_path / "first") as first:
        pass
    # The first attempt's server went away for good: what it kept went to its folder's file.
    kept = RunLogger(f"http://127.0.0.1:{free_port()}", first.run_id, tmp_path / "first")
    for step in range(1, 6):
        kept.log_metrics({"train/loss": 1.0 / step}, step=step)
    assert not kept.close(wait_s=0)
    with Tracker(cfg, run_name="first", tags={}, out_dir=tmp_path / "second", resume_run_id=first.run_id) as again:
        assert again.logged_history()["train/loss"] == [(s, 1.0 / s) for s in range(1, 6)]
    assert not (tmp_path / "first" / UNSENT_FILE).exists()
    assert (tmp_path / "first" / f"{UNSENT_FILE}.sent").is_file()
