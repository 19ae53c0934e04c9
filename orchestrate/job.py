"""What a backend gets: the built data, model and settings, plus the bookkeeping every training
loop shares (batches, learning-rate schedule, progress bar, metrics, checkpoints), so that each
backend file holds only its own loop."""

import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from orchestrate import schema
from orchestrate.schema import LRSchedule


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Job:
    cfg: DictConfig
    backend: Any  # orchestrate.backends.base.Backend
    data: Any  # orchestrate.tasks.data.TensorData
    model: torch.nn.Module
    out_dir: Path
    tracker: Any = None  # orchestrate.tracking.Tracker, attached once the run starts
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    final: dict[str, float] = field(default_factory=dict)
    resume_from: Path | None = None  # trainer.resume: the checkpoint to continue from
    logged_through: dict[str, int] = field(default_factory=dict)  # resumed run: last step in MLflow, per metric
    tensorboard: Any = None  # trainer.tensorboard: a SummaryWriter, opened at the first logged metric

    @classmethod
    def prepare(cls, cfg: DictConfig, out_dir: Path) -> "Job":
        """Build everything from the config and refuse bad input, before any compute."""
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
        self.samples_per_step = self.trainer.batch_size  # the runner: batch x accumulation x workers

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        return schema.build(self.cfg.optimizer, "optimizer", params)

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base learning rate for update number `step` (0-based)."""
        t = self.trainer
        if t.lr_schedule == LRSchedule.constant:
            return 1.0
        if step < t.warmup_steps:
            return step / max(1, t.warmup_steps)
        progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        if t.lr_schedule == LRSchedule.linear:
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def train_batch(self, step: int, rank: int = 0, world_size: int = 1):
        """The batch for 1-based `step`: batch number step-1 of the seeded order."""
        return self.data.train_batch(step - 1, self.trainer.batch_size, self.trainer.seed, rank, world_size)

    def due(self, step: int, period: int) -> bool:
        """Periodic work happens every `period` steps and always after the last one."""
        return step == self.trainer.max_steps or (period > 0 and step % period == 0)

    # ---- the loop's bookkeeping --------------------------------------------------------------
    def steps(self, start: int = 1) -> Iterator[int]:
        """Yield 1-based step numbers with a progress bar; time the steps between displays,
        leaving out the time spent in `evaluate` and `checkpoint`."""
        t = self.trainer
        self._window_loss, self._window_steps, self._excluded = 0.0, 0, 0.0
        self._window_start = self._run_start = time.perf_counter()
        self._timed_steps, self._timed_seconds = 0, 0.0
        self._bar = tqdm(total=t.max_steps, initial=start - 1, disable=not t.progress, unit="step",
                         dynamic_ncols=True, mininterval=0.2 if os.isatty(2) else 10.0,
                         desc=self.backend.name)
        try:
            for step in range(start, t.max_steps + 1):
                yield step
                self._bar.update()
        finally:
            self._bar.close()
        self.final["wall_time_s"] = time.perf_counter() - self._run_start

    def record(self, step: int, loss: float) -> None:
        """Call after every step with its loss; logs at every `display_loss_steps`."""
        self._window_loss += loss
        self._window_steps += 1
        if not self.due(step, self.trainer.display_loss_steps):
            return
        now = time.perf_counter()
        seconds = now - self._window_start - self._excluded
        mean_loss = self._window_loss / self._window_steps
        metrics = {
            "train/loss": mean_loss,
            "perf/samples_per_sec": self._window_steps * self.samples_per_step / seconds,
            "perf/step_time_ms": 1000.0 * seconds / self._window_steps,
            "lr": self.lr * self.lr_factor(step - 1),
        }
        # The first window holds graph builds and warm-up: it is logged, not counted in the totals.
        if self._timed_steps or self._window_steps == self.trainer.max_steps or step > self.trainer.display_loss_steps:
            self._timed_steps += self._window_steps
            self._timed_seconds += seconds
        self.log(metrics, step)
        self.final["train_loss"] = mean_loss
        self._bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{metrics['perf/samples_per_sec']:,.0f}", refresh=False)
        self._window_loss, self._window_steps, self._excluded = 0.0, 0, 0.0
        self._window_start = time.perf_counter()

    def evaluate(self, step: int, run_eval: Callable[[], tuple[float, float | None]]) -> None:
        """Run `run_eval() -> (loss, accuracy or None)` at evaluation steps and log the result."""
        if not self.due(step, self.trainer.evaluation_period):
            return
        began = time.perf_counter()
        loss, accuracy = run_eval()
        metrics = {"eval/loss": loss}
        if accuracy is not None:
            metrics["eval/accuracy"] = accuracy
        self.log(metrics, step)
        self.final.update({k.replace("/", "_"): v for k, v in metrics.items()})
        msg = f"step {step}: eval loss {loss:.4f}" + (f", accuracy {accuracy:.4f}" if accuracy is not None else "")
        self._bar.write(f"[{self.backend.name}] {msg}")
        self._excluded += time.perf_counter() - began

    def checkpoint(self, step: int, write: Callable[[Path], None], suffix: str) -> Path | None:
        """At checkpoint steps, `write(path)` a checkpoint. It is written to a temporary name and
        renamed, so a crash never leaves a half-written file where a finished one was expected."""
        if not self.due(step, self.trainer.checkpoint_period):
            return None
        began = time.perf_counter()
        folder = self.out_dir / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{step:07d}{suffix}"
        tmp = folder / f".tmp_step_{step:07d}{suffix}"
        write(tmp)
        os.replace(tmp, path)
        for old in sorted(folder.glob(f"step_*{suffix}"))[: -self.trainer.max_num_checkpoints]:
            old.unlink()
        if self.tracker is not None and self.cfg.tracking.log_checkpoints:
            self.tracker.log_artifact(path, "checkpoints")
        self._excluded += time.perf_counter() - began
        return path

    def save_model(self, write: Callable[[Path], None]) -> Path:
        """Save the trained model as ONNX for inference (`model.onnx`) and log it; the end of
        training, so the TensorBoard event files are complete and logged too."""
        path = self.out_dir / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
        if self.tracker is not None:
            self.tracker.log_artifact(path)
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tracker.log_artifacts(self.out_dir / "tensorboard", "tensorboard")
        return path

    def summary(self) -> dict[str, float]:
        if getattr(self, "_timed_steps", 0):
            self.final["samples_per_sec"] = self._timed_steps * self.samples_per_step / self._timed_seconds
            self.final["step_time_ms"] = 1000.0 * self._timed_seconds / self._timed_steps
        return dict(self.final)

    def continue_history(self, logged: dict[str, list[tuple[int, float]]]) -> None:
        """A resumed run: take over the curves already in MLflow, and log no step of them again
        (the steps between the last checkpoint and a crash were logged before it)."""
        self.history = {k: list(v) for k, v in logged.items()}
        self.logged_through = {k: v[-1][0] for k, v in logged.items() if v}

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Keep `metrics` in the history (for the loss-curve chart) and send them to MLflow."""
        if self.logged_through:
            metrics = {k: v for k, v in metrics.items() if step > self.logged_through.get(k, -1)}
        for k, v in metrics.items():
            self.history.setdefault(k, []).append((step, v))
        if self.tracker is not None and metrics:
            self.tracker.log_metrics(metrics, step)
            if self.trainer.tensorboard:
                self._tensorboard(metrics, step)

    def _tensorboard(self, metrics: dict[str, float], step: int) -> None:
        """trainer.tensorboard: the same scalars as TensorBoard events in <outputs>/tensorboard."""
        if self.tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.out_dir / "tensorboard"))
        for k, v in metrics.items():
            self.tensorboard.add_scalar(k, v, step)
