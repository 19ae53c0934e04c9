"""The PyTorch eager baseline: the loop every other backend is compared with.

    python -m orchestrate backend=torch
"""

import io
import random
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


def save_checkpoint(path: Path, step: int, model: torch.nn.Module, optimizer, scheduler, job,
                    world_size: int = 1, scaler=None) -> None:
    """Everything a resume needs (the list of ORT's TrainingRunner): the weight-update count, the
    forward/backward passes done and where they leave the data (round = epoch, index within it),
    weights, optimizer, schedule and loss-scaler state, and every RNG state."""
    micro_steps = step * job.trainer.gradient_accumulation_steps
    round_, index = job.data.epoch_of(micro_steps, job.trainer.batch_size, world_size)
    np_state = np.random.get_state()
    torch.save({
        "step": step,  # weight updates done (ORT: weight_update_step_count_)
        "micro_steps": micro_steps,  # forward/backward passes done (ORT: step_), also the data position
        "round": round_,  # passes over the training data (ORT: round_)
        "data_index": index,  # next batch within this pass (ORT: training_data_set_index_)
        "world_size": world_size,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler else None,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }, path)


def load_state(source: Path | bytes) -> dict:
    """A checkpoint written by `save_checkpoint`, from a file or its bytes (weights only: no code
    runs on load)."""
    f = io.BytesIO(source) if isinstance(source, bytes) else source
    return torch.load(f, map_location="cpu", weights_only=True)


def restore_training_state(state: dict, optimizer, scheduler, scaler=None) -> int:
    """Put optimizer, schedule, loss scaler and RNG back as they were; returns the step to go on from."""
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state((rng["numpy"][0], rng["numpy"][1].numpy().astype(np.uint32), *rng["numpy"][2:]))
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


def read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v.numpy() for k, v in state["model"].items()}


@dataclass
class TorchBackend(Backend):
    name: str = "torch"
    resumable = True
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
        state = load_state(job.resume_from) if job.resume_from else None
        if state is not None:
            job.model.load_state_dict(state["model"])  # before wrapping: ORTModule exports these weights
        plain = job.model.to(device)  # keep the unwrapped module: checkpoints and export use it
        model = self.wrap(plain, job)
        optimizer = self.make_optimizer(model, job)
        scheduler = make_scheduler(optimizer, job)
        loss_fn = LOSSES[job.data.loss]
        # fp16 (CUDA only): autocast the forward, scale the loss so small gradients survive.
        fp16 = job.trainer.precision == Precision.fp16
        scaler = torch.amp.GradScaler("cuda", enabled=fp16)
        done = restore_training_state(state, optimizer, scheduler, scaler) if state is not None else 0
        model.train()

        for step in job.steps(start=done + 1):
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
            job.checkpoint(step, lambda path: save_checkpoint(path, step, plain, optimizer, scheduler, job,
                                                              scaler=scaler), suffix=".pt")

        job.save_model(lambda path: export_onnx(plain, job.data.sample_input().to(device), path))

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        return read_checkpoint(path)
