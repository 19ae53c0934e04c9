"""One training run, in order: validate, seed, start tracking, fit, summarise.

    python -m orchestrate                                   # defaults: conf/config.yaml
    python -m orchestrate backend=ondevice trainer.max_steps=500
    python -m orchestrate model=char_transformer data=python_source
"""

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from orchestrate import checkpoints, errors, process, schema, signals
from orchestrate.boundary import RUN, Where, boundary
from orchestrate.cluster.runtime import COLD, Runtime
from orchestrate.cpu import Budget
from orchestrate.job import Checked, Job
from orchestrate.meter import reset_peak_rss, world_sizes
from orchestrate.sweeps import pruning
from orchestrate.tracking import plots
from orchestrate.tracking.handover import finished_run_metrics
from orchestrate.tracking.params import config_key
from orchestrate.tracking.redact import redact_text
from orchestrate.tracking.run import Run, which_run
from orchestrate.tracking.stores import open_ui, unreachable, unusable_experiment


@dataclass
class Result:
    run_id: str
    experiment_id: str
    metrics: dict[str, float]
    out_dir: Path
    history: dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], as logged


def device_name(cfg: DictConfig) -> str:
    import platform

    import torch

    if cfg.trainer.device.value == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()})"


def start_early(cfg: DictConfig, runtime: Runtime = COLD) -> contextlib.AbstractContextManager:
    """The backend's early start (`Backend.start_early`: the runner's Ray) around the check of a
    run's config; a config whose backend does not build gets none (the check says why)."""
    try:
        backend = schema.target_of(cfg.backend, "backend")
    except Exception:
        return contextlib.nullcontext()
    return backend.start_early(cfg, runtime)


def unavailable(cfg: DictConfig) -> str | None:
    """Why this environment cannot train `cfg`'s backend (a package it lacks: `Backend.unavailable`),
    or None; a backend config that does not build is left to the check, which says why."""
    try:
        backend = schema.build(cfg.backend, "backend")
    except schema.ConfigError:
        return None
    return backend.unavailable()


@dataclass
class CheckCache:
    """What the checks of many configs (a sweep's trials) share."""

    stores: dict[str, str | None] = field(default_factory=dict)  # tracking URI -> `unreachable`'s answer
    experiments: dict[tuple[str, str], str | None] = field(default_factory=dict)  # `unusable_experiment`'s answers
    models: dict[str, Any] = field(default_factory=dict)  # built and run on their data (Job.prepare's `models`)
    built: dict[Any, Any] = field(default_factory=dict)  # what backends' checks built, by their key (Job.built)


def check(cfg: DictConfig, cache: CheckCache | None = None, runtime: Runtime = COLD) -> Checked:
    """The one way in: take a composed config to a checked, built job and the MLflow run it logs
    into (`Checked`), or one schema.ConfigError, before anything is written or run: the tracking
    store answers, the job builds (data, model, backend: Job.prepare, every setting against its
    declared range), `trainer.resume` resolves (which only reads the store). The command line
    checks a run with it, and the run takes what it returns over (`train`'s `checked`); every
    trial of a sweep is checked with it too. Checks of many configs share `cache`: each tracking
    URI is asked once, and a model is built and run once per distinct model, data and seed.
    `runtime`: how the command started (the entry's), which the backends' checks read."""
    shared = cache is not None
    cache = cache or CheckCache()
    uri = cfg.tracking.uri
    if uri not in cache.stores:  # first: a store that is not there fails in seconds, not minutes
        cache.stores[uri] = unreachable(uri)
    if cache.stores[uri]:
        raise schema.ConfigError(cache.stores[uri])
    job = Job.prepare(cfg, models=cache.models if shared else None, built=cache.built if shared else None,
                      runtime=runtime)
    experiment = (uri, cfg.tracking.experiment)
    if experiment not in cache.experiments:  # MLflow would refuse the run only once it opens
        # A sweep's trials (checked together, or run with the sweep's server as MLflow's URI) write through its server.
        direct = not shared and not os.environ.get("MLFLOW_TRACKING_URI", "").startswith(("http:", "https:"))
        cache.experiments[experiment] = unusable_experiment(*experiment, direct=direct)
    if cache.experiments.get(experiment):
        raise schema.ConfigError(cache.experiments[experiment])
    return Checked(OmegaConf.to_yaml(cfg), job, run=which_run(cfg))


def train(cfg: DictConfig, out_dir: Path, checked: Checked | None = None, runtime: Runtime = COLD) -> Result:
    """Train once as `cfg` says; the MLflow run holds everything the run produced. `checked`: the
    check of this config (`check`), whose job and run choice the run takes over instead of building
    and choosing them again (None, or another config's: built here). `runtime`: how the command
    started (orchestrate.cluster.runtime: the Ray head to join, the start line). The process is
    left as it was found (thread counts, environment: orchestrate.process)."""
    # ConfigError here: nothing has been written anywhere yet.
    reset_peak_rss()  # the run's own memory peak, in a process that ran others before it
    job = checked.take(cfg, out_dir) if checked is not None else None
    run_choice = checked.run if job is not None else None
    job = job or Job.prepare(cfg, out_dir, runtime=runtime)  # a checked job has it from its check
    job.meter.trial = pruning.of_this_job(cfg)  # a pruning sweep's trial: may stop before max_steps
    choices = f"{job.backend.name}-{Path(cfg.model._target_).suffix[1:]}-{Path(cfg.data._target_).suffix[1:]}"
    tags = {"backend": job.backend.name, "device": device_name(cfg), "model": cfg.model._target_,
            "data": cfg.data._target_, "config_key": config_key(cfg)}
    # e.g. a Ray cluster with room for the runner's workers; ConfigError before any run opens if not.
    # SIGTERM stops the run as Ctrl-C does: the MLflow run ends KILLED, Ray is shut down.
    with process.kept(), signals.stop_on_signals(), job.backend.connect(job):
        # Which MLflow run: a sweep's trial's, the one trainer.resume continues, or a new one.
        run_choice = run_choice or which_run(cfg)
        if run_choice.resume is not None:  # its checkpoint loads before the run reopens: a bad one changes nothing
            resume = run_choice.resume
            job.resume_state = checkpoints.load_checked(job.backend, job.model,
                                                        resume.fetch(job.out_dir / "checkpoints"))
            print(f"resuming MLflow run {resume.run_id} after step {resume.step}", flush=True)
            if resume.changed:  # a diverged run goes on with a lower learning rate: its params keep the old
                tags[f"resumed_at_{resume.step}"] = ", ".join(f"{k}={now} (was {was})"
                                                              for k, (was, now) in resume.changed.items())
        elif cfg.trainer.resume == "auto":
            print("trainer.resume=auto: no unfinished run with this config has a checkpoint; starting a new run",
                  flush=True)
        budget = job.backend.budget(job)  # the CPU budget it trains with (the runner's: one worker's)
        with Run(cfg, run_choice, run_name=choices.lower(), tags=tags, out_dir=job.out_dir,
                 params=budget.params) as tracker:
            job.track(tracker)
            tracker.log_datasets(job.data, Path(cfg.data._target_).suffix[1:])  # the Dataset column
            if run_choice.resume is not None:
                job.meter.continue_history(tracker.logged_history())
            try:
                job.backend.fit(job)
            except Exception as e:  # the step it failed at: in the error's line and the run's `error` tag
                errors.mark(e, step=job.meter.step)
                raise
            finally:
                job.close_data()
                if job.meter.trial is not None:
                    job.meter.trial.close()
            job.meter.close()
            metrics = job.meter.summary()
            pruned_at = metrics.get("pruned_at")  # the runner's meter has it from rank 0's summary
            if pruned_at is not None:  # FINISHED, early: the sweep's pruner stopped it there
                tracker.set_tags({"pruned": str(int(pruned_at))})
            last = int(pruned_at or cfg.trainer.max_steps)
            tracker.log_metrics({f"final/{k}": v for k, v in metrics.items()}, step=last)
            png = plots.loss_curves({job.backend.name: job.meter.history}, job.out_dir / "loss_curves.png",
                                    title=choices)
            tracker.log_artifact(png)
    result = Result(run_id=tracker.run_id, experiment_id=tracker.experiment_id, metrics=metrics,
                    out_dir=job.out_dir, history=job.meter.history)
    print_summary(cfg, job, result, in_sweep=run_choice.handed_over is not None,
                  budget=job.cpu or budget)  # the loop's (auto: the chosen one's); the runner's driver: a worker's
    return result


def print_summary(cfg: DictConfig, job: Job, result: Result, in_sweep: bool, budget: Budget | None = None) -> None:
    m = result.metrics
    total, ran, seconds = cfg.trainer.max_steps, int(m.get("steps_run", cfg.trainer.max_steps)), m.get("wall_time_s", 0)
    if "pruned_at" in m:
        head = f"stopped by the sweep's pruner at step {m['pruned_at']:.0f} of {total}, in {seconds:.1f} s"
    elif ran < total:  # a resumed run: the steps before it ran in an earlier process
        head = f"steps {total - ran + 1} to {total} ({ran:,} in this process, resumed) in {seconds:.1f} s"
    else:
        head = f"{total} steps in {seconds:.1f} s"
    lines = [f"backend {job.backend.name}: {head}"]
    t = job.trainer  # the precision it trained in; on CUDA in fp32, whether matrix products used TF32
    tf32 = f" (TF32 matrix products: trainer.tf32={str(t.tf32).lower()})" if t.device.value == "cuda" \
        and t.precision.value == "fp32" else ""
    lines.append(f"  {'precision':<18} {t.precision.value}{tf32}")
    if budget is not None:  # threads + loader processes of the cores (orchestrate.cpu.Budget)
        lines.append(f"  {'CPU budget':<18} {budget}{' per worker' if job.backend.distributed else ''}")
    sizes = world_sizes(job.meter.history)
    if len(sizes) > 1:  # an elastic run (trainer.min_workers) that grew or shrank: its resized_at_* tags say where
        lines.append(f"  {'workers':<18} {' -> '.join(map(str, sizes))} (of {t.min_workers} to {t.num_workers})")
    for key, label in [("train_loss", "final train loss"), ("eval_loss", "eval loss"),
                       ("eval_accuracy", "eval accuracy"), ("samples_per_sec", "samples/s"),
                       ("step_time_ms", "step time (ms)")]:
        if key in m:
            lines.append(f"  {label:<18} {m[key]:,.4f}" if m[key] < 100 else f"  {label:<18} {m[key]:,.0f}")
    if "compile_s" in m:  # backend=compile: its first step compiled, and the step time leaves that window out
        lines.append(f"  {'compile (s)':<18} {m['compile_s']:.1f} (the first step; not in the step time above)")
    lines += [f"  MLflow run         {result.run_id} (experiment '{cfg.tracking.experiment}' in "
              f"{redact_text(cfg.tracking.uri)})",
              f"  outputs            {result.out_dir}"]
    # Hydra's job log (hydra.job_logging's file handler): all of the run's logging, ORT's output that
    # the console left out (backend.log_level) included. Only for the Hydra job this run is.
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is not None and Path(hydra_cfg.runtime.output_dir).resolve() == result.out_dir.resolve():
        log = job_log(hydra_cfg)
        if log and Path(log).is_file():
            lines.append(f"  full log           {log}")
    if job.backend.distributed:  # the runner's workers log beside it (those on this node)
        from orchestrate.backends.runner.worker import WORKER_LOG

        if any(result.out_dir.glob(WORKER_LOG.format(rank="*"))):
            lines.append(f"  workers' logs      {result.out_dir / WORKER_LOG.format(rank='*')}")
    if not in_sweep:  # a sweep's trial: the sweep's summary says where to look (and how it started)
        lines.append(f"  {'start':<18} {job.runtime.start_line(job.ray, None)}")
        lines += [f"  {line}" for line in open_ui(cfg.tracking.uri, result.experiment_id).splitlines()]
    print("\n".join(lines), flush=True)


def job_log(hydra_cfg) -> str | None:
    """The file of Hydra's job log (hydra.job_logging's file handler), if it has one."""
    handler = (hydra_cfg.job_logging or {}).get("handlers", {}).get("file") or {}
    return handler.get("filename")


def resumable(cfg: DictConfig) -> bool:
    """Whether the run's backend continues from a checkpoint (what a diverged run is told to do)."""
    try:
        return bool(getattr(schema.target_of(cfg.backend, "backend"), "resumable", False))
    except Exception:  # noqa: BLE001 - a backend that does not build: the check said why
        return False


def hydra_app(checked: Checked | None = None, runtime: Runtime = COLD) -> Callable[[], None]:
    """The Hydra app `python -m orchestrate` runs (orchestrate.cli): each of its jobs is `hydra_job`.
    `checked`: the single run's config as its command checked it, which the run takes over; None
    for a sweep, whose trials (shipped to Ray workers and Slurm jobs as this function) check their
    own. `runtime`: how the command started (its entry's choice)."""

    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    def task(cfg: DictConfig) -> float | list[float | None] | None:
        return hydra_job(cfg, checked, runtime)

    return task


def hydra_job(cfg: DictConfig, checked: Checked | None = None,
              runtime: Runtime = COLD) -> float | list[float | None] | None:
    """One Hydra job: a single run, or one trial of a sweep (which returns `sweep.metric` to the sweeper)."""
    hydra_cfg = HydraConfig.get()
    earlier = finished_run_metrics()
    if earlier is not None:  # a resumed sweep hands a finished trial its old run: nothing to train
        print(f"trial {hydra_cfg.job.num} ({','.join(hydra_cfg.overrides.task)}) finished in an earlier attempt: "
              "skipped", flush=True)
        return sweep_value(cfg, {k.removeprefix("final/"): v for k, v in earlier.items()})
    # A single run's failure: one line and its exit code (orchestrate.boundary). A sweep's trial
    # raises on, for its sweeper and launcher to record.
    where = Where(RUN, out_dir=Path(hydra_cfg.runtime.output_dir), log_file=job_log(hydra_cfg),
                  resumable=resumable(cfg))
    with boundary(where) if hydra_cfg.mode == RunMode.RUN else contextlib.nullcontext():
        result = train(cfg, Path(hydra_cfg.runtime.output_dir), checked, runtime)
    return sweep_value(cfg, result.metrics)


def sweep_value(cfg: DictConfig, metrics: dict[str, float]) -> float | list[float | None] | None:
    """What a trial returns to its sweeper: the final value of sweep.metric, or of each of its
    metrics (a sweep over several objectives) as a list."""
    values = [metrics.get(m) for m in schema.listed(cfg.sweep.metric)]
    return values if len(values) > 1 else values[0]
