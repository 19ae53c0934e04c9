"""The PyTorch eager baseline: the loop every other backend is compared with.

    python -m orchestrate backend=torch
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from orchestrate.backends.base import Backend
from orchestrate.schema import ConfigError, LRSchedule, Precision

# Models return logits (..., C): flatten them to (N, C) so that per-token (language model) and
# per-sample (classifier) targets go through the same loss.
LOSSES = {
    "cross_entropy": lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
}


def accuracy(out: torch.Tensor, y: torch.Tensor, loss: str) -> float | None:
    """Share of correct predictions (classes or, for multi-label, individual labels)."""
    if loss == "cross_entropy":
        return (out.argmax(dim=-1) == y).float().mean().item()
    if loss == "bce_with_logits":
        return ((out > 0).float() == y).float().mean().item()
    return None  # regression: no accuracy


@torch.no_grad()
def evaluate(model: torch.nn.Module, job) -> tuple[float, float | None]:
    """Mean loss and accuracy over the whole eval split, weighted by batch size."""
    model.eval()
    loss_fn, device = LOSSES[job.data.loss], job.trainer.device.value
    total, loss_sum, acc_sum = 0, 0.0, 0.0
    for x, y in job.data.eval_batches(job.trainer.eval_batch_size):
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += loss_fn(out, y).item() * len(x)
        acc = accuracy(out, y, job.data.loss)
        acc_sum += (acc or 0.0) * len(x)
        total += len(x)
    model.train()
    return loss_sum / total, (acc_sum / total if acc is not None else None)


def export_onnx(model: torch.nn.Module, sample: torch.Tensor, path: Path, opset: int = 17, training: bool = False) -> None:
    """Export with a dynamic batch dimension, input `input`, output `logits`."""
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    was_training = model.training
    model.train(training)
    torch.onnx.export(model, (sample,), str(path), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
                      training=mode, do_constant_folding=not training, export_params=True)
    model.train(was_training)


def make_scheduler(optimizer: torch.optim.Optimizer, job):
    """The job's schedule as a LambdaLR, or None when the rate is constant (LambdaLR costs tens of
    microseconds a step)."""
    if job.trainer.lr_schedule == LRSchedule.constant:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, job.lr_factor)


def save_checkpoint(path: Path, step: int, model: torch.nn.Module, optimizer, scheduler) -> None:
    """What a resume needs: step, weights, optimizer and schedule state, RNG state."""
    torch.save({
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler else None,
        "rng": torch.get_rng_state(),
    }, path)


def read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v.numpy() for k, v in state["model"].items()}


@dataclass
class TorchBackend(Backend):
    name: str = "torch"
    intra_op_threads: int = 0  # torch.set_num_threads; 0 keeps PyTorch's default (one per core)

    def check(self, job) -> None:
        if job.data.loss not in LOSSES:
            raise ConfigError(f"data.loss={job.data.loss!r}: allowed: {', '.join(LOSSES)}")

    # The two hooks ORTModule overrides: everything else in the loop is plain PyTorch.
    def wrap(self, model: torch.nn.Module, job) -> torch.nn.Module:
        return model

    def make_optimizer(self, model: torch.nn.Module, job) -> torch.optim.Optimizer:
        return job.make_optimizer(model.parameters())

    def fit(self, job) -> None:
        if self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        device = job.trainer.device.value
        plain = job.model.to(device)  # keep the unwrapped module: checkpoints and export use it
        model = self.wrap(plain, job)
        optimizer = self.make_optimizer(model, job)
        scheduler = make_scheduler(optimizer, job)
        loss_fn = LOSSES[job.data.loss]
        # fp16 (CUDA only): autocast the forward, scale the loss so small gradients survive.
        fp16 = job.trainer.precision == Precision.fp16
        scaler = torch.amp.GradScaler("cuda", enabled=fp16)
        model.train()

        for step in job.steps():
            x, y = job.train_batch(step)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type=device, dtype=torch.float16, enabled=fp16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()

            job.record(step, loss.item())
            job.evaluate(step, lambda: evaluate(model, job))
            job.checkpoint(step, lambda path: save_checkpoint(path, step, plain, optimizer, scheduler), suffix=".pt")

        job.save_model(lambda path: export_onnx(plain, job.data.sample_input().to(device), path))

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        return read_checkpoint(path)
