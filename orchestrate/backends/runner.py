"""The distributed runner: ORT's TrainingRunner::Run loop (seeds 002 and 003) in Python,
data-parallel on Ray Train workers, gradients all-reduced by torch.distributed (gloo on CPU,
NCCL on GPU).

    python -m orchestrate backend=runner trainer.num_workers=2
    python -m orchestrate backend=runner backend.engine=torch trainer.gradient_accumulation_steps=4
    python -m orchestrate backend=runner backend.engine=ondevice backend.average_every=10
    python -m orchestrate backend=runner backend.ray_address=auto trainer.num_workers=8   # a cluster

Each worker runs `worker_loop`: the same seed builds the same initial weights on every rank,
each rank reads its own shard of every global batch, and each weight update is
GradientAccumulateStep x (K-1) (forward and backward, no AllReduce) then ModelUpdateStep
(forward, backward, AllReduce, optimizer step, schedule step). Rank 0 evaluates, checkpoints and
logs to the MLflow run that the driver opened.

Engines (`backend.engine`):
  ortmodule  DDP(ORTModule(model)), as seed 004 shows (the default)
  torch      plain DDP
  ondevice   ORT's on-device training API on each worker; its gradient buffers are all-reduced
             before each optimizer step, or (`backend.average_every=N`) the parameters are
             averaged every N updates: federated averaging.

Faults and resume: rank 0's checkpoints are also reported to Ray Train, so that when a worker
dies Ray restarts all workers (`backend.max_failures` times) and they go on from the latest one;
`trainer.resume` continues a stopped run the same way. A checkpoint holds the step counts, the
data position, the model, optimizer, schedule, loss-scaler and RNG states
(`orchestrate.backends.torch.save_checkpoint`).
"""

import contextlib
import json
import os
import platform
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from orchestrate import ray_cluster
from orchestrate.backends.base import Backend
from orchestrate.backends.torch import (LOSSES, evaluate, export_onnx, load_state, make_scheduler, read_checkpoint,
                                        restore_training_state, save_checkpoint)
from orchestrate.schema import ConfigError, Device, Precision
from orchestrate.tracking import absolute_uri

ENGINES = ("ortmodule", "torch", "ondevice")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray placement group strategies


@dataclass
class RunnerBackend(Backend):
    name: str = "runner"
    engine: str = "ortmodule"  # ortmodule | torch | ondevice
    cpus_per_worker: float = 1  # Ray resources per worker; also sizes its torch and ORT thread pools
    use_gpu: bool = False  # one GPU per worker, NCCL
    ray_address: Optional[str] = None  # an existing Ray cluster ("auto", "ray://..."); None: a local one
    placement_strategy: str = "PACK"  # how workers spread over nodes: one of STRATEGIES
    placement_timeout_s: float = 60  # give up (with what was asked and what is free) if not placed by then
    storage_path: Optional[str] = None  # Ray Train's checkpoint copies; shared storage on a multi-node cluster
    max_failures: int = 2  # worker failures survived: all workers restart from the latest checkpoint
    average_every: int = 0  # ondevice engine: 0 all-reduces gradients; N averages parameters every N updates
    check_replicas: bool = True  # log train/replica_divergence (largest parameter gap between ranks)
    mapped_dimensions: dict[str, int] = field(default_factory=dict)  # ORT's symbolic dimension -> size
    distributed = True  # accepts trainer.num_workers and trainer.gradient_accumulation_steps above 1
    resumable = True

    def check(self, job) -> None:
        t = job.trainer
        if self.engine not in ENGINES:
            raise ConfigError(f"backend.engine={self.engine!r}: allowed: {', '.join(ENGINES)}")
        if self.placement_strategy not in STRATEGIES:
            raise ConfigError(f"backend.placement_strategy={self.placement_strategy!r}: allowed: {', '.join(STRATEGIES)}")
        for key in ("cpus_per_worker", "placement_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"backend.{key}={getattr(self, key)}: must be above 0")
        for key in ("max_failures", "average_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"backend.{key}={getattr(self, key)}: must be 0 or more")
        if self.engine == "ondevice":
            self.ondevice(job).check(job)  # the on-device API's own limits (loss, optimizer, fp32)
            if t.resume:
                raise ConfigError(f"trainer.resume={t.resume}: backend.engine=ondevice cannot continue from a "
                                  "checkpoint yet; allowed engines: ortmodule, torch")
        else:
            if self.average_every:
                raise ConfigError("backend.average_every needs backend.engine=ondevice; the ortmodule and torch "
                                  "engines all-reduce gradients every update")
            if job.data.loss not in LOSSES:
                raise ConfigError(f"data.loss={job.data.loss!r}: allowed: {', '.join(LOSSES)}")
        if self.use_gpu != (t.device == Device.cuda):
            raise ConfigError(f"backend.use_gpu={str(self.use_gpu).lower()} and trainer.device={t.device.value} "
                              "disagree: set both (use_gpu=true with device=cuda) or neither")
        if t.precision == Precision.fp16 and self.engine == "ondevice":
            raise ConfigError("trainer.precision=fp16 needs backend.engine=ortmodule or torch (a GPU loss scaler)")
        wanted = t.num_workers * self.cpus_per_worker
        if self.ray_address is None and "RAY_ADDRESS" not in os.environ and wanted > (os.cpu_count() or 1):
            raise ConfigError(f"trainer.num_workers={t.num_workers} x backend.cpus_per_worker="
                              f"{self.cpus_per_worker} asks for {wanted:g} CPUs; this machine has {os.cpu_count()}")

    def ondevice(self, job):
        from orchestrate.backends.ondevice import OnDeviceBackend

        return OnDeviceBackend(intra_op_threads=max(1, int(self.cpus_per_worker)),
                               mapped_dimensions=dict(self.mapped_dimensions))

    def connect(self, job) -> None:
        """Join (or start) Ray and make sure the workers can be placed (app.train calls this
        before the MLflow run opens)."""
        # Ray Train's report() otherwise waits up to its 2 s poll of the workers' results.
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
        ray_cluster.init(self.ray_address, "backend.ray_address")
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        n = job.trainer.num_workers
        bundle = {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}
        asked = f"{n} worker(s) x {bundle} ({self.placement_strategy})"
        total = ray.cluster_resources()
        if any(total.get(k, 0) < v * n for k, v in bundle.items()):
            have = {k: total.get(k, 0) for k in bundle}
            raise ConfigError(f"trainer.num_workers={n} asks for {asked}; the Ray cluster has {have} in all")
        # Reserve once, then free it for Ray Train: a cluster busy with other work makes this
        # wait, and after placement_timeout_s it says so instead of waiting forever.
        group = placement_group([bundle] * n, strategy=self.placement_strategy)
        ready, _ = ray.wait([group.ready()], timeout=self.placement_timeout_s)
        remove_placement_group(group)
        if not ready:
            free = {k: ray.available_resources().get(k, 0) for k in bundle}
            raise ConfigError(f"trainer.num_workers={n}: {asked} could not be placed within "
                              f"backend.placement_timeout_s={self.placement_timeout_s:g}; free now: {free}")

    def fit(self, job) -> None:
        import ray
        from omegaconf import OmegaConf
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        run_id = job.tracker.run_id if job.tracker else None
        # The checkpoint to resume from travels through Ray's object store: a worker on another
        # node cannot read the driver's disk.
        resume = ray.put(job.resume_from.read_bytes()) if job.resume_from else None
        config = {"cfg": OmegaConf.to_container(job.cfg, resolve=True, enum_to_str=True),
                  "out_dir": str(job.out_dir.resolve()), "run_id": run_id, "resume": resume,
                  "uri": absolute_uri(job.cfg.tracking.uri)}
        trainer = TorchTrainer(
            worker_loop, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=job.trainer.num_workers, use_gpu=self.use_gpu,
                                         resources_per_worker={"CPU": self.cpus_per_worker},
                                         placement_strategy=self.placement_strategy),
            run_config=RunConfig(
                name=f"runner-{run_id or 'untracked'}",
                storage_path=self.storage_path or str((job.out_dir / "ray").resolve()),
                failure_config=FailureConfig(max_failures=self.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=job.trainer.max_num_checkpoints + 1)))
        result = trainer.fit()
        with result.checkpoint.as_directory() as folder:
            summary = json.loads((Path(folder) / "summary.json").read_text())
        job.history.clear()
        job.history.update({k: [tuple(p) for p in v] for k, v in summary["history"].items()})
        job.final.update(summary["final"])

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        if path.suffix == ".ckpt":  # the ondevice engine's CheckpointState
            from orchestrate.backends.ondevice import OnDeviceBackend

            return OnDeviceBackend().read_checkpoint(path)
        return read_checkpoint(path)


# ---- on each worker -------------------------------------------------------------------------
def worker_loop(config: dict) -> None:
    """One data-parallel worker: set up, run the engine's loop, report the summary."""
    import logging

    import ray.train
    from omegaconf import OmegaConf

    from orchestrate import schema
    from orchestrate.job import Job
    from orchestrate.tracking import ONE_LOGGING_THREAD, RunLogger

    from ray.train.v2._internal.execution import context as train_context

    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)  # not a console line per report
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    cfg = OmegaConf.merge(OmegaConf.structured(schema.Config), config["cfg"])
    torch.set_num_threads(max(1, int(cfg.backend.cpus_per_worker)))  # sized to this worker's CPUs
    os.environ.update(ONE_LOGGING_THREAD)
    if rank != 0:
        cfg.trainer.progress = False
    job = Job.prepare(cfg, Path(config["out_dir"]))  # same seed: same initial weights on every rank
    t = job.trainer
    job.samples_per_step = t.batch_size * t.gradient_accumulation_steps * world  # summed over workers
    state = resume_state(config)
    if rank == 0 and config["run_id"]:
        job.tracker = RunLogger(config["uri"], config["run_id"])
        # After a restart (or trainer.resume) the run already holds steps: carry them on, log none twice.
        job.continue_history(job.tracker.logged_history())
    device = ray.train.torch.get_device() if cfg.backend.use_gpu else torch.device("cpu")
    reporter = Reporter(device)
    tag_workers(job, rank, world, context)
    if rank == 0 and job.tracker:
        job.log({"world_size": world, "effective_batch_size": job.samples_per_step}, step=0)

    if cfg.backend.engine == "ondevice":
        backend = job.backend.ondevice(job)
        backend.fit(job, rank, world, sync=OnDeviceSync(job, world, reporter))
    else:
        torch_loop(job, rank, world, state, reporter, device)

    summary = job.summary()
    if rank == 0 and job.tracker:
        job.tracker.flush()
    reporter.close()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            (Path(folder) / "summary.json").write_text(json.dumps({"history": job.history, "final": summary}))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"step": t.max_steps, "done": True}, checkpoint=checkpoint)


def resume_state(config: dict) -> dict | None:
    """After a worker failure: the latest checkpoint Ray holds; else trainer.resume's, if any."""
    import ray
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            path = Path(folder) / "checkpoint.pt"
            if path.exists():
                return load_state(path.read_bytes())
    if config["resume"] is not None:
        return load_state(ray.get(config["resume"]))
    return None


def tag_workers(job, rank: int, world: int, context) -> None:
    """Tag the MLflow run with where each rank runs (`worker.<rank>`: host, IP, Ray node id, pid)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    me = f"{platform.node()} {ray.util.get_node_ip_address()} node {node[:12]} pid {os.getpid()}"
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    if rank == 0 and job.tracker:
        job.tracker.set_tags({f"worker.{r}": w for r, w in enumerate(everyone)})


def torch_loop(job, rank: int, world: int, state: dict | None, reporter: "Reporter", device) -> None:
    """The TrainingRunner loop for the ortmodule and torch engines."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    t, K, backend = job.trainer, job.trainer.gradient_accumulation_steps, job.backend
    if state is not None:
        job.model.load_state_dict(state["model"])  # before wrapping: ORTModule exports these weights
    plain = job.model.to(device)
    model = plain
    if backend.engine == "ortmodule":
        from orchestrate.backends.ortmodule import ORTModuleBackend

        model = ORTModuleBackend(intra_op_threads=max(1, int(backend.cpus_per_worker)),
                                 mapped_dimensions=dict(backend.mapped_dimensions)).wrap(plain, job)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = job.make_optimizer(ddp.parameters())
    scheduler = make_scheduler(optimizer, job)
    # fp16 (GPU only): autocast the forward; the dynamic loss scaler (seed 002's LossScaler) grows
    # the scale while gradients stay finite and halves it, skipping the update, when they overflow.
    fp16 = t.precision == Precision.fp16
    scaler = torch.amp.GradScaler("cuda", enabled=fp16)
    done = restore_training_state(state, optimizer, scheduler, scaler) if state is not None else 0
    loss_fn = LOSSES[job.data.loss]

    for step in job.steps(start=done + 1):
        loss_sum = 0.0
        for micro in range(K):
            x, y = job.data.train_batch((step - 1) * K + micro, t.batch_size, t.seed, rank, world)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # GradientAccumulateStep: no AllReduce until the last micro-batch (ModelUpdateStep).
            with ddp.no_sync() if micro < K - 1 else contextlib.nullcontext():
                with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=fp16):
                    loss = loss_fn(ddp(x), y) / K
                scaler.scale(loss).backward()
            loss_sum += loss.item()
        display = job.due(step, t.display_loss_steps)
        if display:
            scaler.unscale_(optimizer)  # the norms of the true gradients (a no-op in fp32)
            grads = [p.grad for p in ddp.parameters() if p.grad is not None]
            norms = {"train/grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item(),
                     "train/param_norm": torch.linalg.vector_norm(
                         torch.stack([p.detach().norm() for p in ddp.parameters()])).item()}
            if fp16:
                norms["train/loss_scale"] = scaler.get_scale()
            job.log(norms, step)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

        job.record(step, loss_sum)
        if display:
            if backend.check_replicas:
                job.log({"train/replica_divergence": replica_divergence(
                    torch.cat([p.detach().reshape(-1).float() for p in ddp.parameters()]))}, step)
            reporter.metrics({"step": step, "train/loss": job.final.get("train_loss")})
        path = None
        if rank == 0:
            job.evaluate(step, lambda: evaluate(plain, job))
            path = job.checkpoint(step, lambda p: save_checkpoint(p, step, plain, optimizer, scheduler, job,
                                                                  world_size=world, scaler=scaler), suffix=".pt")
        if job.due(step, t.checkpoint_period):
            reporter.checkpoint({"step": step}, path)

    if rank == 0:
        job.save_model(lambda p: export_onnx(plain, job.data.sample_input().to(device), p))


def replica_divergence(flat: torch.Tensor) -> float:
    """The largest difference of any parameter between any two ranks (0.0: all ranks agree)."""
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).max().item()


class OnDeviceSync:
    """The ondevice engine's data parallelism, called by OnDeviceBackend.fit around each optimizer
    step. ORT's gradient buffers are read and written in place through
    `state.parameters[name].grad` (a live view on the CPU: undocumented, and pinned by the
    runner's equivalence test); parameters go through get_contiguous_parameters and
    copy_buffer_to_parameters."""

    def __init__(self, job, world: int, reporter: "Reporter"):
        self.job, self.world, self.reporter = job, world, reporter
        self.K, self.every = job.trainer.gradient_accumulation_steps, job.backend.average_every

    def before_update(self, step: int, state) -> None:
        display = self.job.due(step, self.job.trainer.display_loss_steps)
        reduce = not self.every  # ModelUpdateStep's AllReduce; federated averaging has none here
        if not (reduce or self.K > 1 or display):
            return  # nothing to do to the gradients this step
        grads = [torch.from_numpy(p.grad) for _, p in state.parameters if p.requires_grad]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if reduce:
            dist.all_reduce(flat)
        if reduce or self.K > 1:
            flat /= (self.world if reduce else 1) * self.K  # ORT sums the K micro-batches: make it the mean
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if display:
            self.job.log({"train/grad_norm": flat.norm().item()}, step)

    def after_update(self, step: int, module) -> None:
        from onnxruntime import OrtValue

        job = self.job
        averaging = self.every and job.due(step, self.every)
        display = job.due(step, job.trainer.display_loss_steps)
        if not (averaging or display):
            return
        params = torch.from_numpy(module.get_contiguous_parameters(trainable_only=True).numpy())
        if averaging:  # federated averaging: every N updates all ranks take the mean model
            dist.all_reduce(params)
            params /= self.world
            module.copy_buffer_to_parameters(OrtValue.ortvalue_from_numpy(params.numpy())._ortvalue,
                                             trainable_only=True)
        if display:
            metrics = {"train/param_norm": params.norm().item()}
            if job.backend.check_replicas:
                metrics["train/replica_divergence"] = replica_divergence(params)
            job.log(metrics, step)
            self.reporter.metrics({"step": step})


class Reporter:
    """ray.train.report, off the training loop's path.

    Measured with Ray 2.60 (2 workers, 2 cores; `benchmarks/runner.py --report-cost`): a report
    costs about 5 ms (every worker meets at a barrier), and a report made before Ray's controller
    took the previous one waits for its next poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by
    default, 0.1 s as set here): 103 ms a call with 5 ms of work between reports. So the loop
    hands reports to a thread (1-3 ms a call there, median). At display steps a report
    goes out only when every worker's thread is idle: one MIN all-reduce decides, so that all
    workers skip the same reports (Ray needs every worker to make the same calls). Checkpoint
    reports are never skipped."""

    def __init__(self, device):
        self.device, self.pending, self.error = device, 0, None
        self.lock, self.queue = threading.Lock(), queue.Queue()
        self.thread = threading.Thread(target=self._run, name="ray-train-report", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import ray.train

        while (item := self.queue.get()) is not None:
            metrics, folder = item
            try:
                checkpoint = ray.train.Checkpoint.from_directory(folder) if folder else None
                ray.train.report(metrics, checkpoint=checkpoint)
            except Exception as e:  # raised again in close(), on the training thread
                self.error = e
                return
            finally:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
            with self.lock:
                self.pending -= 1

    def _put(self, metrics: dict, folder: str | None = None) -> None:
        with self.lock:
            self.pending += 1
        self.queue.put((metrics, folder))

    def metrics(self, metrics: dict) -> None:
        """At a display step, on every worker."""
        idle = torch.tensor([0 if self.pending else 1], device=self.device)
        dist.all_reduce(idle, op=dist.ReduceOp.MIN)
        if idle.item():
            self._put(metrics)

    def checkpoint(self, metrics: dict, path: Path | None) -> None:
        """At a checkpoint step, on every worker; `path` is rank 0's checkpoint file."""
        folder = None
        if path is not None:  # a folder holding just this file, for Ray to copy to its storage
            folder = tempfile.mkdtemp(prefix=".report_", dir=path.parent)
            os.link(path, Path(folder) / "checkpoint.pt")  # same file system: no second copy
        self._put(metrics, folder)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
