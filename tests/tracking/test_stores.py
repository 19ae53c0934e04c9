"""Tracking stores: unreachable ones refused up front and in seconds, a new SQLite store made fast,
the experiment's kind, how the UI is opened on each kind of store."""

import shlex
import subprocess
import sys
import time

from orchestrate.tracking.run import Run, which_run
from orchestrate.tracking.stores import (
    EXPERIMENT_KIND,
    new_sqlite_store,
    open_ui,
    runs_pages,
    training_experiment,
    ui_command,
    unreachable,
)
from tests.conftest import client_for


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
    # With the experiment: its runs table (a fresh browser on the bare address lands on MLflow 3's
    # GenAI overview, not the runs).
    assert open_ui("http://127.0.0.1:5055", "3") == "open the UI at     http://127.0.0.1:5055/#/experiments/3/runs"
    ui, page = open_ui("sqlite:///mlflow.db", "3").splitlines()
    assert ui == open_ui("sqlite:///mlflow.db")
    assert page == "then open          http://127.0.0.1:5000/#/experiments/3/runs"


def test_make_ui_names_each_experiment_s_runs_page(tmp_path):
    store = f"sqlite:///{tmp_path}/mlflow.db"
    assert runs_pages(store) == [f"no runs yet in {store}"]
    new_sqlite_store(store)
    client = client_for(store)
    first, second = (training_experiment(client, name) for name in ("orchestrate", "other"))
    assert runs_pages(store) == [f"orchestrate: http://127.0.0.1:5000/#/experiments/{first}/runs",
                                 f"other: http://127.0.0.1:5000/#/experiments/{second}/runs"]


def test_an_unreachable_tracking_uri_stops_the_command_in_seconds(tmp_path):
    """Nothing listens there: one message naming the URI and the cause, exit 2, nothing trained or
    written (MLflow's own client would retry for over two minutes first)."""
    from tests.helpers import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    assert uri in unreachable(uri) and time.monotonic() - began < 10  # the check itself: well within 10 s
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


def test_experiments_orchestrate_creates_are_model_training_experiments(make_cfg, tmp_path):
    """MLflow 3's UI opens a model-training experiment on its runs table and charts: the
    experiment carries `mlflow.experimentKind`, also one that existed without it."""
    cfg = make_cfg()
    client = client_for(cfg.tracking.uri)
    with Run(cfg, which_run(cfg), run_name="x", tags={}, out_dir=tmp_path) as new:
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
