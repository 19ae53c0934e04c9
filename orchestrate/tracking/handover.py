"""Runs handed between processes. A run handed over by a sweep: the sweep callbacks
(orchestrate.sweeps) open each trial's run as a nested child of the sweep's parent and hand it to
the trial's process in MLflow's own variables, `MLFLOW_RUN_ID` and `MLFLOW_TRACKING_URI`; the trial
logs into it instead of opening its own. And the other way: a run told to the wrapper that started
the training command (`orchestrate slurm-ray`), which ends it KILLED if the command is killed
before it can end it itself (Slurm's SIGKILL after KillWait)."""

import os
from pathlib import Path

# Set by the wrapper: the file where the training command writes its run's URI and id.
RUN_FILE_VARIABLE = "ORCHESTRATE_RUN_FILE"


def tell_wrapper(uri: str, run_id: str) -> None:
    path = os.environ.get(RUN_FILE_VARIABLE)
    if path:
        Path(path).write_text(f"{uri}\n{run_id}\n")


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
