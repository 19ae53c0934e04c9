"""ORT's on-device training API (seed 000): artifacts, then Module / Optimizer / CheckpointState.

    python -m orchestrate backend=ondevice
    python -m orchestrate backend=ondevice 'backend.frozen_params=[net.0.*]'   # fine-tune the rest

The story: export the PyTorch model to ONNX in training mode; `generate_artifacts` adds the loss,
the gradient graph and an optimizer graph; then the loop `module.train()`, `module(batch)`,
`optimizer.step()`, `module.lazy_reset_grad()`, with `module.eval()` at evaluation steps,
`CheckpointState.save_checkpoint` at checkpoint steps and `export_model_for_inferencing` at the end.
"""

import fnmatch
import io
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from orchestrate.backends.base import Backend
from orchestrate.schema import ConfigError, Device, LRSchedule, Precision

# data.loss -> onnxblock loss (ORT's LossType names)
LOSSES = {"cross_entropy": "CrossEntropyLoss", "mse": "MSELoss", "bce_with_logits": "BCEWithLogitsLoss", "l1": "L1Loss"}
OPTIMIZERS = ("AdamW", "SGD")  # what ORT's optimizer blocks offer
ADAMW_MODES = {"torch": 0, "hf": 1}  # the AdamWOptimizer op's adam_mode attribute


def stable_bce_with_logits():
    """BCE with logits as max(x, 0) - x*y + log(1 + exp(-|x|)), written with onnxblock's blocks
    as (x + |x|)/2 - x*y - log(sigmoid(|x|)). ORT's own BCEWithLogitsLoss block computes
    log(sigmoid(x)) and log(1 - sigmoid(x)), which turn into NaN once a logit passes about 17."""
    from onnxruntime.training.onnxblock import Block, blocks

    class StableBCEWithLogits(Block):
        def build(self, x: str, target: str = "target") -> str:
            y = blocks.InputLike(x)(target)  # a new graph input shaped like the logits
            abs_x = blocks.Abs()(x)
            relu_x = blocks.Mul()(blocks.Add()(x, abs_x), blocks.Constant(0.5)())
            softplus = blocks.Neg()(blocks.Log()(blocks.Sigmoid()(abs_x)))
            return blocks.ReduceMean(keepdims=False)(blocks.Add()(blocks.Sub()(relu_x, blocks.Mul()(x, y)), softplus))

    return StableBCEWithLogits()


def _providers() -> list[str]:
    import onnxruntime

    return onnxruntime.get_available_providers()


class _FlatLogits(torch.nn.Module):
    """ORT's CrossEntropyLoss block takes (N, C) logits: a language model's (B, T, C) output is
    flattened before the loss (its labels are flattened to (B*T,) to match)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return out.reshape(-1, out.shape[-1])


@dataclass
class OnDeviceBackend(Backend):
    name: str = "ondevice"
    opset: int = 15  # opset 17 breaks ORT 1.19's LayerNormalization gradient; 14-16 work
    # ORT's default (a thread per core, spinning) ran the digits MLP at 29.5k samples/s on 2 cores,
    # one intra-op thread at 113k: one thread is the default here.
    intra_op_threads: int = 1
    allow_spinning: bool = True
    frozen_params: list[str] = field(default_factory=list)  # fnmatch patterns of parameter names to freeze
    # ORT's AdamW block defaults to Hugging Face's AdamW (adam_mode=1: weight decay after the update,
    # epsilon before bias correction). `torch` sets adam_mode=0, PyTorch's AdamW, so that backends
    # compare like with like.
    adamw_mode: str = "torch"
    mapped_dimensions: dict[str, int] = field(default_factory=dict)  # e.g. {batch: 64}: fix a symbolic dimension

    def check(self, job) -> None:
        if job.data.loss not in LOSSES:
            raise ConfigError(f"data.loss={job.data.loss!r}: the on-device API offers {', '.join(LOSSES)}")
        opt = job.cfg.optimizer
        kind = opt._target_.rsplit(".", 1)[-1]
        if kind not in OPTIMIZERS:
            raise ConfigError(f"optimizer._target_={opt._target_}: the on-device API offers torch.optim.AdamW "
                              "and torch.optim.SGD (optimizer=adamw or optimizer=sgd)")
        if kind == "SGD" and (opt.get("momentum", 0) or opt.get("weight_decay", 0)):
            raise ConfigError("optimizer.momentum and optimizer.weight_decay must be 0 with backend=ondevice: "
                              "ORT's SGD block is plain SGD")
        if self.adamw_mode not in ADAMW_MODES:
            raise ConfigError(f"backend.adamw_mode={self.adamw_mode!r}: allowed: {', '.join(ADAMW_MODES)}")
        if job.trainer.precision == Precision.fp16:
            raise ConfigError("trainer.precision=fp16 is not offered by backend=ondevice; allowed: fp32")
        if job.trainer.device == Device.cuda and "CUDAExecutionProvider" not in _providers():
            raise ConfigError("trainer.device=cuda needs the GPU build (pip install onnxruntime-training==1.19.2)")
        names = [n for n, _ in job.model.named_parameters()]
        for pattern in self.frozen_params:
            if not fnmatch.filter(names, pattern):
                raise ConfigError(f"backend.frozen_params: {pattern!r} matches no parameter; parameters: {', '.join(names)}")
        if names and all(any(fnmatch.fnmatch(n, p) for p in self.frozen_params) for n in names):
            raise ConfigError("backend.frozen_params freezes every parameter: nothing would train")

    def generate_artifacts(self, job, folder: Path) -> tuple[Path, str]:
        """Export the model and build the training, eval and optimizer graphs plus the initial
        checkpoint into `folder`. Returns the folder and the prefix of parameter names in it."""
        import onnx
        from onnxruntime.training import artifacts, onnxblock

        model, sample = job.model, job.data.sample_input()
        prefix = ""
        with torch.no_grad():
            if job.data.loss == "cross_entropy" and model(sample).dim() > 2:
                model, prefix = _FlatLogits(model), "model."
        buffer = io.BytesIO()
        model.train()
        torch.onnx.export(model, (sample,), buffer, input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=self.opset,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, export_params=True)
        onnx_model = onnx.load_from_string(buffer.getvalue())

        names = [n for n, _ in job.model.named_parameters()]
        frozen = [n for n in names if any(fnmatch.fnmatch(n, p) for p in self.frozen_params)]
        opt = job.cfg.optimizer
        if opt._target_.endswith("AdamW"):
            optimizer = onnxblock.optim.AdamW(betas=tuple(opt.get("betas", (0.9, 0.999))), eps=opt.get("eps", 1e-8),
                                              weight_decay=opt.get("weight_decay", 0.01))
        else:
            optimizer = onnxblock.optim.SGD()
        folder.mkdir(parents=True, exist_ok=True)
        artifacts.generate_artifacts(
            onnx_model,
            requires_grad=[prefix + n for n in names if n not in frozen],
            frozen_params=[prefix + n for n in frozen],
            loss=(stable_bce_with_logits() if job.data.loss == "bce_with_logits"
                  else getattr(artifacts.LossType, LOSSES[job.data.loss])),
            optimizer=optimizer,
            artifact_directory=folder,
            additional_output_names=["logits"],
        )
        self._set_adamw_mode(folder / "optimizer_model.onnx")
        return folder, prefix

    def _set_adamw_mode(self, path: Path) -> None:
        """The onnxblock hard-codes adam_mode=1; the op itself offers both modes."""
        import onnx

        model = onnx.load(str(path))
        for node in model.graph.node:
            for attribute in node.attribute:
                if node.op_type == "AdamWOptimizer" and attribute.name == "adam_mode":
                    attribute.i = ADAMW_MODES[self.adamw_mode]
        onnx.save(model, str(path))

    def fit(self, job, rank: int = 0, world_size: int = 1, sync=None) -> None:
        """The loop. The runner calls it on each of its workers with the worker's rank and a `sync`
        (orchestrate.backends.runner.OnDeviceSync) that all-reduces gradients before each
        optimizer step or averages the parameters after it; rank 0 alone evaluates and saves."""
        import onnxruntime
        from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

        # Rank 0's artifacts stay with the run; the runner's other workers build theirs aside.
        folder = job.out_dir / "artifacts" if rank == 0 else Path(tempfile.mkdtemp(prefix=f"ort_artifacts_rank{rank}_"))
        folder, self._prefix = self.generate_artifacts(job, folder)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.allow_spinning else "0")
        for name, value in self.mapped_dimensions.items():  # symbolic dimensions fixed, as in ORT's API
            options.add_free_dimension_override_by_name(name, value)
        state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        device=job.trainer.device.value, session_options=options)
        optimizer = Optimizer(str(folder / "optimizer_model.onnx"), module)
        optimizer.set_learning_rate(job.lr * job.lr_factor(0))
        t = job.trainer
        # ORT ships a linear warm-up/decay scheduler; other schedules set the rate by hand each step.
        # onnxruntime-training 1.19.2's Python wrapper hands its two step counts to the C++ side in
        # the wrong order (measured: warmup 3 of 10 steps ran as warmup 10 of 3), so they are passed
        # swapped here; tests/backends/test_parity.py checks the rates against torch's LambdaLR.
        scheduler = (LinearLRScheduler(optimizer, t.max_steps, t.warmup_steps, job.lr)
                     if t.lr_schedule == LRSchedule.linear else None)
        flat = self._prefix == "model."  # labels flattened to match _FlatLogits
        K = t.gradient_accumulation_steps  # above 1 only on the runner's workers
        module.train()

        for step in job.steps():
            loss_sum = 0.0
            for micro in range(K):  # each train step adds its gradients to ORT's buffers
                x, y = job.data.train_batch((step - 1) * K + micro, t.batch_size, t.seed, rank, world_size)
                loss, _ = module(x.numpy(), (y.reshape(-1) if flat else y).numpy())
                loss_sum += float(loss)
            if sync is not None:
                sync.before_update(step, state)  # all-reduce the gradients (data-parallel runner)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            elif t.lr_schedule != LRSchedule.constant:
                optimizer.set_learning_rate(job.lr * job.lr_factor(step))
            # Gradients are zeroed inside the next train step's graph, not by a separate pass.
            module.lazy_reset_grad()
            if sync is not None:
                sync.after_update(step, module)  # or average the parameters every N updates

            job.record(step, loss_sum / K)
            if rank == 0:
                job.evaluate(step, lambda: self.evaluate(module, job, flat))
                job.checkpoint(step, lambda path: CheckpointState.save_checkpoint(
                    state, str(path), include_optimizer_state=True), suffix=".ckpt")

        if rank == 0:
            job.save_model(lambda path: module.export_model_for_inferencing(str(path), ["logits"]))

    def evaluate(self, module, job, flat: bool) -> tuple[float, float | None]:
        """Forward only, through the eval graph that shares the training parameters."""
        module.eval()
        total, loss_sum, acc_sum = 0, 0.0, 0.0
        for x, y in job.data.eval_batches(job.trainer.eval_batch_size):
            y = y.reshape(-1) if flat else y
            loss, logits = module(x.numpy(), y.numpy())
            loss_sum += float(loss) * len(x)
            acc = None
            if job.data.loss == "cross_entropy":
                acc = float((logits.argmax(-1) == y.numpy()).mean())
            elif job.data.loss == "bce_with_logits":
                acc = float(((logits > 0) == (y.numpy() > 0.5)).mean())
            acc_sum += (acc or 0.0) * len(x)
            total += len(x)
        module.train()
        return loss_sum / total, (acc_sum / total if acc is not None else None)

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        from onnxruntime.training.api import CheckpointState

        state = CheckpointState.load_checkpoint(str(path))
        prefix = getattr(self, "_prefix", "")
        return {name[len(prefix):] if name.startswith(prefix) else name: p.data for name, p in state.parameters}
