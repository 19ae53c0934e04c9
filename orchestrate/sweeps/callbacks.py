"""orchestrate's MLflow bookkeeping of a sweep as a Hydra callback, so that it works with any
launcher (orchestrate's Ray launcher, Hydra's basic launcher, submitit, ...). conf/config.yaml turns
it on under `hydra.callbacks.sweep_tracking`; a single run is not touched by it.

Where each hook runs (hydra/_internal/hydra.py `multirun()`, hydra/core/utils.py `run_job()`):
- `on_multirun_start`, in the launching process before the sweeper starts: start the MLflow server
  in front of a SQLite store, open the parent run (or find it again by the sweep's key), and keep
  what every job needs in `self.parent`.
- `on_job_start` / `on_job_end`, where the job runs: in the launching process (basic launcher), a
  Ray worker (orchestrate's launcher) or a subprocess (submitit). Launchers hand `run_job` the
  HydraContext that holds this object, pickled for a remote job, so `self.parent` travels with it.
  The job's child run reaches the app through MLflow's own variables `MLFLOW_RUN_ID` and
  `MLFLOW_TRACKING_URI` (see orchestrate.tracking.handover), set for the job and taken back after it.
- `on_multirun_end`, in the launching process: the summary, the parent closed, the server stopped.
  Hydra skips it when the sweeper raises (a failed trial makes Hydra's sweepers raise), so each
  open sweep is also in `_OPEN`, which `close_open_sweeps()` (called by orchestrate/cli.py in
  a `finally`, and at exit) closes; closing twice does nothing.

This module stays light (Hydra instantiates it for every run, single runs included); the MLflow
work is in `_runs`, `_summary` and `_server`, imported when a sweep needs them.
"""

import atexit
from dataclasses import dataclass
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from orchestrate.errors import Escaped, Failed, Refused
from orchestrate.schema import objectives
from orchestrate.thirdparty import job_error
from orchestrate.tracking.handover import ParentRun
from orchestrate.tracking.settings import NO_RUN_LINKS, ONE_LOGGING_THREAD, set_env

# Module state: sweeps opened by this process and not closed yet (Hydra calls on_multirun_end only
# when the sweeper returns); cli.main closes those still open (`close_open_sweeps`), which empties it.
_OPEN: list["SweepTracking"] = []


@dataclass
class _Job:
    """The job running in this process: its run, and what the environment held before it."""

    run_id: str
    env: dict[str, str | None]


class SweepTracking(Callback):
    def __init__(self, tracking_uri: str, experiment: str, metric: Any = "eval_loss", name: str = "none",
                 resume: bool = True, tracking_server: bool = True, tie_tolerance: float = 1e-3,
                 direction: Any = "minimize", compare: Any = None, register_model: str | None = None) -> None:
        self.tracking_uri = tracking_uri  # the real store (tracking.uri); trials may write through a server
        self.experiment = experiment
        # sweep.metric and the sweeper's direction (or sweep.direction), as (metric, better low)
        # pairs: the first ranks the trials; several: the summary gives their Pareto front.
        self.objectives = objectives(metric, direction, "hydra.sweeper.direction")
        self.metric, self.lower = self.objectives[0]
        # A comparison's settings (orchestrate.schema.CompareConf): used when the sweep varies compare.repeat.
        self.compare = OmegaConf.to_container(compare, resolve=True) if isinstance(compare, DictConfig) else compare
        self.register_model = register_model  # tracking.register_model: the front's versions get an alias per objective
        self.name = name  # sweep.name: names the parent run
        self.resume = resume  # the same sweep again: same parent run, its FINISHED trials skipped
        self.tracking_server = tracking_server  # SQLite store: one local `mlflow server` takes every trial's writes
        self.tie_tolerance = tie_tolerance  # best values closer than this (relative) are a tie
        self.parent: ParentRun | None = None  # None: no sweep is tracked (a single run, a dry run)
        self._job: _Job | None = None
        self._sweep = None  # _runs.Sweep: the server process and clients stay in the launching process

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sweep": None, "_job": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if OmegaConf.select(config, "hydra.launcher.dry_run", default=False):
            return  # the launcher prints its plan and runs nothing: no store, no run
        from orchestrate.sweeps import _runs

        try:
            self._sweep = _runs.Sweep(self, config)
        except Refused as e:  # the same sweep run by another command now: one line, nothing opened
            raise Escaped(e) from e
        except Exception as e:
            # Hydra would only warn and run every trial untracked, each a top-level run: stop here.
            failed = Failed(f"the sweep's MLflow tracking could not start: {type(e).__name__}: {e}")
            failed.__cause__ = e  # its traceback kept (orchestrate.boundary)
            raise Escaped(failed) from e
        _OPEN.append(self)
        self.parent = self._sweep.parent()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.parent is None:
            return
        from orchestrate.sweeps import _runs

        run_id = _runs.open_trial(self.parent, config)
        # ONE_LOGGING_THREAD: many trials' logging threads against one server stay within its pool.
        # MLFLOW_TRACKING_URI is the sweep's server for the trial's MLflow client; its config's
        # tracking.uri (by default read from MLFLOW_TRACKING_URI) stays the store the sweep was given.
        before = set_env({"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": self.parent.uri,
                          "ORCHESTRATE_TRACKING_URI": self.tracking_uri, **ONE_LOGGING_THREAD,
                          **NO_RUN_LINKS})
        self._job = _Job(run_id, before)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        job = self._job
        if job is None:
            if self._sweep is not None and job_return.status == JobStatus.FAILED:
                # In the launching process: a job whose process died (its host lost) before its own
                # on_job_end could close its run, as orchestrate's Ray launcher reports it.
                self._sweep.lost(config.hydra.job.num, job_error(job_return))
            return
        try:
            from orchestrate.sweeps import _runs

            failed = job_error(job_return) if job_return.status == JobStatus.FAILED else None
            _runs.close_trial(self.parent.uri, job.run_id, failed)
        finally:
            self._restore()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Summary, parent closed, server stopped; a second call does nothing."""
        if self in _OPEN:
            _OPEN.remove(self)
        self._restore()  # a job cut short (Ctrl-C in an in-process job) did not reach on_job_end
        sweep, self._sweep = self._sweep, None
        if sweep is not None:
            sweep.close()

    def _restore(self) -> None:
        """The environment exactly as before the job: the same process (the launching process,
        a Ray worker) runs the next trial, or goes on after the sweep."""
        job, self._job = self._job, None
        if job is None:
            return
        set_env(job.env)  # MLflow's process-wide URI, which the app sets, it restores itself (orchestrate.process)


def close_open_sweeps() -> None:
    """Close every sweep this process opened and has not closed (the sweeper raised, or Ctrl-C)."""
    for sweep in list(_OPEN):
        sweep.close()


atexit.register(close_open_sweeps)  # a sweep run without orchestrate's entry point: its server stops too
