"""Runs handed between processes. A run handed over by a sweep: the sweep callbacks
(orchestrate.sweeps) open each trial's run as a nested child of the sweep's parent and hand it to
the trial's process in MLflow's own variables, `MLFLOW_RUN_ID` and `MLFLOW_TRACKING_URI`; the trial
logs into it instead of opening its own. And the other way: a run told to the wrapper that started
the training command (`orchestrate slurm-ray`), which ends it KILLED if the command is killed
before it can end it itself (Slurm's SIGKILL after KillWait)."""

import os
from dataclasses import dataclass, field
from pathlib import Path

from orchestrate.tracking.settings import set_env

# Set by the wrapper: the file where the training command writes its run's URI and id.
RUN_FILE_VARIABLE = "ORCHESTRATE_RUN_FILE"
# The wrapper's requests when it ends a run left open: the job is ending (Slurm's KillWait).
WRAPPER_HTTP = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


@dataclass
class ParentRun:
    """A sweep's parent run, as a trial's job needs it to log its own run beside it (the sweep callbacks
    open the trial's run and hand it over); pickled with the callback to remote jobs."""

    uri: str  # the store the trials write to (the sweep's server in front of SQLite)
    experiment_id: str
    run_id: str
    command: list[str]  # the command line's overrides (_runs.fixed_overrides): a trial is named by the others
    finished: dict[str, str] = field(default_factory=dict)  # resuming: trial name -> its FINISHED child run
    attempt: int = 1  # which command on this sweep (1 the first; each one that continues it one more)


def interrupted(cause: str) -> str:
    """The `error` tag of a run ended KILLED by a signal (`cause`: its name)."""
    return f"interrupted ({cause})"


def tell_wrapper(uri: str, run_id: str) -> None:
    path = os.environ.get(RUN_FILE_VARIABLE)
    if path:
        Path(path).write_text(f"{uri}\n{run_id}\n")


def end_run_left_open(run_file: Path, cause: str) -> str | None:
    """In the wrapper, once the training command has ended after a signal: its run (named in
    `run_file`), ended KILLED as the command itself ends it, if the command left it RUNNING (it was
    killed first). Returns what to say, or None when there was nothing to do."""
    if not run_file.is_file():
        return None  # no run was opened
    uri, run_id = run_file.read_text().split()
    before = set_env(WRAPPER_HTTP)
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        if client.get_run(run_id).info.status != "RUNNING":
            return None
        client.set_tag(run_id, "error", interrupted(cause))
        client.set_terminated(run_id, "KILLED")
        return f"MLflow run {run_id} marked KILLED (the training command ended without ending it)"
    except Exception as e:  # noqa: BLE001 - the job is ending: say so, and stop Ray all the same
        return f"MLflow run {run_id} may stay RUNNING at {uri}: {type(e).__name__}: {e}"
    finally:
        set_env(before)


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
