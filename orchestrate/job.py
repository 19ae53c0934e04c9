"""What a backend's loop gets: the objects built from the config (data, model, backend), the
settings it reads (built once, plain objects, read-only), and the three helpers it reports to:
the meter (steps, progress, metrics), the checkpoints, and the data-parallel context (one
process unless the runner's workers say otherwise)."""

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from orchestrate import schema
from orchestrate.backends.base import Parallel
from orchestrate.checkpoints import Checkpoints
from orchestrate.meter import Meter
from orchestrate.tasks.data import DataSet


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Job:
    cfg: DictConfig
    backend: Any  # orchestrate.backends.base.Backend
    data: DataSet
    model: torch.nn.Module
    out_dir: Path
    parallel: Parallel = field(default_factory=Parallel)  # the runner's workers replace it
    resume_state: dict | None = None  # trainer.resume (or a restarted worker): the checkpoint to go on from

    @classmethod
    def prepare(cls, cfg: DictConfig, out_dir: Path | str) -> "Job":
        """Build everything from the config and refuse bad input (schema.ConfigError), before
        any compute; nothing is written."""
        schema.check(cfg)
        backend = schema.build(cfg.backend, "backend")
        data = schema.build(cfg.data, "data")
        # Same seed right before building the model: every backend starts from the same weights.
        seed_everything(cfg.trainer.seed)
        model = schema.build(cfg.model, "model")
        job = cls(cfg=cfg, backend=backend, data=data, model=model, out_dir=Path(out_dir))
        backend.check_workers(job)
        if cfg.trainer.resume and not backend.resumable:
            raise schema.ConfigError(f"trainer.resume={cfg.trainer.resume}: backend={backend.name} cannot load its "
                                     "checkpoints to continue; allowed with backend=torch, ortmodule or runner")
        backend.check(job)
        schema.target_of(cfg.optimizer, "optimizer")
        try:
            job.train_batch(1)  # the data set can serve this batch size
        except ValueError as e:
            raise schema.ConfigError(str(e)) from None
        return job

    def __post_init__(self) -> None:
        # Plain objects, not DictConfig: an OmegaConf attribute read costs microseconds, and the
        # loop reads these settings several times a step.
        self.trainer: schema.TrainerConf = OmegaConf.to_object(self.cfg.trainer)
        self.lr = float(self.cfg.optimizer.lr)
        self.device = torch.device(self.trainer.device.value)
        self.checkpoints = Checkpoints(self.trainer, self.out_dir / "checkpoints",
                                       log_to_tracker=self.cfg.tracking.log_checkpoints)
        self.meter = self.make_meter()

    def make_meter(self, logging: bool = True) -> Meter:
        t = self.trainer
        samples = t.batch_size * t.gradient_accumulation_steps * self.parallel.world_size
        return Meter(t, self.backend.name, self.lr, samples, self.out_dir, logging=logging,
                     paused=lambda: self.checkpoints.seconds)

    def track(self, tracker: Any) -> None:
        """Send metrics and checkpoints to this MLflow run from now on."""
        self.meter.tracker = self.checkpoints.tracker = tracker

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        return schema.build(self.cfg.optimizer, "optimizer", params)

    def train_batch(self, step: int, micro: int = 0):
        """This worker's share of micro-batch `micro` of 1-based `step`, from the seeded order:
        global batch number (step-1) x K + micro, so that K micro-batches of B on N workers read
        exactly the samples of one batch of K x N x B."""
        t, p = self.trainer, self.parallel
        position = (step - 1) * t.gradient_accumulation_steps + micro
        return self.data.train_batch(position, t.batch_size, t.seed, p.rank, p.world_size)

    def export_model(self, write) -> Path:
        """Save the trained model as ONNX for inference (`model.onnx`) and log it to the run."""
        path = self.out_dir / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
        if self.meter.tracker is not None:
            self.meter.tracker.log_artifact(path)
        return path
