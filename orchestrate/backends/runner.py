"""The distributed runner: ORT's TrainingRunner::Run loop (seeds 002 and 003) in Python,
data-parallel on Ray Train workers, gradients all-reduced by torch.distributed (gloo on CPU).

    python -m orchestrate backend=runner trainer.num_workers=2
    python -m orchestrate backend=runner backend.engine=torch trainer.gradient_accumulation_steps=4

Each worker runs `worker_loop`: the same seed builds the same initial weights on every rank,
each rank reads its own shard of every global batch, and each weight update is
GradientAccumulateStep x (K-1) (forward and backward under DDP's `no_sync`: no AllReduce), then
ModelUpdateStep (forward, backward with AllReduce, optimizer step, schedule step). Rank 0
evaluates, checkpoints and logs to the MLflow run the driver opened.

Engines: `ortmodule` (DDP(ORTModule(model)), seed 004) and `torch` (plain DDP).
Not yet here (see the closing note of issue 2/3's session): the on-device engine, resume from a
checkpoint, Ray Train failure handling tests, fp16 with a loss scaler, multi-node tests.
"""

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from orchestrate.backends.base import Backend
from orchestrate.backends.torch import LOSSES, evaluate, export_onnx, make_scheduler, read_checkpoint, save_checkpoint
from orchestrate.schema import ConfigError, Precision
from orchestrate.tracking import absolute_uri

ENGINES = ("ortmodule", "torch")


@dataclass
class RunnerBackend(Backend):
    name: str = "runner"
    engine: str = "ortmodule"  # ortmodule | torch
    cpus_per_worker: float = 1  # Ray resources per worker; also sizes its torch and ORT thread pools
    use_gpu: bool = False  # one GPU per worker, NCCL
    ray_address: Optional[str] = None  # an existing Ray cluster ("auto", "ray://..."); None: a local one
    distributed = True  # accepts trainer.num_workers and trainer.gradient_accumulation_steps above 1

    def check(self, job) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"backend.engine={self.engine!r}: allowed: {', '.join(ENGINES)}")
        if job.data.loss not in LOSSES:
            raise ConfigError(f"data.loss={job.data.loss!r}: allowed: {', '.join(LOSSES)}")
        if job.trainer.precision == Precision.fp16:
            raise ConfigError("trainer.precision=fp16 is not offered by backend=runner yet; allowed: fp32")
        wanted = job.trainer.num_workers * self.cpus_per_worker
        if self.ray_address is None and wanted > (os.cpu_count() or 1):
            raise ConfigError(f"trainer.num_workers={job.trainer.num_workers} x backend.cpus_per_worker="
                              f"{self.cpus_per_worker} asks for {wanted:g} CPUs; this machine has {os.cpu_count()}")

    def fit(self, job) -> None:
        # Ray Train's report() otherwise waits up to its 2 s health-check interval.
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
        if self.ray_address is None:
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1
        import ray
        from omegaconf import OmegaConf
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        if not ray.is_initialized():
            ray.init(address=self.ray_address, include_dashboard=False, configure_logging=False,
                     log_to_driver=True)
        have = ray.cluster_resources().get("CPU", 0)
        wanted = job.trainer.num_workers * self.cpus_per_worker
        if wanted > have:
            raise ConfigError(f"trainer.num_workers={job.trainer.num_workers} asks for {wanted:g} CPUs; "
                              f"the Ray cluster has {have:g}")
        config = {"cfg": OmegaConf.to_container(job.cfg, resolve=True, enum_to_str=True),
                  "out_dir": str(job.out_dir.resolve()), "run_id": job.tracker.run_id if job.tracker else None,
                  "uri": absolute_uri(job.cfg.tracking.uri)}
        trainer = TorchTrainer(
            worker_loop, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=job.trainer.num_workers, use_gpu=self.use_gpu,
                                         resources_per_worker={"CPU": self.cpus_per_worker}),
            run_config=RunConfig(name="runner", storage_path=str((job.out_dir / "ray").resolve())))
        result = trainer.fit()
        with result.checkpoint.as_directory() as folder:
            summary = json.loads((Path(folder) / "summary.json").read_text())
        job.history.update({k: [tuple(p) for p in v] for k, v in summary["history"].items()})
        job.final.update(summary["final"])

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        return read_checkpoint(path)


def worker_loop(config: dict) -> None:
    """One data-parallel worker: the TrainingRunner loop."""
    import ray.train
    from omegaconf import OmegaConf
    from torch.nn.parallel import DistributedDataParallel as DDP

    from orchestrate import schema
    from orchestrate.job import Job
    from orchestrate.tracking import RunLogger

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    cfg = OmegaConf.merge(OmegaConf.structured(schema.Config), config["cfg"])
    threads = max(1, int(cfg.backend.cpus_per_worker))
    torch.set_num_threads(threads)  # sized to the CPUs Ray gave this worker: no oversubscription
    if rank != 0:
        cfg.trainer.progress = False
    job = Job.prepare(cfg, Path(config["out_dir"]))  # same seed: same initial weights on every rank
    if rank == 0 and config["run_id"]:
        job.tracker = RunLogger(config["uri"], config["run_id"])
    t, K = job.trainer, job.trainer.gradient_accumulation_steps
    job.samples_per_step = t.batch_size * K * world  # throughput is the sum over workers

    plain = job.model
    model = plain
    if cfg.backend.engine == "ortmodule":
        from orchestrate.backends.ortmodule import ORTModuleBackend

        model = ORTModuleBackend(intra_op_threads=threads).wrap(plain, job)
    ddp = DDP(model)
    optimizer = job.make_optimizer(ddp.parameters())
    scheduler = make_scheduler(optimizer, job)
    loss_fn = LOSSES[job.data.loss]
    if rank == 0 and job.tracker:
        job.log({"world_size": world, "effective_batch_size": job.samples_per_step}, step=0)

    for step in job.steps():
        loss_sum = 0.0
        for micro in range(K):
            x, y = job.data.train_batch((step - 1) * K + micro, t.batch_size, t.seed, rank, world)
            # GradientAccumulateStep: no AllReduce until the last micro-batch (ModelUpdateStep).
            with ddp.no_sync() if micro < K - 1 else contextlib.nullcontext():
                loss = loss_fn(ddp(x), y) / K
                loss.backward()
            loss_sum += loss.item()
        if job.due(step, t.display_loss_steps):
            grads = [p.grad for p in ddp.parameters() if p.grad is not None]
            job.log({"train/grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item(),
                     "train/param_norm": torch.linalg.vector_norm(
                         torch.stack([p.detach().norm() for p in ddp.parameters()])).item()}, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

        job.record(step, loss_sum)
        if rank == 0:
            job.evaluate(step, lambda: evaluate(plain, job))
            job.checkpoint(step, lambda path: save_checkpoint(path, step, plain, optimizer, scheduler), suffix=".pt")

    summary = job.summary()
    if rank == 0:
        job.save_model(lambda path: export_onnx(plain, job.data.sample_input(), path))
        if job.tracker:
            job.tracker.flush()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            (Path(folder) / "summary.json").write_text(json.dumps({"history": job.history, "final": summary}))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"step": t.max_steps}, checkpoint=checkpoint)
