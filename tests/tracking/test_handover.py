import os

from orchestrate.tracking import handover


def test_a_run_the_training_command_left_open_is_ended_killed_and_a_closed_one_left(tmp_path, monkeypatch):
    """What the wrapper (orchestrate slurm-ray) does after a signal once the training command has
    ended: its run, named in the run file the command wrote, is ended KILLED only if the command
    left it RUNNING; the wrapper's quick MLflow settings are given back."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    before = dict(os.environ)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("slurm")
    left_open, ended = client.create_run(experiment), client.create_run(experiment)
    client.set_terminated(ended.info.run_id, "FINISHED")
    monkeypatch.setenv(handover.RUN_FILE_VARIABLE, str(tmp_path / "run"))
    said = []
    for run in (left_open, ended):
        handover.tell_wrapper(uri, run.info.run_id)  # as Run does when it opens the run
        said.append(handover.end_run_left_open(tmp_path / "run", "SIGTERM"))
    assert said == [f"MLflow run {left_open.info.run_id} marked KILLED (the training command ended without "
                    "ending it)", None]
    now = client.get_run(left_open.info.run_id)
    assert (now.info.status, now.data.tags.get("error")) == ("KILLED", "interrupted (SIGTERM)")
    now = client.get_run(ended.info.run_id)
    assert (now.info.status, now.data.tags.get("error")) == ("FINISHED", None)
    assert handover.end_run_left_open(tmp_path / "no such file", "SIGTERM") is None  # no run opened
    monkeypatch.delenv(handover.RUN_FILE_VARIABLE)
    assert dict(os.environ) == {k: v for k, v in before.items() if k != handover.RUN_FILE_VARIABLE}
