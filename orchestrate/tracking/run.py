"""Opening the MLflow run a training run logs into, in one place:

- `which_run(cfg)` decides which run, reading the store only (the command line calls it while
  checking a config, before anything is written): the run a sweep handed this trial, the run
  `trainer.resume` continues (orchestrate.tracking.resume), or a new one;
- `Run(cfg, choice, ...)` opens the run that choice (a RunChoice) names, as a context manager: the run's tags,
  params, config and installed packages, what its last attempt kept for a server that was away,
  the runs of the same config that `trainer.resume=auto` finds orphaned, MLflow's system metrics
  when asked for; on the way out it ends the run with its outcome (FINISHED, FAILED with the
  error, KILLED).

Everything goes through MLflow's client (orchestrate.tracking.logger): no process-wide tracking URI,
experiment or active run is set, so nothing has to be put back and a notebook's own MLflow use is
left alone.
"""

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from orchestrate import errors
from orchestrate.meter import Diverged
from orchestrate.tracking.environment import installed_packages, run_tags
from orchestrate.tracking.handover import handed_over_run, interrupted, tell_wrapper
from orchestrate.tracking.logger import RunLogger
from orchestrate.tracking.models import NotRegistered
from orchestrate.tracking.outbox import UNSENT_FILE, cause, send_unsent
from orchestrate.tracking.params import flatten
from orchestrate.tracking.redact import redact, redacted_yaml
from orchestrate.tracking.resume import ResumePoint, close_orphans, find_resume
from orchestrate.tracking.settings import quick_http, set_env
from orchestrate.tracking.stores import (
    SERVER_WAIT_S,
    absolute_uri,
    mark_for_training,
    new_sqlite_store,
    training_experiment,
    wait_for,
)

log = logging.getLogger(__name__)

# What stopped an earlier attempt no longer describes a resumed run: it goes on.
STALE_TAGS = ("error", "diverged_at")
PARAMS_PER_REQUEST = 100  # MLflow's limit for one log_batch


@dataclass(frozen=True)
class RunChoice:
    """Which MLflow run a training run logs into."""

    uri: str  # the store as MLflow is given it: absolute (see stores.absolute_uri), or the sweep's
    resume: ResumePoint | None  # trainer.resume: the run and checkpoint to continue
    handed_over: str | None  # a sweep's trial: the run the sweep opened for it

    @property
    def run_id(self) -> str | None:
        """The existing run to log into; None: a new one."""
        return self.resume.run_id if self.resume else self.handed_over


def which_run(cfg: DictConfig) -> RunChoice:
    """Which run `cfg` logs into; reads the store only. Bad `trainer.resume` is a ConfigError."""
    given = handed_over_run()
    # Absolute: MLflow keeps one store per URI string for the process, and a relative SQLite
    # path is another file once the working folder changes (a notebook, a test suite).
    return RunChoice(uri=given[0] if given else absolute_uri(cfg.tracking.uri), resume=find_resume(cfg),
                handed_over=given[1] if given else None)


class Run(RunLogger):
    """The run `which_run` chose, open. An exception out of the `with` block marks it FAILED (the
    error text in its `error` tag), Ctrl-C or a stopping signal KILLED, a clean exit FINISHED."""

    def __init__(self, cfg: DictConfig, choice: RunChoice, run_name: str, tags: dict[str, str], out_dir: Path,
                 params: dict[str, str] | None = None):
        from mlflow.tracking import MlflowClient

        # MLflow's quick HTTP settings from the run's first request on; given back on the way out.
        env_before, self.outbox, self.monitor = quick_http(), None, None
        try:
            new_sqlite_store(choice.uri)  # before any client opens it: MLflow would make the tables itself
            client = MlflowClient(tracking_uri=choice.uri)
            tags = {**run_tags(out_dir), **tags, **redact(dict(cfg.tracking.tags))}
            run = self._start(client, cfg, choice, run_name, tags)
            super().__init__(choice.uri, run.info.run_id, out_dir)
            self.experiment_id = run.info.experiment_id  # the UI line opens its runs page
            tell_wrapper(choice.uri, run.info.run_id)
            self._record(cfg, choice, run, tags, params or {})
        except BaseException:
            if self.outbox is not None:
                self.end_outbox()
            set_env(env_before)
            raise
        self.env_before = env_before  # RunLogger's own found the settings made already

    @staticmethod
    def _start(client, cfg: DictConfig, choice: RunChoice, run_name: str, tags: dict[str, str]):
        """The run, RUNNING: the existing one `choice` names, or a new one in the experiment
        `tracking.experiment`. A new run's tags are written with it, not through the outbox: a
        process killed in its first seconds leaves a run that `trainer.resume=auto` can still tell
        apart (config_key) and end (host, pid)."""
        if choice.run_id is not None:
            # A sweep's trial: the sweep's server may be restarting (found gone, started again on its port).
            if choice.handed_over is not None and choice.uri.startswith("http") and (why := wait_for(choice.uri)):
                raise RuntimeError(f"the sweep's MLflow server did not come back within {SERVER_WAIT_S:g} s: {why}")
            client.update_run(choice.run_id, status="RUNNING")
            run = client.get_run(choice.run_id)
            if choice.resume is not None:
                for stale in STALE_TAGS:
                    if stale in run.data.tags:
                        client.delete_tag(choice.run_id, stale)
            return run
        from mlflow.tracking.context.registry import resolve_tags

        # The experiment made here, tagged as model training (MLflow's set_experiment would say
        # "Creating a new experiment" on the console). resolve_tags adds MLflow's own (user, source).
        experiment_id = training_experiment(client, cfg.tracking.experiment)
        return client.create_run(experiment_id, run_name=cfg.tracking.run_name or run_name, tags=resolve_tags(tags))

    def _record(self, cfg: DictConfig, choice: RunChoice, run, tags: dict[str, str], extra: dict[str, str]) -> None:
        """What the run holds before its first step: `extra` params beside the config's (the
        CPU budget: orchestrate.cpu), those a resumed run does not hold yet."""
        from mlflow.entities import Param, RunTag

        if choice.resume is not None:
            self._send_unsent(Path(run.data.tags.get("out_dir", "")) / UNSENT_FILE)
        if choice.run_id is not None:  # an existing run: its tags now, in one request
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        mark_for_training(self.client, run.info.experiment_id)
        if choice.resume is None:  # a resumed run's params are this config already (config_key matched)
            params = [Param(k, v) for k, v in {**flatten(cfg), **extra}.items()]
            for i in range(0, len(params), PARAMS_PER_REQUEST):
                self.client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_REQUEST])
        elif missing := [Param(k, v) for k, v in extra.items() if k not in run.data.params]:
            self.client.log_batch(self.run_id, params=missing)  # a param once logged stays (MLflow's rule)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(redacted_yaml(cfg))
            (Path(tmp) / "requirements-freeze.txt").write_text(installed_packages())
            self.log_artifacts(Path(tmp))
        if cfg.trainer.resume == "auto":
            for orphan in close_orphans(cfg, self.run_id):
                print(f"MLflow run {orphan} marked KILLED: its process ended without closing it", flush=True)
        if cfg.tracking.system_metrics:  # CPU, memory, disk, network; GPUs where pynvml is installed
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(self.run_id, resume_logging=choice.run_id is not None,
                                                tracking_uri=self.uri)
            self.monitor.start()

    def _send_unsent(self, path: Path) -> None:
        """What the run's earlier attempt kept while its server was away (`orchestrate sync`'s
        work), before this attempt logs: its steps then count as logged."""
        if not path.is_file():
            return
        try:
            print(f"sent {send_unsent(self.client, path)} item(s) that the run's last attempt could not ({path})",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - the file stays: `orchestrate sync` can send it later
            log.warning(f"{path} was not sent ({cause(e)}): `orchestrate sync {path.parent}` sends it later")

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        status = "FINISHED"
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"  # Ctrl-C, or SIGINT / SIGTERM (orchestrate.signals.Stopped names it)
            self.set_tags({"error": interrupted(str(exc) or exc_type.__name__)})
        elif exc_type is not None:
            status = "FAILED"
            if issubclass(exc_type, Diverged):  # its own words; trainer.resume may go on with a lower rate
                self.set_tags({"error": str(exc), "diverged_at": str(exc.step)})
            else:  # the exception's name too
                self.set_tags({"error": errors.one_line(exc)[:5000]})
            errors.mark(exc, run=self.run_id)  # the boundary's line says which run is FAILED
        try:
            if self.monitor is not None:
                self.monitor.finish()  # its last points, before the run ends
            self.end_outbox()  # bounded: a server still away gets END_WAIT_S, then the file
            if status == "FINISHED" and self.outbox.not_registered:  # trained and logged, the registry said no
                status, failed = "FAILED", NotRegistered(self.outbox.not_registered[0])
                self.client.set_tag(self.run_id, "error", errors.one_line(failed)[:5000])
                errors.mark(failed, run=self.run_id)
                raise failed
        finally:
            ended = int(time.time() * 1000)
            try:
                self.client.set_terminated(self.run_id, status, ended)
            except Exception as e:  # noqa: BLE001 - the run's own outcome matters more than its status
                self.outbox.keep_end(status, ended)
                log.warning(f"MLflow at {self.outbox.uri} did not take the run's end ({status}: {cause(e)}): "
                            f"run {self.run_id} stays RUNNING there until `orchestrate sync "
                            f"{self.outbox.unsent_file.parent}` ends it")
            finally:
                set_env(self.env_before)
        return False
