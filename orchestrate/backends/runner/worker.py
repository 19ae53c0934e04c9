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
from pathlib import Path

import torch
import torch.distributed as dist

from orchestrate.backends.runner.collective import Workers
from orchestrate.backends.runner.relay import RELAY_STAGING, RelayedLogger
from orchestrate.backends.runner.report import CHECKPOINT_FILE, Reporter
from orchestrate.meter import Diverged
from orchestrate.thirdparty import quiet_ray_train_reports

SUMMARY_FILE = "summary.json"  # rank 0's history and final metrics, in its last report
WORKER_LOG = "worker_{rank}.log"  # each worker's logging, in the run's output folder (as Hydra's job log)


def worker_loop(config: dict) -> dict | None:
    import ray.train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    in_driver = config.get("in_driver", False)
    if in_driver:
        # One worker in the driver's process (Ray Train's local mode): no worker group, so no
        # process group either; a one-rank one makes the same collectives (DDP's, the meter's)
        # run as they do across workers. Its log is the driver's (Hydra's app.log); Ray Train's
        # lines are kept off its console by the driver (driver.quiet_local_mode).
        with _one_rank_group():
            return _loop(config, rank, world, in_driver)
    quiet_ray_train_reports()  # not a console line per report
    log_to_file(Path(config["out_dir"]) / WORKER_LOG.format(rank=rank))
    return _loop(config, rank, world, in_driver)


@contextlib.contextmanager
def _one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loop(config: dict, rank: int, world: int, in_driver: bool) -> dict | None:
    import ray.train
    from omegaconf import OmegaConf

    from orchestrate import schema
    from orchestrate.job import Job
    from orchestrate.tracking.logger import RunLogger
    from orchestrate.tracking.settings import ONE_LOGGING_THREAD

    cfg = OmegaConf.merge(OmegaConf.structured(schema.Config), config["cfg"])
    os.environ.update(ONE_LOGGING_THREAD)
    if rank != 0:
        cfg.trainer.progress = False
    device = ray.train.torch.get_device() if cfg.backend.use_gpu else torch.device("cpu")
    # The worker's CPUs (backend.cpus_per_worker) are its CPU budget's cores: the engine's loop
    # sizes its threads and loader from them (orchestrate.cpu), in the driver's process too.
    parallel = Workers(rank, world, device, cfg.backend.average_every, cfg.backend.check_replicas,
                       cores=cfg.backend.cpus_per_worker)
    # Built once, for this rank (the same seed: the same initial weights on every rank), with the
    # engine the driver chose and sized; nothing is checked again: the driver checked the config.
    job = Job.build(cfg, Path(config["out_dir"]), parallel=parallel)
    engine = schema.build(OmegaConf.create(config["engine"]), "backend.engine")
    job.meter.name = f"{cfg.backend.name}/{engine.name}"
    if engine.resumable:
        job.resume_state = resume_state(config, engine)
        if rank == 0:
            say_restarted(job, world)
    job.meter.trial = config["trial"]  # a pruning sweep's trial, on every rank (Meter.stop_early)
    reporter = Reporter(job.parallel)
    draining = DrainNotice(job) if job.trainer.elastic else None

    def on_display(step: int, metrics: dict[str, float]) -> None:
        if rank == 0:  # the worker count over steps: an elastic run's resizes show on its chart
            job.meter.log({"world_size": world}, step)
        if draining is not None:
            draining.check(step)
        reporter.metrics(step, metrics)

    job.meter.on_display = on_display
    if engine.resumable:  # a restarted worker goes on from the latest checkpoint Ray holds
        job.checkpoints.on_save = reporter.checkpoint
    if rank == 0 and config["run_id"]:
        # In the driver's process: its own logger into the run. On a worker, whichever host it is on:
        # the relay on the driver's node logs for it (relay.py).
        job.track(RunLogger(config["uri"], config["run_id"], out_dir=Path(config["out_dir"])) if in_driver
                  else RelayedLogger(config["relay"], config["run_id"], Path(config["out_dir"]) / RELAY_STAGING))
        # The driver logged the data as the run's inputs; the model's metrics name the eval split.
        job.meter.tracker.log_datasets(job.data, Path(cfg.data._target_).suffix[1:], record=False)
        # After a restart (or trainer.resume) the run already holds steps: carry them on, log none twice.
        job.meter.continue_history(job.meter.tracker.logged_history())
        tag_resize(job, world)
    tag_workers(job, rank, world)
    if rank == 0:
        job.meter.log({"world_size": world, "effective_batch_size": job.meter.samples_per_step}, step=0)

    diverged = None
    try:
        engine.fit(job)
    except Diverged as e:  # every rank at the same step (the meter agreed on it): the driver says so
        diverged = [e.what, e.value, e.step]
    except BaseException:
        if in_driver:  # a worker process would die with its threads; the driver's process goes on
            reporter.close(raise_error=False)
            if job.meter.tracker:
                job.meter.tracker.close()
        raise
    finally:
        job.close_data()

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


def resume_state(config: dict, engine) -> dict | None:
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
    if isinstance(config["resume"], ray.ObjectRef):  # trainer.resume's checkpoint, loaded by the driver
        return ray.get(config["resume"])
    return config["resume"]  # the same, handed over in the driver's own process (or None)


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
