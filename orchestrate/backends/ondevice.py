"""ORT's on-device training API: artifacts, then Module / Optimizer / CheckpointState.

    python -m orchestrate backend=ondevice
    python -m orchestrate backend=ondevice 'backend.frozen_params=[net.0.*]'   # fine-tune the rest

The story: export the PyTorch model to ONNX in training mode; `generate_artifacts` adds the loss,
the gradient graph and an optimizer graph; then the loop `module.train()`, `module(batch)`,
`optimizer.step()`, `module.lazy_reset_grad()`, with `module.eval()` at evaluation steps,
`CheckpointState.save_checkpoint` at checkpoint steps and `export_model_for_inferencing` at the end.
"""

import fnmatch
import inspect
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from orchestrate import losses, ort
from orchestrate.backends.base import Backend
from orchestrate.schema import ConfigError, Device, LRSchedule, Precision, shown, target_of

# ORT's optimizer blocks, by the torch class each mirrors, with the arguments the block reads (the
# learning rate goes to ORT's Optimizer). The config's arguments are checked by that torch class
# (orchestrate.job.check_optimizer); any other argument would be ignored by ORT.
OPTIMIZERS = {torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
              torch.optim.SGD: ("lr", "momentum", "weight_decay")}
ADAMW_MODES = {"torch": 0, "hf": 1}  # the AdamWOptimizer op's adam_mode attribute


def opset_range(model: torch.nn.Module) -> tuple[int, int, str]:
    """The ONNX opsets `backend.opset` may name with the installed packages, and why: from the
    opset that introduced SoftmaxCrossEntropyLoss (ORT's CrossEntropyLoss block emits it; below
    it ORT's gradient builder fails on plain Linear layers too) to the newest that both torch's
    exporter and onnx know. A model with LayerNorm stops below ONNX's own LayerNormalization op,
    whose gradient ORT 1.19 cannot build (measured: opsets 17-20 fail in generate_artifacts)."""
    import onnx.defs
    from torch.onnx import _constants  # torch names its exporter's opsets nowhere public

    first: dict[str, int] = {}
    for op in onnx.defs.get_all_schemas_with_history():
        if op.domain == "" and op.name in ("SoftmaxCrossEntropyLoss", "LayerNormalization"):
            first[op.name] = min(first.get(op.name, op.since_version), op.since_version)
    low = max(first["SoftmaxCrossEntropyLoss"], _constants.ONNX_MIN_OPSET)
    high = min(_constants.ONNX_MAX_OPSET, onnx.defs.onnx_opset_version())
    why = (f"torch's exporter knows {_constants.ONNX_MIN_OPSET}-{_constants.ONNX_MAX_OPSET}, onnx up to "
           f"{onnx.defs.onnx_opset_version()}, ORT's CrossEntropyLoss block needs {low}")
    if any(isinstance(m, torch.nn.LayerNorm) for m in model.modules()):
        high = min(high, first["LayerNormalization"] - 1)
        why += (f"; the model's LayerNorm exports as ONNX LayerNormalization from opset {high + 1}, "
                "which ORT 1.19 cannot differentiate")
    return low, high, why


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
    name: str
    opset: int  # opset 17 breaks ORT 1.19's LayerNormalization gradient; 14-16 work
    # ORT's default (a thread per core, spinning) ran the digits MLP at 29.5k samples/s on 2 cores,
    # one intra-op thread at 113k: conf/backend/ondevice.yaml sets one thread.
    intra_op_threads: int
    allow_spinning: bool
    log_level: str  # ORT's output on the console from this level up (ort.LEVELS); the log file has all
    frozen_params: list[str]  # fnmatch patterns of parameter names to freeze
    # ORT's AdamW block defaults to Hugging Face's AdamW (adam_mode=1: weight decay after the update,
    # epsilon before bias correction). `torch` sets adam_mode=0, PyTorch's AdamW, so that backends
    # compare like with like.
    adamw_mode: str
    mapped_dimensions: dict[str, int]  # e.g. {batch: 64}: fix a symbolic dimension
    data_parallel = True
    averaging = True

    def check(self, job) -> None:
        if job.data.loss not in losses.LOSSES:
            raise ConfigError(f"data.loss={job.data.loss!r}: the on-device API offers {', '.join(losses.LOSSES)}")
        opt = job.cfg.optimizer
        optimizer = target_of(opt, "optimizer")
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer._target_={opt._target_}: the on-device API offers torch.optim.AdamW "
                              "and torch.optim.SGD (optimizer=adamw or optimizer=sgd)")
        defaults = {n: p.default for n, p in inspect.signature(optimizer).parameters.items()}
        for name in opt:
            if name in defaults and name not in OPTIMIZERS[optimizer] and opt[name] != defaults[name]:
                raise ConfigError(f"optimizer.{name}={shown(opt[name])}: ORT's {optimizer.__name__} block ignores "
                                  f"it with backend=ondevice; allowed: {shown(defaults[name])} (torch's default), "
                                  "or drop the key")
        if optimizer is torch.optim.SGD and (opt.get("momentum", 0) or opt.get("weight_decay", 0)):
            raise ConfigError("optimizer.momentum and optimizer.weight_decay must be 0 with backend=ondevice: "
                              "ORT's SGD block is plain SGD")
        if self.adamw_mode not in ADAMW_MODES:
            raise ConfigError(f"backend.adamw_mode={self.adamw_mode!r}: allowed: {', '.join(ADAMW_MODES)}")
        if self.log_level not in ort.LEVELS:
            raise ConfigError(f"backend.log_level={self.log_level!r}: allowed: {', '.join(ort.LEVELS)}")
        if self.intra_op_threads < 0:
            raise ConfigError(f"backend.intra_op_threads={self.intra_op_threads}: allowed: 0 (ORT's default pool) "
                              "or a number of threads")
        low, high, why = opset_range(job.model)
        if not low <= self.opset <= high:
            raise ConfigError(f"backend.opset={self.opset}: allowed: {low} to {high} ({why})")
        if job.trainer.precision == Precision.fp16:
            raise ConfigError("trainer.precision=fp16 is not offered by backend=ondevice; allowed: fp32")
        if job.trainer.device == Device.cuda and "CUDAExecutionProvider" not in ort.providers():
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

        model, sample, loss = job.model, job.data.sample_input(), losses.get(job.data.loss)
        prefix = ""
        with torch.no_grad():
            if loss.flattens and model(sample).dim() > 2:
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
            loss=loss.ort_block(),
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

    def fit(self, job) -> None:
        """The loop. On the runner's workers (`job.parallel`) gradients are all-reduced before each
        optimizer step, or the parameters averaged every `average_every` updates after it
        (`GradientSync`); rank 0 alone evaluates and saves."""
        ort.quiet(self.log_level)  # ORT's output below backend.log_level: the run's log file only
        from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

        meter, parallel, t = job.meter, job.parallel, job.trainer
        # Rank 0's artifacts stay with the run; the runner's other workers build theirs aside.
        folder = (job.out_dir / "artifacts" if parallel.logging
                  else Path(tempfile.mkdtemp(prefix=f"ort_artifacts_rank{parallel.rank}_")))
        # ORT's artifact builder logs its graph transformations at INFO from C++ whatever the
        # settings: its lines go through logging (the log file; the console from backend.log_level).
        with ort.stderr_logged():
            folder, self._prefix = self.generate_artifacts(job, folder)
            options = ort.session_options(self.intra_op_threads, self.allow_spinning, self.mapped_dimensions,
                                          self.log_level)
            state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
            module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                            device=t.device.value, session_options=options)
            optimizer = Optimizer(str(folder / "optimizer_model.onnx"), module)
        optimizer.set_learning_rate(job.lr * t.lr_factor(0))
        # ORT ships a linear warm-up/decay scheduler; other schedules set the rate by hand each step.
        # onnxruntime-training 1.19.2's Python wrapper hands its two step counts to the C++ side in
        # the wrong order (measured: warmup 3 of 10 steps ran as warmup 10 of 3), so they are passed
        # swapped here; tests/backends/test_parity.py checks the rates against torch's LambdaLR.
        scheduler = (LinearLRScheduler(optimizer, t.max_steps, t.warmup_steps, job.lr)
                     if t.lr_schedule == LRSchedule.linear else None)
        flat = self._prefix == "model."  # labels flattened to match _FlatLogits
        K = t.gradient_accumulation_steps  # above 1 only on the runner's workers
        sync = GradientSync(job)
        module.train()

        for step in meter.steps():
            loss_sum = 0.0
            for micro in range(K):  # each train step adds its gradients to ORT's buffers
                x, y = job.train_batch(step, micro)
                loss, _ = module(x.numpy(), (y.reshape(-1) if flat else y).numpy())
                loss_sum += float(loss)
            sync.before_update(step, state)  # all-reduce the gradients across workers
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            elif t.lr_schedule != LRSchedule.constant:
                optimizer.set_learning_rate(job.lr * t.lr_factor(step))
            # Gradients are zeroed inside the next train step's graph, not by a separate pass.
            module.lazy_reset_grad()
            sync.after_update(step, module)  # or average the parameters every N updates

            meter.record(step, loss_sum / K)
            meter.evaluate(step, lambda: self.evaluate(module, job, flat))
            job.checkpoints.save(step, lambda path: CheckpointState.save_checkpoint(
                state, str(path), include_optimizer_state=True), suffix=".ckpt")

        if parallel.logging:
            job.export_model(lambda path: module.export_model_for_inferencing(str(path), ["logits"]))

    def evaluate(self, module, job, flat: bool) -> tuple[float, float | None]:
        """Forward only, through the eval graph that shares the training parameters."""
        module.eval()
        loss = losses.get(job.data.loss)
        total, loss_sum, acc_sum = 0, 0.0, 0.0
        for x, y in job.data.eval_batches(job.trainer.eval_batch_size):
            y = y.reshape(-1) if flat else y
            value, logits = module(x.numpy(), y.numpy())
            loss_sum += float(value) * len(x)
            if loss.accuracy is not None:
                acc_sum += loss.accuracy(torch.from_numpy(logits), y) * len(x)
            total += len(x)
        module.train()
        return loss_sum / total, (acc_sum / total if loss.accuracy is not None else None)

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        from onnxruntime.training.api import CheckpointState

        state = CheckpointState.load_checkpoint(str(path))
        prefix = getattr(self, "_prefix", "")
        return {name[len(prefix):] if name.startswith(prefix) else name: p.data for name, p in state.parameters}


class GradientSync:
    """The on-device engine's data parallelism across the runner's workers, around each optimizer
    step. ORT's gradient buffers are read and written in place through
    `state.parameters[name].grad` (a live view on the CPU: undocumented, and pinned by the
    runner's equivalence test); parameters go through get_contiguous_parameters and
    copy_buffer_to_parameters. In one process it only logs the norms at display steps."""

    def __init__(self, job):
        self.job, self.parallel, self.every = job, job.parallel, job.parallel.average_every
        self.K, self.world = job.trainer.gradient_accumulation_steps, job.parallel.world_size

    def before_update(self, step: int, state) -> None:
        display = self.job.meter.displaying(step)
        reduce = self.world > 1 and not self.every  # ModelUpdateStep's AllReduce; averaging has none
        if not (reduce or self.K > 1 or display):
            return  # nothing to do to the gradients this step
        grads = [torch.from_numpy(p.grad) for _, p in state.parameters if p.requires_grad]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if reduce:
            self.parallel.all_reduce_(flat)
        if reduce or self.K > 1:
            flat /= (self.world if reduce else 1) * self.K  # ORT sums the K micro-batches: make it the mean
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if display:
            self.job.meter.log({"train/grad_norm": flat.norm().item()}, step)

    def after_update(self, step: int, module) -> None:
        from onnxruntime import OrtValue

        averaging = self.every and self.job.trainer.due(step, self.every)
        display = self.job.meter.displaying(step)
        if not (averaging or display):
            return
        params = torch.from_numpy(module.get_contiguous_parameters(trainable_only=True).numpy())
        if averaging:  # federated averaging: every N updates all ranks take the mean model
            self.parallel.all_reduce_(params)
            params /= self.world
            module.copy_buffer_to_parameters(OrtValue.ortvalue_from_numpy(params.numpy())._ortvalue,
                                             trainable_only=True)
        if display:
            self.job.meter.log({"train/param_norm": params.norm().item(),
                                **self.parallel.replica_metrics([params])}, step)
