"""Opening a run (orchestrate.tracking.run): new, resumed or handed over, through MLflow's client
only; MLflow's own variables as the defaults; a resumed run first sends what its last attempt kept."""

from orchestrate import app
from orchestrate.config import load_config
from orchestrate.tracking.logger import RunLogger
from orchestrate.tracking.outbox import UNSENT_FILE
from orchestrate.tracking.resume import ResumePoint
from orchestrate.tracking.run import Run, RunChoice, which_run
from tests.conftest import client_for


def reopened(cfg, run_id: str) -> RunChoice:
    """The plan of a run that trainer.resume continues (here: one without a checkpoint)."""
    uri = which_run(cfg).uri
    return RunChoice(uri=uri, resume=ResumePoint(run_id, 0, None, None, uri), handed_over=None)


def test_a_run_sets_no_process_wide_mlflow_state_and_leaves_a_notebook_s_alone(make_cfg, tmp_path):
    """New and resumed runs through MLflow's client only: what a notebook set (its tracking URI,
    experiment, active run) is what it finds after, and a resumed run opens in its own experiment
    whatever is active."""
    import mlflow

    cfg = make_cfg("backend=torch")
    client = client_for(cfg.tracking.uri)
    stopped = client.create_run(client.create_experiment("where_it_ran")).info.run_id
    mine = f"sqlite:///{tmp_path}/notebook.db"
    mlflow.set_tracking_uri(mine)
    try:
        mlflow.set_experiment("notebook")
        with mlflow.start_run() as own:
            with Run(cfg, reopened(cfg, stopped), run_name="x", tags={}, out_dir=tmp_path / "a") as resumed:
                assert resumed.run_id == stopped
            with Run(cfg, which_run(cfg), run_name="x", tags={}, out_dir=tmp_path / "b") as new:
                pass
            assert mlflow.get_tracking_uri() == mine and mlflow.active_run().info.run_id == own.info.run_id
            assert mlflow.get_experiment(own.info.experiment_id).name == "notebook"
        assert client.get_run(stopped).info.status == "FINISHED"
        assert client.get_experiment(client.get_run(new.run_id).info.experiment_id).name == cfg.tracking.experiment
        tags = client.get_run(new.run_id).data.tags
        assert tags["mlflow.runName"] == "x" and tags["mlflow.user"] and tags["pid"]  # MLflow's own tags and ours
        assert [r.info.run_id for r in mlflow.search_runs(output_format="list")] == [own.info.run_id]
    finally:
        mlflow.set_tracking_uri("")


def test_a_sweep_s_trial_logs_into_the_run_handed_over(make_cfg, tmp_path, monkeypatch):
    """MLFLOW_RUN_ID and MLFLOW_TRACKING_URI (what the sweep callbacks set per trial) name the run;
    it ends FINISHED with the trial's params."""
    cfg = make_cfg("backend=torch")
    client = client_for(which_run(cfg).uri)
    given = client.create_run(client.create_experiment("sweep")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", given)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", which_run(cfg).uri)
    plan = which_run(cfg)
    assert (plan.handed_over, plan.run_id, plan.resume) == (given, given, None)
    with Run(cfg, plan, run_name="x", tags={"backend": "torch"}, out_dir=tmp_path) as run:
        assert run.run_id == given
    done = client.get_run(given)
    assert done.info.status == "FINISHED" and done.data.tags["backend"] == "torch"
    assert done.data.params["optimizer.lr"] == str(cfg.optimizer.lr)


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


def test_a_resumed_run_first_sends_what_its_last_attempt_kept(make_cfg, tmp_path):
    """trainer.resume's reopened run takes its earlier attempt's mlflow_unsent.jsonl (found through
    the run's out_dir tag) before it logs: those steps then count as logged, once."""
    from tests.helpers import free_port

    cfg = make_cfg("backend=torch")
    with Run(cfg, which_run(cfg), run_name="first", tags={}, out_dir=tmp_path / "first") as first:
        pass
    # The first attempt's server went away for good: what it kept went to its folder's file.
    kept = RunLogger(f"http://127.0.0.1:{free_port()}", first.run_id, tmp_path / "first")
    for step in range(1, 6):
        kept.log_metrics({"train/loss": 1.0 / step}, step=step)
    assert not kept.close(wait_s=0)
    with Run(cfg, reopened(cfg, first.run_id), run_name="first", tags={}, out_dir=tmp_path / "second") as again:
        assert again.logged_history()["train/loss"] == [(s, 1.0 / s) for s in range(1, 6)]
    assert not (tmp_path / "first" / UNSENT_FILE).exists()
    assert (tmp_path / "first" / f"{UNSENT_FILE}.sent").is_file()


def test_a_first_run_in_a_folder_opens_its_new_store_without_mlflow_s_table_set_up(make_cfg, tmp_path, capfd):
    """The store is a copy of the cached empty one (tracking.stores.new_sqlite_store) made before
    any client opens it: no "Creating initial MLflow database tables" on the console, no 2 s."""
    cfg = make_cfg()
    assert not (tmp_path / "mlflow.db").exists()
    with Run(cfg, which_run(cfg), run_name="x", tags={}, out_dir=tmp_path / "out"):
        pass
    assert (tmp_path / "mlflow.db").is_file()
    assert "database tables" not in capfd.readouterr().err
