"""The Ray launcher's work: validate every trial, open (or find) the sweep's parent run, run the
trials as Ray tasks, and print and log the summary. Imported lazily by the Hydra plugin."""

import contextlib
import io
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from omegaconf import OmegaConf, open_dict

from orchestrate import ray_cluster, schema
from orchestrate.tracking import ONE_LOGGING_THREAD, ui_command
from orchestrate.launch.sweep_runs import (TRIAL_KEY, ParentRun, TrackingServer, Trial, child_metrics, sweep_key,
                                           trial_name)

log = logging.getLogger(__name__)
OPEN_SWEEP = None  # the sweep this process is running, closed by close_open_sweep()


def _run_trial(hydra_context, task_function, sweep_config, singleton_state) -> JobReturn:
    """Runs in a Ray worker: restore Hydra's global state, then run the job in its own folder."""
    started_at = time.time()
    os.environ.update(ONE_LOGGING_THREAD)
    setup_globals()
    Singleton.set_state(singleton_state)
    HydraConfig.instance().set_config(sweep_config)
    began = time.perf_counter()
    ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    ret.wall_time_s, ret.started_at = time.perf_counter() - began, started_at
    if ret.status == JobStatus.FAILED:
        # Exceptions travel back as text: the trial's error, not a pickling problem of its type.
        ret.error = f"{type(ret._return_value).__name__}: {ret._return_value}"
        ret._return_value = RuntimeError(ret.error)
    return ret


class Sweep:
    """State kept across the launcher's calls (Optuna launches one batch at a time)."""

    def __init__(self, launcher):
        cfg, conf = launcher.config, launcher.conf
        self.conf = conf
        self.metric = cfg.sweep.metric
        self.command = list(cfg.hydra.overrides.task)
        self.trials: list[Trial] = []
        self.began = time.time()
        self.first_trial_started: float | None = None
        self.server = None
        uri = cfg.tracking.uri
        self.direct_uri = uri
        self.experiment = cfg.tracking.experiment
        if uri.startswith("sqlite:") and conf.tracking_server and not conf.dry_run:
            # Create the store and experiment once, directly, so that artifacts land in ./mlruns as
            # for single runs; then every trial writes through one local server.
            ParentRun.ensure_experiment(uri, cfg.tracking.experiment)
            began = time.perf_counter()
            self.server = TrackingServer(uri, Path("mlartifacts").resolve())
            log.info(f"MLflow server for the sweep on {self.server.uri} (started in {time.perf_counter() - began:.1f} s)")
            uri = self.server.uri
        self.uri = uri
        sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=False)
        definition = {"name": cfg.sweep.name, "command": self.command, "sweeper": sweeper,
                      "params": {**(sweeper.get("params") or {}), "metric": self.metric}}
        self.parent = None if conf.dry_run else ParentRun(uri, cfg.tracking.experiment,
                                                          sweep_key(self.command, sweeper), conf.resume, definition)

    def close(self) -> str:
        try:
            return self.parent.close(self.trials, self.metric) if self.parent else ""
        finally:
            if self.server:
                self.server.stop()


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
    cfg, conf = launcher.config, launcher.conf
    setup_globals()
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    loader = launcher.hydra_context.config_loader

    # 1. Compose and check every trial before anything runs: bad input stops the whole sweep.
    configs = []
    for i, overrides in enumerate(job_overrides):
        idx = initial_job_idx + i
        sweep_config = loader.load_sweep_config(cfg, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
            sweep_config.hydra.job.num = idx
        try:
            from orchestrate.job import Job

            with contextlib.redirect_stderr(io.StringIO()):
                Job.prepare(sweep_config, out_dir="unused")
        except schema.ConfigError as e:
            print(f"error: trial {idx} ({' '.join(overrides)}): {e}", file=sys.stderr)
            raise SystemExit(2) from None
        configs.append((idx, list(overrides), sweep_config))
    Path(str(cfg.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)

    if conf.dry_run:
        print_plan(configs, conf, launcher)
        return [dry_return(c) for _, _, c in configs]

    global OPEN_SWEEP
    if launcher.sweep is None:
        launcher.sweep = OPEN_SWEEP = Sweep(launcher)
    sweep = launcher.sweep
    done = sweep.parent.finished_trials() if conf.resume else {}

    # 2. Start (or join) Ray, then submit every trial that has not finished before.
    began = time.perf_counter()
    started = ray_cluster.init(conf.address, "hydra.launcher.address", num_cpus=conf.num_cpus)
    import ray  # after ray_cluster.init: the loopback setting is read when ray is imported

    if started:
        log.info(f"Ray ready in {time.perf_counter() - began:.1f} s: {ray.cluster_resources()}")
    remote = ray.remote(_run_trial).options(num_cpus=conf.cpus_per_trial, num_gpus=conf.gpus_per_trial,
                                            max_retries=0)
    singleton_state = Singleton.get_state()
    returns: dict[int, JobReturn] = {}
    pending = {}
    for idx, overrides, sweep_config in configs:
        trial = Trial(idx, overrides, trial_name(overrides, sweep.command))
        sweep.trials.append(trial)
        if trial.name in done:
            run = done[trial.name]
            trial.status, trial.run_id = "SKIPPED", run.info.run_id
            trial.metrics = child_metrics(sweep.parent.client, run)
            returns[idx] = finished_return(sweep_config, overrides, trial.metrics.get(f"final/{sweep.metric}"))
            log.info(f"trial {idx} ({trial.name}) finished in an earlier attempt: skipped")
            continue
        with open_dict(sweep_config):
            sweep_config.tracking.uri = sweep.uri
            sweep_config.tracking.parent_run_id = sweep.parent.run_id
            sweep_config.tracking.run_name = trial.name
            sweep_config.tracking.tags[TRIAL_KEY] = trial.name
        ref = remote.remote(launcher.hydra_context, launcher.task_function, sweep_config, singleton_state)
        pending[ref] = trial

    # 3. Collect results as they come; with fail_fast, cancel the rest at the first failure.
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        trial = pending.pop(ready[0])
        try:
            ret = ray.get(ready[0])
        except Exception as e:  # the worker died: Ray's own error
            ret = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError(str(e).splitlines()[0]))
            ret.error, ret.wall_time_s = str(e).splitlines()[0], 0.0
        trial.wall_time_s = getattr(ret, "wall_time_s", 0.0)
        if hasattr(ret, "started_at"):
            first = ret.started_at - sweep.began
            sweep.first_trial_started = min(first, sweep.first_trial_started or first)
        finished = sweep.parent.client.search_runs(
            [sweep.parent.experiment_id],
            f"tags.`mlflow.parentRunId` = '{sweep.parent.run_id}' and tags.`{TRIAL_KEY}` = '{trial.name}'",
            order_by=["attributes.start_time DESC"], max_results=1)
        if finished:
            trial.run_id = finished[0].info.run_id
            trial.metrics = child_metrics(sweep.parent.client, finished[0])
        if ret.status == JobStatus.FAILED:
            trial.status, trial.error = "FAILED", getattr(ret, "error", "failed")
            log.error(f"trial {trial.index} ({trial.name}) failed: {trial.error}")
            if conf.fail_fast:
                for ref, other in pending.items():
                    ray.cancel(ref, force=True)
                    other.status, other.error = "CANCELLED", "sweep stopped at the first failure (fail_fast)"
                pending.clear()
        else:
            trial.status = "FINISHED"
        returns[trial.index] = ret
    results = []
    for idx, overrides, sweep_config in configs:
        ret = returns.get(idx)
        if ret is None:  # cancelled by fail_fast
            ret = JobReturn(overrides=overrides, cfg=sweep_config, status=JobStatus.FAILED,
                            _return_value=RuntimeError("cancelled: the sweep stopped at the first failure"))
        results.append(ret)
    return results


def finished_return(sweep_config, overrides, value) -> JobReturn:
    return JobReturn(overrides=overrides, cfg=sweep_config, hydra_cfg=None, status=JobStatus.COMPLETED,
                     _return_value=value)


def dry_return(sweep_config) -> JobReturn:
    return JobReturn(overrides=list(sweep_config.hydra.overrides.task), cfg=sweep_config,
                     status=JobStatus.COMPLETED, _return_value=0.0)


def print_plan(configs, conf, launcher) -> None:
    command = list(launcher.config.hydra.overrides.task)
    where = conf.address or f"a local Ray instance ({conf.num_cpus or 'all'} CPUs)"
    print(f"plan: {len(configs)} trial(s) on {where}, each asking for {conf.cpus_per_trial} CPU and "
          f"{conf.gpus_per_trial} GPU; nothing is run (dry run)")
    for idx, overrides, c in configs:
        print(f"  trial {idx}: {trial_name(overrides, command)}  [backend={c.backend.name}, "
              f"steps={c.trainer.max_steps}, batch={c.trainer.batch_size}]")


def close_open_sweep() -> None:
    """Called once the sweeper is done (or has raised): summary printed, parent run closed,
    the sweep's MLflow server stopped."""
    global OPEN_SWEEP
    if OPEN_SWEEP is None:
        return
    sweep, OPEN_SWEEP = OPEN_SWEEP, None
    table = sweep.close()
    wall = time.time() - sweep.began
    ran = [t for t in sweep.trials if t.status in ("FINISHED", "FAILED")]
    timing = (f"{len(ran)} trial(s) ran in {wall:.1f} s of wall time, {sum(t.wall_time_s for t in ran):.1f} s "
              f"summed over trials; the first started {sweep.first_trial_started or 0:.1f} s after the sweep began")
    print(f"\nsweep summary (MLflow parent run {sweep.parent.run_id}, experiment "
          f"'{sweep.experiment}'):\n{table}\n{timing}\nopen the UI with   {ui_command(sweep.direct_uri)}", flush=True)
