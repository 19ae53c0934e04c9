"""The distributed runner: ORT's TrainingRunner::Run loop in Python, data-parallel on Ray Train
workers, gradients all-reduced by torch.distributed (gloo on CPU, NCCL on GPU).

    python -m orchestrate backend=runner trainer.num_workers=2
    python -m orchestrate backend=runner backend.engine=torch trainer.gradient_accumulation_steps=4
    python -m orchestrate backend=runner backend.engine=ondevice backend.average_every=10
    python -m orchestrate backend=runner backend.engine=auto trainer.num_workers=2   # the fastest engine
    python -m orchestrate backend=runner backend.ray_address=auto trainer.num_workers=8   # a cluster

This file is the driver: it checks the settings, holds a Ray cluster with room for the workers,
and hands `worker.worker_loop` to Ray Train's TorchTrainer. Each weight update on the workers is
GradientAccumulateStep x (K-1) (forward and backward, no AllReduce) then ModelUpdateStep (forward,
backward, AllReduce, optimizer step, schedule step).

Engines (`backend.engine`) are backends too: the name of a conf/backend file whose backend can run
on the workers (`data_parallel`), built from that file and run with the workers' data-parallel
context (`collective.Workers`):
  ortmodule  DDP(ORTModule(model)), ORT's recipe for distributed ORTModule (the default)
  torch      plain DDP
  ondevice   ORT's on-device training API on each worker; its gradient buffers are all-reduced
             before each optimizer step, or (`backend.average_every=N`) the parameters are
             averaged every N updates: federated averaging.
  auto       not an engine but a choice among them (orchestrate/backends/auto.py): the driver probes
             each engine in its own process, sized as one worker runs it, before the workers start,
             and the run goes on with the fastest whose loss agrees (the run's `engine` tag).

Faults and resume: rank 0's checkpoints are also reported to Ray Train, so that when a worker
dies Ray restarts all workers (`backend.max_failures` times) and they go on from the latest one;
`trainer.resume` continues a stopped run the same way. A checkpoint is the engine's own, read
back by the engine's `load_checkpoint`; each holds the step counts and the data position
(`orchestrate.checkpoints.progress`) beside the training state: the PyTorch engines' the model,
optimizer, schedule, loss-scaler and RNG states (`orchestrate.checkpoints.save_torch`), the
on-device engine's ORT's CheckpointState with the optimizer's moments and step count (which
place the learning-rate schedule). Every worker restarts from rank 0's checkpoint: with
`backend.average_every` the ranks' parameters and optimizer moments differ between averagings,
so such a restart hands every rank rank 0's and does not repeat the uninterrupted run exactly.
"""

import contextlib
import contextvars
import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from orchestrate import ort, schema, signals
from orchestrate.backends.base import Backend, backend_config, backends
from orchestrate.backends.runner import relay as relays
from orchestrate.backends.runner import storage
from orchestrate.cluster import ray_cluster
from orchestrate.meter import Diverged, world_sizes
from orchestrate.schema import ABOVE_0, AT_LEAST_0, ConfigError, Device
from orchestrate.thirdparty import ray_train_signals_to
from orchestrate.tracking.stores import absolute_uri

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray placement group strategies
# Module state: engine name -> its backend config, composed once per process (each check asks);
# read-only answers that change no run.
_ENGINES: dict[str, dict] = {}


def engine_config(name: str) -> DictConfig:
    """The engine's `backend_config`, composed once per process (`check`, `fit` and
    `read_checkpoint` each ask), with a ConfigError naming the key when there is no such file."""
    if name not in _ENGINES:
        from hydra.errors import MissingConfigException

        try:
            node = backend_config(name)
        except MissingConfigException:
            raise ConfigError(f"backend.engine={name}: no such backend; allowed: "
                              f"{', '.join(engines() + backends('chooses'))}") from None
        _ENGINES[name] = OmegaConf.to_container(node, resolve=True)
    return OmegaConf.create(_ENGINES[name])


def ray_environment() -> None:
    """Settings Ray's processes read from the environment they start in (set before Ray starts)."""
    # Ray Train's report() otherwise waits up to its 2 s poll of the workers' results.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


@contextlib.contextmanager
def train_environment(start_timeout_s: float | None = None) -> Iterator[None]:
    """Settings Ray Train's controller takes from the driver's environment when `fit` starts it
    (Ray Train hands a fixed list of its variables on), put back afterwards. A value of the
    user's is left as it is.
    - On the local Ray started here (`ray_cluster.can_grow` is False) there is no preemption
      watcher: it polls for nodes that an autoscaler or a cloud is draining, which this instance
      does not have, and its start prints a `core_worker.cc` error line about the watcher's own
      restart settings on every run.
    - `start_timeout_s` (an elastic run: backend.placement_timeout_s) bounds each start of the
      worker group. Right after a node is lost Ray Train may still count it and size the new group
      for it; that start waits this long (Ray's default: 60 s), then the group starts at the size
      that fits."""
    wanted = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": None if ray_cluster.can_grow() else "0",
              "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": None if start_timeout_s is None else f"{start_timeout_s:g}"}
    set_here = [name for name, value in wanted.items() if value is not None and name not in os.environ]
    for name in set_here:
        os.environ[name] = wanted[name]
    try:
        yield
    finally:
        for name in set_here:
            os.environ.pop(name, None)


def engines(*flags: str) -> list[str]:
    """The backends that can run on the runner's workers (`data_parallel`) and set `flags` too."""
    return backends("data_parallel", *flags)


@dataclass
class RunnerBackend(Backend):
    name: str
    engine: str  # the backend each worker runs: a conf/backend name (ortmodule, torch, ondevice), or auto
    cpus_per_worker: Annotated[float, ABOVE_0]  # Ray resources per worker; also sizes its torch and ORT thread pools
    use_gpu: bool  # one GPU per worker, NCCL
    ray_address: Optional[str]  # an existing Ray cluster ("auto", "ray://..."); None: a local one
    placement_strategy: str  # how workers spread over nodes: one of STRATEGIES
    placement_timeout_s: Annotated[float, ABOVE_0]  # give up (with what was asked and what is free) if not placed by then
    # trainer.min_workers (elastic): how often Ray Train looks for room to grow the worker group
    # (its elastic_resize_monitor_interval_s); a default, so that a user's own runner file may leave it out.
    resize_interval_s: Annotated[float, ABOVE_0] = dataclasses.field(default=60.0, kw_only=True)
    storage_path: Optional[str]  # Ray Train's checkpoint copies: a folder, or s3://bucket/prefix; every host's (storage.py)
    max_failures: Annotated[int, AT_LEAST_0]  # worker failures survived: all workers restart from the latest checkpoint
    average_every: Annotated[int, AT_LEAST_0]  # 0 all-reduces gradients; N averages parameters every N updates (ondevice)
    check_replicas: bool  # log train/replica_divergence (largest parameter gap between ranks)
    mapped_dimensions: dict[str, int]  # ORT's symbolic dimension -> size, handed to ORT engines
    log_level: str  # handed to ORT engines: ORT's output on the console from this level up (ort.LEVELS)
    distributed = True  # accepts trainer.num_workers and trainer.gradient_accumulation_steps above 1
    resumable = True

    def sized(self, node: DictConfig) -> DictConfig:
        """An engine's backend config for the workers: ORT engines get the runner's mapped
        dimensions and log level. Its threads are the worker's CPU budget's (`budget`)."""
        sized = {"mapped_dimensions": self.mapped_dimensions, "log_level": self.log_level}
        return OmegaConf.merge(node, {k: v for k, v in sized.items() if k in node})

    def engine_node(self) -> DictConfig:
        """The engine's backend config, sized for one worker."""
        return self.sized(engine_config(self.engine))

    def budget(self, job):
        """One worker's CPU budget: its backend.cpus_per_worker split by the rule (orchestrate.cpu),
        the engine's backend.intra_op_threads winning."""
        from orchestrate import cpu

        return cpu.budget(self.engine_backend(), job.data, given=self.cpus_per_worker, busy=job.busy_cores)

    def engine_backend(self) -> Backend:
        """The engine, built from its config as each worker builds it; once per runner: `check`
        and `fit` share it (backend.engine=auto: the candidates it checked are those it probes)."""
        if self.__dict__.get("_engine") is None:
            self._engine = schema.build(self.engine_node(), "backend.engine")
        return self._engine

    def engine_candidates(self, auto, stages: bool = False) -> dict[str, DictConfig]:
        """backend.engine=auto: the engines it may choose (those that run on the workers; with
        backend.average_every, those that average parameters), each sized as a worker runs it."""
        flags = ("data_parallel", "averaging") if self.average_every else ("data_parallel",)
        if stages:  # with pipeline stages (trainer.pipeline_parallel_size), the engines that train a stage
            flags = (*flags, "stages")
        return {name: self.sized(node) for name, node in auto.found(*flags).items()}

    def check_precision(self, job) -> None:
        """The workers train in their engine's precisions (auto: each candidate checks its own)."""
        if self.engine != "auto" and self.engine != self.name:
            self.engine_backend().check_precision(job)

    def unavailable(self, key: str = "backend") -> str | None:
        """The engine's, where it is one (auto leaves out those this environment lacks)."""
        if self.engine == self.name:
            return None  # `check` says what is wrong with it
        try:
            engine = self.engine_backend()
        except ConfigError:  # no such backend, or a bad setting of it: `check` says so
            return None
        why = None if engine.chooses else engine.unavailable("backend.engine")
        if why is None:
            return None
        here = [name for name in engines() if schema.build(engine_config(name), "backend.engine").unavailable() is None]
        return f"{why}; or choose an engine this environment has: backend.engine={'|'.join(here + backends('chooses'))}"

    def check(self, job) -> None:
        t = job.trainer
        if self.engine == self.name:
            raise ConfigError(f"backend.engine={self.engine}: the runner cannot run itself on its workers")
        engine = self.engine_backend()
        if engine.chooses:  # backend.engine=auto: the engine is chosen by probing the candidates, in `fit`
            if t.resume:
                raise ConfigError(f"trainer.resume={t.resume}: backend.engine={self.engine} cannot continue a run (its "
                                  "probes may choose another engine than the run's); name the engine the run used (its "
                                  f"`engine` tag), one of: {', '.join(engines('resumable'))}")
            candidates = self.engine_candidates(engine, t.pipeline_parallel_size > 1)
            engine.check_candidates(job, candidates, f"backend.engine={self.engine}",
                                    cores=self.cpus_per_worker)  # each probed on one worker's CPUs
        elif not engine.data_parallel:
            raise ConfigError(f"backend.engine={self.engine}: {type(engine).__name__} cannot run on the runner's "
                              f"workers; allowed: {', '.join(engines() + backends('chooses'))}")
        else:
            engine.check(job)  # the engine's own limits (the on-device API's losses, optimizers, fp32)
        from orchestrate.backends.runner import pipeline

        pipeline.check(job, engine)  # trainer.pipeline_*: the stages against the workers, the engine and the model
        if self.log_level not in ort.LEVELS:
            raise ConfigError(f"backend.log_level={self.log_level!r}: allowed: {', '.join(ort.LEVELS)}")
        storage.check_scheme(self.storage_path)  # a scheme it does not take: refused before Ray starts
        if self.placement_strategy not in STRATEGIES:
            raise ConfigError(f"backend.placement_strategy={self.placement_strategy!r}: allowed: {', '.join(STRATEGIES)}")
        if t.resume and not engine.resumable:
            raise ConfigError(f"trainer.resume={t.resume}: backend.engine={self.engine} cannot continue from a "
                              f"checkpoint; allowed engines: {', '.join(engines('resumable'))}")
        if self.average_every and not (engine.averaging or engine.chooses):
            raise ConfigError(f"backend.average_every needs an engine that averages parameters (backend.engine="
                              f"ondevice); backend.engine={self.engine} all-reduces gradients every update")
        if t.elastic and self.average_every:
            raise ConfigError(f"trainer.min_workers={t.min_workers} and backend.average_every={self.average_every}: "
                              "with parameter averaging each rank trains on its own between averagings, so a run "
                              "that changes its worker count would not train as a fixed-size one; drop one of them")
        if self.use_gpu != (t.device == Device.cuda):
            raise ConfigError(f"backend.use_gpu={str(self.use_gpu).lower()} and trainer.device={t.device.value} "
                              "disagree: set both (use_gpu=true with device=cuda) or neither")
        address, key = (self.ray_address, "backend.ray_address") if self.ray_address is not None else \
            (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
        if address:  # a cluster that is not there or refuses this process: seconds, before the run opens
            try:
                ray_cluster.check_access(address, key)
            except ray_cluster.RayUnavailable as e:
                raise ConfigError(str(e)) from None
            return
        # This machine, or the warm head on it: no autoscaler, what it has is all it will have (an
        # elastic run needs room for its minimum; it grows as far as the rest goes).
        key, least = starting_workers(t)
        wanted = least * self.cpus_per_worker
        head = None if self.in_driver(t.num_workers) else job.runtime.head
        have, where = (job.runtime.head_cpus, "the warm Ray head (orchestrate up)") if head else \
            (os.cpu_count() or 1, "this machine")
        if wanted > have:
            raise ConfigError(f"{key}={least} x backend.cpus_per_worker="
                              f"{self.cpus_per_worker} asks for {wanted:g} CPUs; {where} has {have}")

    def in_driver(self, num_workers: int) -> bool:
        """One worker on this machine runs in the driver's own process (Ray Train's local mode:
        the same loop, the same MLflow run): no Ray, no worker group to start and stop (about as
        long as the run's own start, measured: docs/performance-log.md). Not with a cluster address
        (its resources are the point) or a GPU worker; backend.max_failures restarts a worker
        group, so they need 2 or more workers (one in the driver fails with the run)."""
        return _in_driver(num_workers, self.ray_address, self.use_gpu)

    @classmethod
    @contextlib.contextmanager
    def start_early(cls, cfg: DictConfig, runtime) -> Iterator[None]:
        """A new local Ray (no `ray_address`, no RAY_ADDRESS) starts on a thread of its own while
        the command checks the config: `connect` then waits for it instead of starting one (about
        4 s of start-up overlapped). A refused config shuts it down. None for a run in the driver."""
        node = cfg.backend
        if _in_driver(cfg.trainer.get("num_workers", 1), node.get("ray_address"), node.get("use_gpu", False)) or \
                node.get("ray_address") is not None or "RAY_ADDRESS" in os.environ or runtime.head:
            yield
            return
        ray_environment()
        ray_cluster.init_in_background(None, "backend.ray_address")
        try:
            yield
        except BaseException:
            ray_cluster.cancel_background_init(wait=False)  # a refusal need not wait for Ray's start
            raise

    @contextlib.contextmanager
    def connect(self, job) -> Iterator[None]:
        """Join (or start) Ray and make sure the workers can be placed; a Ray instance started here
        is shut down when the run ends."""
        if self.in_driver(job.trainer.num_workers):
            yield  # the worker runs in this process: nothing to hold
            return
        ray_environment()
        try:
            started = ray_cluster.init(self.ray_address, "backend.ray_address", job.runtime)
        except ray_cluster.RayUnavailable as e:
            raise ConfigError(str(e)) from None
        job.ray = ray_cluster.how()  # for the summary: warm (orchestrate up), cold or a cluster
        signals.reinstall_handlers()  # SIGTERM stops the run, not Ray's handler (which aborts the driver)
        stopped = _STOPPED_RUNS.set([])
        try:
            t = job.trainer  # an elastic run starts once its minimum fits
            key, n = starting_workers(t)
            bundle = {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}
            try:
                ray_cluster.wait_for_placement([bundle] * n, self.placement_strategy, self.placement_timeout_s,
                                               asked=f"{key}={n}: {n} worker(s)",
                                               timeout_key="backend.placement_timeout_s")
            except ray_cluster.PlacementError as e:
                raise ConfigError(str(e)) from None
            # Checkpoints every host reaches, and the data, before the run opens (a cluster of other hosts).
            storage.check_shared(storage.resolve(self.storage_path, job.out_dir), self.placement_timeout_s,
                                 "backend.placement_timeout_s")
            storage.check_data(OmegaConf.to_container(job.cfg.data, resolve=True), self.placement_timeout_s,
                               "backend.placement_timeout_s")  # and the data's files, on every host
            yield
        finally:
            # A stopped run's Ray Train run is aborted only now, after its MLflow run was marked
            # KILLED (the `with Run` block inside this one): when the cluster itself goes away
            # with the signal (scancel ends the job's Ray steps too), Ray ends this process 5 s
            # after its head is gone, and the MLflow run's end must not wait on Ray to get there.
            for controller in _STOPPED_RUNS.get():
                abort(controller)
            _STOPPED_RUNS.reset(stopped)
            if started:
                ray_cluster.leave()

    def fit(self, job) -> None:
        engine = self.engine_backend()
        if engine.chooses:
            # backend.engine=auto: each engine is probed here, in one process, before any worker
            # starts; the run then goes on as if the chosen engine had been named.
            candidates = self.engine_candidates(engine, job.trainer.pipeline_parallel_size > 1)
            chosen = engine.choose(job, candidates, f"backend.engine={self.engine}", tag="engine",
                                   cores=self.cpus_per_worker)
            job.backend = dataclasses.replace(self, engine=chosen)
            job.backend.fit(job)
            return

        import ray

        from orchestrate.backends.runner.worker import SUMMARY_FILE, WorkerTask, worker_loop

        tracker = job.meter.tracker
        run_id = tracker.run_id if tracker else None
        cfg = OmegaConf.to_container(job.cfg, resolve=True, enum_to_str=True)
        cfg["backend"]["engine"] = self.engine  # the engine the workers run (backend.engine=auto: the chosen one)
        in_driver = self.in_driver(job.trainer.num_workers)
        # The checkpoint to resume from travels through Ray's object store: a worker on another
        # node cannot read the driver's disk (one in the driver takes it as it is).
        resume = job.resume_state
        # What rank 0 logs goes through the driver's node (relay.py): the workers' hosts need not
        # reach the tracking store (a SQLite file here, a server on this machine's 127.0.0.1).
        uri = absolute_uri(tracker.uri) if tracker else None
        relay = relays.start(uri, run_id, job.out_dir.resolve(), tracker.eval_dataset) if tracker and not in_driver \
            else None
        task = WorkerTask(cfg=cfg, engine=OmegaConf.to_container(self.engine_node()), out_dir=str(job.out_dir.resolve()),
                          run_id=run_id, in_driver=in_driver,
                          resume=ray.put(resume) if resume is not None and not in_driver else resume,
                          uri=uri, relay=relay, trial=job.meter.trial)
        # Ray Train's fit() would take over SIGINT (its handler asks the controller to abort, then
        # exits with SystemExit: the run marked FAILED) and leave SIGTERM to end the driver on the
        # spot. Instead both stop the run as everywhere else (orchestrate.signals.stop_on_signals):
        # a KeyboardInterrupt out of fit()'s wait; the run is marked KILLED, then `connect` aborts
        # the controller (it stops the workers) and shuts down a Ray started here.
        controllers: list = []
        try:
            with train_environment(self.placement_timeout_s if job.trainer.elastic else None), \
                    quiet_local_mode(in_driver), ray_cluster.harmless_output_to_log():
                trainer = self.trainer(job, worker_loop, {"task": task}, in_driver, run_id)
                ray_train_signals_to(trainer, controllers.append)  # handed the controller actor
                result = trainer.fit()
        except KeyboardInterrupt as e:
            if not in_driver:  # a worker group's controller, aborted once the run is marked KILLED
                _STOPPED_RUNS.get().extend(controllers)
            stopped = signals.stopped_by()
            if stopped is not None and not isinstance(e, signals.Stopped):
                raise stopped from None  # Ray's ray.get re-raised the signal as a plain KeyboardInterrupt
            raise
        finally:
            if relay is not None:
                relays.stop(relay)
        if in_driver:
            summary = result.return_value
        else:
            with result.checkpoint.as_directory() as folder:
                summary = json.loads((Path(folder) / SUMMARY_FILE).read_text())
        job.meter.history = {k: [tuple(p) for p in v] for k, v in summary["history"].items()}
        job.meter.final.update(summary["final"])
        if summary.get("not_registered") and tracker is not None:  # the run ends FAILED, exit 1
            tracker.not_registered.extend(summary["not_registered"])
        sizes = world_sizes(job.meter.history)
        if tracker is not None and len(sizes) > 1:  # an elastic run's sizes, in order, beside its resized_at_* tags
            tracker.set_tags({"world_sizes": " -> ".join(map(str, sizes))})
        if summary.get("diverged"):  # the workers stopped together, without a failure for Ray to retry
            raise Diverged(*summary["diverged"])

    def trainer(self, job, loop, config: dict, in_driver: bool, run_id: str | None):
        """Ray Train's TorchTrainer running `loop` on the workers (in the driver: its local mode)."""
        from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        t = job.trainer
        # num_workers=0: Ray Train's local mode, the function called in this process; (min, max):
        # elastic, started with as many as fit from min on, resized (a restart of every worker
        # from the latest checkpoint) when the count that fits changes, looked at every
        # resize_interval_s.
        workers = 0 if in_driver else (t.min_workers, t.num_workers) if t.elastic else t.num_workers
        kept = storage.resolve(self.storage_path, job.out_dir)
        return TorchTrainer(
            loop, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=self.use_gpu,
                                         resources_per_worker={"CPU": self.cpus_per_worker},
                                         placement_strategy=self.placement_strategy,
                                         elastic_resize_monitor_interval_s=self.resize_interval_s),
            run_config=RunConfig(
                name=f"runner-{run_id or 'untracked'}",
                storage_path=kept.path, storage_filesystem=kept.filesystem,
                failure_config=FailureConfig(max_failures=self.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=job.trainer.max_num_checkpoints + 1),
                # Ray Train's own lines stay in its log files (Ray's session logs on each node,
                # logs/train/ray-train-sys-*.log, which take every level; from the loop's start,
                # the workers' logs too: worker.log_to_file), off the console: its INFO lines (the
                # controller's "Requesting resources", a worker's "Checkpoint successfully
                # created" at every checkpoint) and its tracebacks, the worker's "Error in
                # training function" and the controller's, at every restart. The console gets
                # one line per restart from rank 0 (worker.say_restarted), and a run that fails
                # for good ends with the error's one line.
                logging_config=LoggingConfig(log_level="CRITICAL")))

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        return self.engine_backend().read_checkpoint(path)

    def load_checkpoint(self, source: Path | bytes) -> dict:
        return self.engine_backend().load_checkpoint(source)  # the workers' checkpoints are the engine's


@contextlib.contextmanager
def quiet_local_mode(in_driver: bool) -> Iterator[None]:
    """Ray Train's local mode logs INFO lines to the console (that it runs in local mode, every
    report's metrics), which its worker group keeps in Ray's log files: kept off here as well."""
    logger = logging.getLogger("ray.train")
    before = logger.level
    if in_driver:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(before)


def starting_workers(trainer) -> tuple[str, int]:
    """The workers a run needs placed before it starts, and the key that sets them: an elastic
    run's minimum (trainer.min_workers), else trainer.num_workers."""
    return ("trainer.min_workers", trainer.min_workers) if trainer.elastic else ("trainer.num_workers", trainer.num_workers)


def _in_driver(num_workers: int, ray_address: str | None, use_gpu: bool) -> bool:
    return num_workers == 1 and ray_address is None and "RAY_ADDRESS" not in os.environ and not use_gpu


ABORT_WAIT_S = 30.0
# Module state: the Ray Train controllers of runs stopped by a signal inside a `connect` block
# (the signal handler cannot abort them: it must return at once), aborted at the block's end,
# which resets it.
_STOPPED_RUNS: contextvars.ContextVar[list] = contextvars.ContextVar("stopped_runs")


def abort(controller) -> None:
    """Stop a Ray Train run: its controller aborts the worker group, then exits (so the call ends
    with the actor's death, which is the expected answer)."""
    import ray

    try:
        ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass
