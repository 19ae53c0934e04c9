"""The PyTorch loop: the eager baseline every other backend is compared with, and the one loop
that ORTModule and the runner's workers run too.

    python -m orchestrate backend=torch

Subclasses change three hooks, not the loop: `wrap` (ORTModule wraps the model),
`make_optimizer` and `seed_step`. On the runner's workers (`job.parallel`) the same loop is ORT's
TrainingRunner step: K-1 GradientAccumulateSteps (forward and backward, no AllReduce), then the
ModelUpdateStep (forward, backward, AllReduce, optimizer step, schedule step). With one process
(K = 1, no workers) every one of those hooks does nothing.
"""

import contextlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import torch

from orchestrate import checkpoints, ort, thirdparty
from orchestrate.backends.base import Backend
from orchestrate.schema import AT_LEAST_0, ConfigError, LRSchedule, Precision
from orchestrate.tasks import losses
from orchestrate.tasks.prefetch import DeviceBatches


@dataclass
class TorchBackend(Backend):
    name: str
    # torch.set_num_threads; None: the run's CPU budget (orchestrate.cpu), 0: PyTorch's default (one per core)
    intra_op_threads: Annotated[int | None, AT_LEAST_0]
    # torch.optim's fused optimizer (one kernel for the update, Job.make_optimizer) unless
    # optimizer.fused is set: it also skips a nan step's update on the device, so no step waits.
    fused_optimizer: bool = field(default=True, kw_only=True)  # a default: a user's subclass file may leave it out
    resumable = True
    data_parallel = True
    stages = True  # trains one pipeline stage of the model on the runner (trainer.pipeline_parallel_size)
    precisions = ("fp32", "fp16", "bf16")

    def check(self, job) -> None:
        if job.data.loss not in losses.LOSSES:
            raise ConfigError(f"data.loss={job.data.loss!r}: allowed: {', '.join(losses.LOSSES)}")

    # The hooks ORTModule overrides: everything else in the loop is plain PyTorch.
    def wrap(self, model: torch.nn.Module, job) -> torch.nn.Module:
        return model

    def make_optimizer(self, model: torch.nn.Module, job) -> torch.optim.Optimizer:
        return job.make_optimizer(model.parameters(), fused=self.fused_optimizer)

    def seed_step(self, step: int, job) -> None:
        """Before each step: nothing here (torch's generator state travels in the checkpoint)."""

    def fit(self, job) -> None:
        job.use_cores(self)  # torch's threads and the loader's processes; put back when the run ends
        meter, parallel, device, t = job.meter, job.parallel, job.device, job.trainer
        K, weight = job.micro_batches, job.loss_weight  # this rank's micro-batches a step (above 1 on the runner)
        state = job.resume_state
        if state is not None:
            job.model.load_state_dict(state["model"])  # before wrapping: ORTModule exports these weights
        plain = job.model.to(device)  # keep the unwrapped module: checkpoints and export use it
        # The part this rank trains: the whole model, or on the runner's pipeline its stage.
        model = parallel.wrap(self.wrap(parallel.part(plain, job.data.sample_input), job))
        optimizer = self.make_optimizer(model, job)
        scheduler = make_scheduler(optimizer, t)
        loss_fn = losses.get(job.data.loss).torch
        # fp16 (CUDA only): autocast the forward; the dynamic loss scaler grows the scale while
        # gradients stay finite and halves it, skipping the update, when they overflow. bf16 has
        # fp32's exponent range: autocast alone, no scaler. fp32 on CUDA: TF32 matrix products
        # unless trainer.tf32=false (put back when the run ends: orchestrate.process).
        fp16 = t.precision == Precision.fp16
        scaler = torch.amp.GradScaler("cuda", enabled=fp16)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = t.tf32
        # (A disabled autocast still costs ~5 us a step: a small model's step is ~1 ms.)
        half = {Precision.fp16: torch.float16, Precision.bf16: torch.bfloat16}.get(t.precision)
        autocast = torch.autocast(device_type=device.type, dtype=half) if half else contextlib.nullcontext()
        done = checkpoints.restore_torch(parallel.own_part(state), optimizer, scheduler, scaler, job) if state is not None else 0
        model.train()

        def export(path: Path) -> None:  # the model as ONNX for inference: at checkpoints and at the end
            export_onnx(plain, job.data.sample_input().to(device), path, log_level=getattr(self, "log_level", "ERROR"))

        # Nothing in a step waits for the device but at reading steps (display, evaluation,
        # checkpoint: Meter.reads): the loss stays a tensor, the next batch is on its way
        # (DeviceBatches), and a nan or inf loss holds the update on the device when the optimizer
        # can skip it there (a fused torch.optim one: `update`); with any other optimizer the loss
        # is read every step.
        on_device = holds_on_device(optimizer)
        batches = DeviceBatches(job)
        grads = lambda: [p.grad for p in model.parameters()]  # noqa: E731 - the runner's guard reads them
        for step in meter.steps(start=done + 1):
            self.seed_step(step, job)
            if parallel.stages > 1:  # the step's micro-batches through the stages, in the schedule's order
                loss_sum = parallel.run(model, lambda micro: batches.get(step, micro),  # noqa: B023
                                        lambda out, y: loss_fn(out, y) * weight, K)
            else:
                loss_sum = None
                for micro in range(K):
                    x, y = batches.get(step, micro)
                    with parallel.accumulating(model, last=micro == K - 1):
                        with autocast:
                            loss = loss_fn(model(x), y)
                        if weight != 1:  # the mean over the step's global batch (no extra op on the usual path)
                            loss = loss * weight
                        scaler.scale(loss).backward()
                    loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            display, grad_norm = meter.displaying(step), None
            if display:
                scaler.unscale_(optimizer)  # the norms of the true gradients (a no-op in fp32)
                found = parallel.norms(norms(model, scaler if fp16 else None))
                meter.histograms(plain.named_parameters(), step)  # trainer.tensorboard: weights' and gradients' histograms
                meter.log(found, step)
                if not fp16:  # in fp16 an overflowing gradient is the loss scaler's to skip
                    grad_norm = found.get("train/grad_norm")
            # A nan or inf loss stops the run (or, with trainer.on_nonfinite=skip, drops this
            # update) before the weights change: every rank decides alike.
            update(optimizer, scaler, meter.record(step, loss_sum, grad_norm, grads, on_device=on_device))
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
            if display:
                meter.log(parallel.replica_metrics(model.parameters()), step)
            saved = parallel.assemble(step, optimizer, t)  # the whole model where read; the optimizer a checkpoint holds
            meter.evaluate(step, lambda: evaluate(plain, job))
            job.checkpoints.save(step, lambda path: checkpoints.save_torch(path, step, plain, saved, scheduler,  # noqa: B023
                                                                          job, scaler=scaler), suffix=".pt", export=export)
            if meter.stop_early(step):  # a pruning sweep's pruner stopped this trial
                break

        if parallel.logging:
            job.export_model(export)

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        return checkpoints.torch_parameters(path)

    def load_checkpoint(self, source: Path | bytes) -> dict:
        return checkpoints.load_torch(source)


def holds_on_device(optimizer) -> bool:
    """Whether `optimizer.step()` can skip an update on the device: torch.optim's fused
    implementations take a `found_inf` flag (GradScaler's overflow flag) and skip when it is 1.0."""
    return bool(getattr(optimizer, "defaults", {}).get("fused"))


def update(optimizer, scaler, held) -> None:
    """The step's update unless `held` (Meter.record) holds it: True skips it here; a flag on the
    device goes to the fused optimizer as its `found_inf`, which skips it there (its step count
    too). In fp16 the loss scaler hands the optimizer its own overflow flag, from the gradients: a
    held step's first gradient is made nan (on the device, an addition of 0 otherwise), so the
    scaler skips it and, as for an overflow, backs the scale off."""
    if held is True:
        return
    if held is not False and not scaler.is_enabled():
        thirdparty.fused_step(optimizer, found_inf=held)
        return
    if held is not False:
        grad = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
        grad.add_(torch.where(held.to(grad.device) > 0, float("nan"), 0.0).to(grad.dtype))
    scaler.step(optimizer)
    scaler.update()


def make_scheduler(optimizer: torch.optim.Optimizer, trainer):
    """The trainer's schedule as a LambdaLR, or None when the rate is constant (LambdaLR costs tens
    of microseconds a step)."""
    if trainer.lr_schedule == LRSchedule.constant:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, trainer.lr_factor)


def norms(model: torch.nn.Module, scaler=None) -> dict[str, float]:
    """Gradient and parameter norms (and the fp16 loss scale), logged at display steps."""
    params = [p.detach() for p in model.parameters()]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    found = {"train/param_norm": torch.nn.utils.get_total_norm(params)}
    if grads:
        found["train/grad_norm"] = torch.nn.utils.get_total_norm(grads)
    out = dict(zip(found, torch.stack([v.float() for v in found.values()]).tolist()))  # one read of both
    if scaler is not None:
        out["train/loss_scale"] = scaler.get_scale()
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, job) -> tuple[float, float | None]:
    """Mean loss and accuracy over the whole eval split, weighted by batch size."""
    model.eval()
    loss = losses.get(job.data.loss)
    total, loss_sum, acc_sum = 0, 0.0, 0.0
    for x, y in job.data.eval_batches(job.trainer.eval_batch_size):
        x, y = x.to(job.device), y.to(job.device)
        out = model(x)
        loss_sum += loss.torch(out, y).item() * len(x)
        if loss.accuracy is not None:
            acc_sum += loss.accuracy(out, y) * len(x)
        total += len(x)
    model.train()
    return loss_sum / total, (acc_sum / total if loss.accuracy is not None else None)


def export_for_training(model: torch.nn.Module, sample: torch.Tensor, opset: int,
                        log_level: str = "ERROR") -> tuple[bytes, dict]:
    """The model as ORT's training paths export it (training mode, no constant folding, input
    `input`, output `logits`, a dynamic batch): the ONNX bytes, and the model's buffers as they were
    before. The exporter traces one training-mode forward: BatchNorm updates its running statistics
    from it and Dropout draws from torch's RNG; both are put back (the model stays as built). The
    exporter's warnings go to the log, the console from `log_level` up (`ort.exporting`)."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    was_training = model.training
    model.train()
    out = io.BytesIO()
    # dynamo=False here and in export_onnx: TorchScript's exporter, torch 2.6's default and what ORT's
    # artifact builder was made for; torch 2.9 on default to the dynamo exporter (and onnxscript).
    try:
        with torch.random.fork_rng(devices=[]), ort.exporting(log_level):
            torch.onnx.export(model, (sample,), out, input_names=["input"], output_names=["logits"],
                              dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              export_params=True, dynamo=False)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        model.train(was_training)
    return out.getvalue(), buffers


def export_onnx(model: torch.nn.Module, sample: torch.Tensor, path: Path, opset: int = 17,
                log_level: str = "ERROR") -> None:
    """Export for inference with a dynamic batch dimension, input `input`, output `logits`, whose
    shapes the graph declares as the model gives them (`declare_shape`). The exporter's warnings
    (the tracer's TracerWarning on the character transformer) go to the run's log file, and to the
    console from `log_level` (the backend's, a LEVELS name) up: `ort.exporting`."""
    import onnx

    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(sample)
    with ort.exporting(log_level):
        torch.onnx.export(model, (sample,), str(path), input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
                          training=torch.onnx.TrainingMode.EVAL, export_params=True, dynamo=False)
    model.train(was_training)
    exported = onnx.load(str(path))
    declare_shape(exported.graph.input[0], sample.shape)
    declare_shape(exported.graph.output[0], logits.shape)
    onnx.save(exported, str(path))


def declare_shape(value, shape) -> None:
    """Declare the shape of an ONNX graph input or output (a ValueInfoProto): the first dimension
    symbolic (`batch`), the others `shape`'s. Exporters leave some of them symbolic where they
    cannot follow the size (torch's tracer: a language model's sequence length; ORT's eval graph:
    a Hugging Face classifier's classes): with the sizes written in, model.onnx reads the same
    whichever backend wrote it."""
    dims = value.type.tensor_type.shape.dim
    del dims[:]
    dims.add().dim_param = "batch"
    for size in shape[1:]:
        dims.add().dim_value = size
