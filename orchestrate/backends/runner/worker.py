"""What each of the runner's workers runs (Ray Train's per-worker function): set up this rank,
run the engine's own loop (the engine is a backend built from its conf/backend file, the same
object `backend=<engine>` trains with in one process), then report the summary to the driver.

The same seed builds the same initial weights on every rank, each rank reads its own shard of
every global batch, and rank 0 evaluates, checkpoints and logs to the MLflow run that the driver
opened.
"""

import contextlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orchestrate.backends.runner.collective import Workers
from orchestrate.backends.runner.pipeline import Stages
from orchestrate.backends.runner.relay import RELAY_STAGING, RelayedLogger
from orchestrate.backends.runner.report import CHECKPOINT_FILE, Reporter
from orchestrate.meter import Diverged
from orchestrate.thirdparty import quiet_ray_train_reports

SUMMARY_FILE = "summary.json"  # rank 0's history and final metrics, in its last report
WORKER_LOG = "worker_{rank}.log"  # each worker's logging, in the run's output folder (as Hydra's job log)


@dataclass(frozen=True)
class WorkerTask:
    """What the driver hands every worker (driver.py -> `worker_loop`, as Ray Train's
    `train_loop_config={"task": ...}`): the contract between them."""

    cfg: dict  # the run's config, resolved; backend.engine: the engine the workers run (auto: the chosen one)
    engine: dict  # that engine's backend config
    out_dir: str  # the run's output folder, on the driver's node
    run_id: str | None  # the MLflow run rank 0 logs into (None: not tracked)
    in_driver: bool  # one worker, in the driver's own process (Ray Train's local mode)
    # trainer.resume's checkpoint state: through Ray's object store to workers of their own (a
    # worker on another node cannot read the driver's disk), as it is in the driver; or None.
    resume: Any
    uri: str | None  # the tracking store, absolute: the worker in the driver logs into it itself
    relay: Any  # the actor on the driver's node that logs rank 0's records into the run (relay.py)
    trial: Any  # a pruning sweep's trial: every rank stops where rank 0's pruner says (Meter.stop_early)

    @property
    def folder(self) -> Path:
        return Path(self.out_dir)


def worker_loop(config: dict) -> dict | None:
    import ray.train

    task: WorkerTask = config["task"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    if task.in_driver:
        # One worker in the driver's process (Ray Train's local mode): no worker group, so no
        # process group either; a one-rank one makes the same collectives (DDP's, the meter's)
        # run as they do across workers. Its log is the driver's (Hydra's app.log); Ray Train's
        # lines are kept off its console by the driver (driver.quiet_local_mode).
        with _one_rank_group():
            return _loop(task, rank, world)
    quiet_ray_train_reports()  # not a console line per report
    log_to_file(task.folder / WORKER_LOG.format(rank=rank))
    return _loop(task, rank, world)


@contextlib.contextmanager
def _one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loop(task: WorkerTask, rank: int, world: int) -> dict | None:
    """This rank's part of the run: (1) its job, built; (2) what it reports and logs, attached;
    (3) the engine's own loop; (4) the summary, to the driver."""
    job, engine = rank_job(task, rank, world)
    reporter = attach(job, task, rank, world)
    diverged = fit(job, engine, reporter, task.in_driver)
    return finish(job, reporter, diverged, rank, task.in_driver)


def rank_job(task: WorkerTask, rank: int, world: int):
    """(1) The job for this rank and the engine it trains with: built once (the same seed: the
    same initial weights on every rank), with the engine the driver chose and sized; nothing is
    checked again (the driver checked the config)."""
    import ray.train
    from omegaconf import OmegaConf

    from orchestrate import schema
    from orchestrate.job import Job
    from orchestrate.tracking.settings import ONE_LOGGING_THREAD

    cfg = OmegaConf.merge(OmegaConf.structured(schema.Config), task.cfg)
    os.environ.update(ONE_LOGGING_THREAD)
    if rank != 0:
        cfg.trainer.progress = False
    device = ray.train.torch.get_device() if cfg.backend.use_gpu else torch.device("cpu")
    # The worker's CPUs (backend.cpus_per_worker) are its CPU budget's cores: the engine's loop
    # sizes its threads and loader from them (orchestrate.cpu), in the driver's process too.
    t = cfg.trainer
    if t.pipeline_parallel_size > 1:  # one stage of the model on each worker (pipeline.py)
        split = list(t.pipeline_split) if t.pipeline_split is not None else None
        parallel = Stages(rank, world, device, t.pipeline_parallel_size, t.pipeline_schedule, split,
                          cfg.backend.check_replicas, cores=cfg.backend.cpus_per_worker)
    else:
        parallel = Workers(rank, world, device, cfg.backend.average_every, cfg.backend.check_replicas,
                           cores=cfg.backend.cpus_per_worker)
    job = Job.build(cfg, task.folder, parallel=parallel)
    engine = schema.build(OmegaConf.create(task.engine), "backend.engine")
    job.meter.name = f"{cfg.backend.name}/{engine.name}"
    if engine.resumable:
        job.resume_state = resume_state(task, engine)
        if rank == 0:
            say_restarted(job, world)
    job.meter.trial = task.trial
    return job, engine


def attach(job, task: WorkerTask, rank: int, world: int) -> Reporter:
    """(2) Ray Train's reports at each display step (and each checkpoint, for an engine that
    resumes), an elastic run's drain notice, and rank 0's logging into the run: in the driver's
    process its own logger, on a worker (whichever host) the relay on the driver's node."""
    from orchestrate.tracking.logger import RunLogger

    reporter = Reporter(job.parallel)
    draining = DrainNotice(job) if job.trainer.elastic else None

    def on_display(step: int, metrics: dict[str, float]) -> None:
        if rank == 0:  # the worker count over steps: an elastic run's resizes show on its chart
            job.meter.log({"world_size": world}, step)
        if draining is not None:
            draining.check(step)
        reporter.metrics(step, metrics)

    job.meter.on_display = on_display
    if rank == 0 and task.run_id:
        job.track(RunLogger(task.uri, task.run_id, out_dir=task.folder) if task.in_driver
                  else RelayedLogger(task.relay, task.run_id, task.folder / RELAY_STAGING))
        # The driver logged the data as the run's inputs; the model's metrics name the eval split.
        job.meter.tracker.log_datasets(job.data, Path(job.cfg.data._target_).suffix[1:], record=False)
        # After a restart (or trainer.resume) the run already holds steps: carry them on, log none twice.
        job.meter.continue_history(job.meter.tracker.logged_history())
        tag_resize(job, world)
    tag_workers(job, rank, world)
    if rank == 0:
        job.meter.log({"world_size": world, "effective_batch_size": job.meter.samples_per_step}, step=0)
    return reporter


def fit(job, engine, reporter: Reporter, in_driver: bool) -> list | None:
    """(3) The engine's loop; a divergence (every rank at the same step: the meter agreed on it)
    as [what, value, step] for the driver to say."""
    if engine.resumable:  # a restarted worker goes on from the latest checkpoint Ray holds
        job.checkpoints.on_save = reporter.checkpoint
    try:
        engine.fit(job)
    except Diverged as e:
        return [e.what, e.value, e.step]
    except BaseException:
        if in_driver:  # a worker process would die with its threads; the driver's process goes on
            reporter.close(raise_error=False)
            if job.meter.tracker:
                job.meter.tracker.close()
        raise
    finally:
        job.close_data()
    return None


def finish(job, reporter: Reporter, diverged: list | None, rank: int, in_driver: bool) -> dict | None:
    """(4) Rank 0's history and final metrics to the driver: as fit()'s result in the driver's
    process, else in the last report's checkpoint."""
    import ray.train

    log_worker_figures(job, rank)
    summary = job.meter.summary()
    refused = []  # the registry's refusals of the model rank 0 logged: the driver's run fails with them
    if rank == 0 and job.meter.tracker:
        job.meter.close()
        # Everything sent (or, with the server away past a bounded wait, written to the run's
        # folder) before the driver marks the run FINISHED: the store refuses points after that.
        job.meter.tracker.close()
        refused = job.meter.tracker.not_registered
    reporter.close()
    result = {"history": job.meter.history, "final": summary, "diverged": diverged, "not_registered": refused}
    if in_driver:
        return result  # the driver reads it from fit()'s result
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            (Path(folder) / SUMMARY_FILE).write_text(json.dumps(result))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"step": job.trainer.max_steps, "done": True}, checkpoint=checkpoint)
    return None


def log_worker_figures(job, rank: int) -> None:
    """At the end, on every rank (one gather): each worker's peak memory, its process's RSS
    high-water mark while training (`perf/peak_rss_mb/rank_<r>`, and the largest as
    `perf/peak_rss_mb`; `perf/peak_rss_end_mb` with the final evaluation and export), and on
    pipeline stages each one's idle share (`perf/pipeline_idle_share/rank_<r>`, and their mean);
    rank 0 logs them at the last step and keeps the two summaries in its final metrics."""
    import resource

    mine = {"peak_rss_mb": job.meter.peak_rss_mb,  # training's (Meter._display)
            "peak_rss_end_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # with the final evaluation and export
            **job.parallel.timings()}
    everyone = [None] * job.parallel.world_size
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return
    figures = {}
    for key in mine:
        values = [f[key] for f in everyone if key in f]
        figures.update({f"perf/{key}/rank_{r}": v for r, v in enumerate(values)})
        figures[f"perf/{key}"] = max(values) if key.startswith("peak_") else sum(values) / len(values)
        job.meter.final[key] = figures[f"perf/{key}"]
    job.meter.log(figures, job.meter.step)


def log_to_file(path: Path) -> None:
    """This worker's logging also goes to `path` (created at the first record) when the run's output
    folder is on this node: what the engine keeps off the console (ORT's output below
    `backend.log_level`) is kept there, as Hydra's job log keeps the driver's; so is what Ray Train
    logs on this worker from here on (its `ray.train` logger does not pass records on to the root
    logger, and the driver's LoggingConfig keeps its INFO lines off the console)."""
    if not path.parent.is_dir():
        return
    root = logging.getLogger()
    if not root.handlers:  # logging's last resort printed WARNING and up; with a file handler it would not
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        root.addHandler(console)
    form = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(form)
    root.addHandler(handler)
    train = logging.getLogger("ray.train")
    if not train.propagate:  # Ray Train's logger, DEBUG and up to its own files: INFO and up here
        beside = logging.FileHandler(path, delay=True)
        beside.setFormatter(form)
        beside.setLevel(logging.INFO)
        train.addHandler(beside)


def resume_state(task: WorkerTask, engine) -> dict | None:
    """After a worker failure: the latest checkpoint Ray holds (read by the engine that wrote it);
    else trainer.resume's, if any."""
    import ray
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            path = Path(folder) / CHECKPOINT_FILE
            if path.exists():
                return engine.load_checkpoint(path.read_bytes())
    if isinstance(task.resume, ray.ObjectRef):  # trainer.resume's checkpoint, loaded by the driver
        return ray.get(task.resume)
    return task.resume  # the same, handed over in the driver's own process (or None)


def say_restarted(job, world: int) -> None:
    """One console line when this worker group goes on from a checkpoint Ray Train holds: a group
    restarted after a worker or its host was lost, resized, or found again by trainer.resume=auto
    (Ray Train's own account, tracebacks included, is in its log files, not on the console)."""
    import ray.train

    if ray.train.get_checkpoint() is None or not job.resume_state:
        return
    logging.getLogger(__name__).warning(
        f"the worker group ({world} worker(s)) goes on from Ray Train's checkpoint at step "
        f"{job.resume_state.get('step', 0)} (a worker or its host lost, the group resized, or the run resumed; Ray "
        "Train's account: logs/train/ray-train-sys-controller-*.log in the Ray session folder of the driver's node)")


class DrainNotice:
    """An elastic run's planned shrink: when a node of the worker group is being drained (a spot
    instance's reclaim notice, an autoscaler's scale-down; Ray Train's preemption watcher sees it),
    this step ends with a checkpoint, so that the restart without that node repeats no work done
    before the notice. Asked at display steps, on every rank (Ray Train's call is a barrier across
    the workers), once per worker group. A grow gets no notice: Ray Train stops the workers at
    once, and the new group goes on from the latest periodic checkpoint."""

    def __init__(self, job):
        self.job, self.noticed = job, False

    def check(self, step: int) -> None:
        import ray.train

        if self.noticed or ray.train.get_preemption_info() is None:
            return
        self.noticed = True
        self.job.checkpoints.request(step)
        if self.job.parallel.logging:
            logging.getLogger(__name__).warning(f"a node of this run is being drained: checkpoint at step {step}")


def tag_resize(job, world: int) -> None:
    """On rank 0 of a restarted worker group whose size differs from the last one the run logged
    (an elastic run that grew or shrank): the tag `resized_at_<step>` = "<before> -> <now>",
    `<step>` the first step this size trains."""
    logged = job.meter.history.get("world_size")
    if not logged or int(logged[-1][1]) == world:
        return
    first = (job.resume_state or {}).get("step", 0) + 1
    job.meter.tracker.set_tags({f"resized_at_{first}": f"{int(logged[-1][1])} -> {world}"})


def tag_workers(job, rank: int, world: int) -> None:
    """Tag the MLflow run with where each rank runs (`worker.<rank>`: host, IP, Ray node id, pid)."""
    import ray

    if ray.is_initialized():
        me = f"{platform.node()} {ray.util.get_node_ip_address()} node " \
             f"{ray.get_runtime_context().get_node_id()[:12]} pid {os.getpid()}"
    else:  # in the driver's process, without Ray
        me = f"{platform.node()} driver pid {os.getpid()}"
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    if rank == 0 and job.meter.tracker:
        job.meter.tracker.set_tags({f"worker.{r}": w for r, w in enumerate(everyone)})
