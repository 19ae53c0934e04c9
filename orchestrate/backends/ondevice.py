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
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import torch

from orchestrate import checkpoints, extras, ort, process, thirdparty
from orchestrate.backends.base import Backend
from orchestrate.backends.torch import declare_shape, export_for_training
from orchestrate.schema import AT_LEAST_0, ConfigError, Device, LRSchedule, shown, target_of
from orchestrate.tasks import losses

# ORT's optimizer blocks, by the torch class each mirrors, with the arguments the block reads (the
# learning rate goes to ORT's Optimizer). The config's arguments are checked by that torch class
# (orchestrate.job.check_optimizer); any other argument would be ignored by ORT.
OPTIMIZERS = {torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
              torch.optim.SGD: ("lr", "momentum", "weight_decay")}
ADAMW_MODES = {"torch": 0, "hf": 1}  # the AdamWOptimizer op's adam_mode attribute
# torch's BatchNorm layers (a lazy one becomes one of these at its first forward, which the check runs).
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def opset_range(model: torch.nn.Module) -> tuple[int, int, str]:
    """The ONNX opsets `backend.opset` may name with the installed packages, and why: from the
    opset that introduced SoftmaxCrossEntropyLoss (ORT's CrossEntropyLoss block emits it; below
    it ORT's gradient builder fails on plain Linear layers too) to the newest that both torch's
    exporter and onnx know. A model with LayerNorm stops below ONNX's own LayerNormalization op,
    whose gradient ORT 1.19 cannot build (measured: opsets 17-20 fail in generate_artifacts)."""
    import onnx.defs

    from orchestrate.thirdparty import torch_onnx_opsets

    torch_low, torch_high = torch_onnx_opsets()

    first: dict[str, int] = {}
    for op in onnx.defs.get_all_schemas_with_history():
        if op.domain == "" and op.name in ("SoftmaxCrossEntropyLoss", "LayerNormalization"):
            first[op.name] = min(first.get(op.name, op.since_version), op.since_version)
    low = max(first["SoftmaxCrossEntropyLoss"], torch_low)
    high = min(torch_high, onnx.defs.onnx_opset_version())
    why = (f"torch's exporter knows {torch_low}-{torch_high}, onnx up to "
           f"{onnx.defs.onnx_opset_version()}, ORT's CrossEntropyLoss block needs {low}")
    if any(isinstance(m, torch.nn.LayerNorm) for m in model.modules()):
        high = min(high, first["LayerNormalization"] - 1)
        why += (f"; the model's LayerNorm exports as ONNX LayerNormalization from opset {high + 1}, "
                "which ORT 1.19 cannot differentiate")
    return low, high, why


# BatchNorm's running statistics. torch exports a training-mode BatchNorm as ONNX
# BatchNormalization(training_mode=1), whose second and third outputs are the updated running mean
# and variance, and leaves those outputs unused: torch updates its buffers in place, which ONNX
# cannot say. ORT's artifact builder then keeps the statistics as constants of each graph, frozen
# at their initial values, and makes the eval graph's node training_mode=0 with its three outputs
# left on, which ORT 1.19 refuses to load ("This number of op outputs should be 1 when
# Training_mode = False"). So the statistics become checkpoint state (frozen parameters, shared by
# the training and eval graphs and exported with the model), the training graph writes the updated
# ones back into that state after each step, and the eval graph's BatchNorm keeps one output.


def running_stats(model) -> list[str]:
    """The initializers an ONNX model's BatchNormalization nodes read as running mean and variance."""
    initializers = {i.name for i in model.graph.initializer}
    return [name for node in model.graph.node if node.op_type == "BatchNormalization"
            for name in node.input[3:5] if name in initializers]


def track_running_stats(path: Path, stats: list[str]) -> None:
    """Rewrite the training graph at `path` so that each step copies BatchNorm's updated running
    statistics into their buffers in the checkpoint state, as torch updates its own."""
    import onnx

    if not stats:
        return
    model = onnx.load(str(path))
    graph = model.graph
    graph.initializer.append(onnx.helper.make_tensor("running_stats.overwrite", onnx.TensorProto.BOOL, [1], [True]))
    for node in list(graph.node):
        # ORT's training transformers turn BatchNormalization into BatchNormInternal (which also
        # keeps the batch's mean and inverse deviation for the gradient); outputs 1 and 2 stay the
        # new running mean and variance. InPlaceAccumulatorV2 is the op the artifacts already use
        # to add each step's gradient into its buffer in the state; with its overwrite flag set it
        # copies instead of adding. Its output (a flag) needs no consumer: ORT keeps the node.
        if node.op_type in ("BatchNormalization", "BatchNormInternal") and len(node.output) >= 3:
            for stat, updated in zip(node.input[3:5], node.output[1:3]):
                if stat in stats:
                    graph.node.append(onnx.helper.make_node(
                        "InPlaceAccumulatorV2", [stat, updated, "running_stats.overwrite"], [f"{stat}.updated"],
                        name=f"{stat}.update", domain="com.microsoft"))
    onnx.save(model, str(path))


# ORT's ops that draw from its process-wide random generator.
RANDOM_OPS = frozenset({"Dropout", "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout", "Bernoulli", "Multinomial",
                        "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"})


def draws_random(path: Path) -> bool:
    """Whether the ONNX graph at `path`, or a graph inside one of its nodes, draws random numbers."""
    import onnx

    graphs = [onnx.load(str(path)).graph]
    while graphs:
        for node in graphs.pop().node:
            if node.op_type in RANDOM_OPS:
                return True
            for attribute in node.attribute:
                graphs.extend([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs)
    return False


def finish_eval_graph(path: Path, sample: torch.Tensor, logits: torch.Size) -> None:
    """Rewrite the eval graph at `path`, which model.onnx is cut from (export_model_for_inferencing
    keeps its graph): BatchNorm in inference mode has one output (the running statistics are only
    read), and `input` and `logits` declare the shapes torch's export declares."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            del node.output[1:]
    shapes = {"input": sample.shape, "logits": logits}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name in shapes:
            declare_shape(value, shapes[value.name])
    onnx.save(model, str(path))


@dataclass
class OnDeviceBackend(Backend):
    name: str
    opset: int  # opset 17 breaks ORT 1.19's LayerNormalization gradient; 14-16 work
    # ORT's default (a thread per core, spinning) ran the digits MLP at 29.5k samples/s on 2 cores,
    # one intra-op thread at 113k: conf/backend/ondevice.yaml sets one thread.
    intra_op_threads: Annotated[int | None, AT_LEAST_0]  # None: the run's CPU budget (orchestrate.cpu); 0: ORT's default
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
    resumable = True
    extra = extras.ORT

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
        low, high, why = opset_range(job.model)
        if not low <= self.opset <= high:
            raise ConfigError(f"backend.opset={self.opset}: allowed: {low} to {high} ({why})")
        if job.trainer.device == Device.cuda and "CUDAExecutionProvider" not in ort.providers():
            raise ConfigError("trainer.device=cuda needs the GPU build (pip install onnxruntime-training==1.19.2)")
        names = [n for n, _ in job.model.named_parameters()]
        for pattern in self.frozen_params:
            if not fnmatch.filter(names, pattern):
                raise ConfigError(f"backend.frozen_params: {pattern!r} matches no parameter; parameters: {', '.join(names)}")
        if names and all(any(fnmatch.fnmatch(n, p) for p in self.frozen_params) for n in names):
            raise ConfigError("backend.frozen_params freezes every parameter: nothing would train")
        for name, m in job.model.named_modules():
            # torch's export for training gets both wrong: momentum=None (a cumulative average) is
            # traced as one fixed momentum, silently; a BatchNorm without running statistics does
            # not export with a symbolic batch size.
            batch_norm = isinstance(m, BATCH_NORMS)
            if batch_norm and (m.momentum is None or not m.track_running_stats):
                raise ConfigError(f"model={job.cfg.model._target_}: its BatchNorm {name} has momentum={m.momentum} and "
                                  f"track_running_stats={m.track_running_stats}; backend=ondevice trains BatchNorm "
                                  "with running statistics and a momentum number (torch's default: 0.1)")
        self.check_gradients(job)

    def check_gradients(self, job) -> None:
        """Build the artifacts once, in a folder thrown away. ORT 1.19 has no gradient for some
        ops torch exports (measured: CumSum, Einsum, Atan, Softplus, Elu, PRelu, HardSwish,
        ReduceMax from amax, InstanceNormalization from GroupNorm), and its artifact builder
        would otherwise stop inside the run. ORT publishes no list of the ops it can differentiate,
        so the check is the build itself, the same one `fit` runs: it cannot disagree with it.
        The run reuses what the check built (`fit`), so the check costs no second build: the files
        are kept in memory on the job (`Job.built`), the folder removed at once, so that a process
        that ends without its run (a sweep's check, a killed one) leaves nothing on disk."""
        import onnxruntime

        key = self.artifacts_key(job)
        if key in job.built:  # built by an earlier check of the same settings (a sweep's trials)
            return
        # ORT's output as in `fit` (the console from backend.log_level up), put back afterwards:
        # no run is open yet.
        with process.kept(), ort.records_kept() as said, \
                tempfile.TemporaryDirectory(prefix="ort_artifacts_checked_") as folder:
            ort.quiet(self.log_level)
            try:
                with ort.stderr_logged():
                    self.generate_artifacts(job, Path(folder))
            except torch.onnx.errors.OnnxExporterError as e:  # an operator ONNX lacks at this opset
                raise ConfigError(f"model ({job.cfg.model._target_}) cannot be exported at backend.opset={self.opset}: "
                                  f"{type(e).__name__}: {str(e).strip().splitlines()[0]}") from None
            except RuntimeError as e:
                found = re.search(r"gradient builder has not been registered: (\S+) for node (\S+)", str(e))
                if found is None:
                    raise
                raise ConfigError(f"model={job.cfg.model._target_} cannot train with backend=ondevice: ORT "
                                  f"{onnxruntime.__version__} has no gradient for the ONNX op {found[1]} (node "
                                  f"{found[2]} of the exported model); allowed: a model without it, or backend=torch"
                                  ) from None
            files = {made.name: made.read_bytes() for made in Path(folder).iterdir()}  # flat: four files
        job.built[key] = (files, said)  # the artifacts, and ORT's account of the build for the run's log

    def artifacts_key(self, job) -> tuple[str, str]:
        """Everything the graphs are built from: the model and data configs, this backend's
        settings and the optimizer (its block)."""
        from omegaconf import OmegaConf

        return "ondevice_artifacts", OmegaConf.to_yaml({k: job.cfg[k] for k in ("model", "data", "backend", "optimizer")},
                                                      resolve=True)

    def generate_artifacts(self, job, folder: Path) -> None:
        """Export the model and build the training, eval and optimizer graphs plus the initial
        checkpoint into `folder` (which names the model's own parameters and BatchNorm statistics)."""
        import onnx
        from onnxruntime.training import artifacts, onnxblock

        model, sample = job.model, job.data.sample_input()
        model.eval()
        with torch.no_grad():
            logits = model(sample).shape  # declared in the eval graph, as torch's export declares it
        # The export's BatchNorm statistics (updated by its traced forward) are put back in the
        # initializers too: the artifacts start from the model as built.
        exported, buffers = export_for_training(model, sample, self.opset, self.log_level)
        onnx_model = onnx.load_from_string(exported)
        for tensor in onnx_model.graph.initializer:
            if tensor.name in buffers:
                tensor.CopyFrom(onnx.numpy_helper.from_array(buffers[tensor.name].numpy(), tensor.name))
        stats = running_stats(onnx_model)

        names = [n for n, _ in model.named_parameters()]
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
            requires_grad=[n for n in names if n not in frozen],
            frozen_params=frozen + stats,
            loss=losses.get(job.data.loss).ort_block(),
            optimizer=optimizer,
            artifact_directory=folder,
            additional_output_names=["logits"],
        )
        track_running_stats(folder / "training_model.onnx", stats)
        finish_eval_graph(folder / "eval_model.onnx", sample, logits)
        self._set_adamw_mode(folder / "optimizer_model.onnx")

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
        """Rank 0's training artifacts stay with the run; the runner's other workers build theirs
        in a folder of their own, removed when the loop ends."""
        if job.parallel.logging:
            self.train(job, job.out_dir / "artifacts")
            return
        with tempfile.TemporaryDirectory(prefix=f"ort_artifacts_rank{job.parallel.rank}_") as folder:
            self.train(job, Path(folder))

    def train(self, job, folder: Path) -> None:
        """The loop. On the runner's workers (`job.parallel`) gradients are all-reduced before each
        optimizer step, or the parameters averaged every `average_every` updates after it
        (`Averaging`); rank 0 alone evaluates and saves. A resumed run (`job.resume_state`)
        starts from its checkpoint's CheckpointState instead of the initial one."""
        ort.quiet(self.log_level)  # ORT's output below backend.log_level: the run's log file only
        from onnxruntime import set_seed
        from onnxruntime.training.api import LinearLRScheduler

        meter, parallel, t, resume = job.meter, job.parallel, job.trainer, job.resume_state
        job.use_cores(self)  # ORT's session threads (below) and the loader's processes
        state, module, optimizer = self.open(job, folder)
        done = resume["step"] if resume is not None else 0
        optimizer.set_learning_rate(job.lr * t.lr_factor(done))
        # ORT ships a linear warm-up/decay scheduler; other schedules set the rate by hand each step.
        # It reads its position from the optimizer state's step count, when built and at each step,
        # so a resumed run's rate goes on where it stopped. onnxruntime-training 1.19.2's Python
        # wrapper hands its two step counts to the C++ side in the wrong order (measured: warmup 3 of
        # 10 steps ran as warmup 10 of 3), so they are passed swapped here;
        # tests/backends/test_parity.py checks the rates against torch's LambdaLR.
        scheduler = (LinearLRScheduler(optimizer, t.max_steps, t.warmup_steps, job.lr)
                     if t.lr_schedule == LRSchedule.linear else None)
        K = job.micro_batches  # this rank's micro-batches a step: above 1 only on the runner's workers
        sync = Averaging(job)
        # ORT's Dropout draws from one process-wide generator, whose position no checkpoint holds;
        # set_seed restarts it. Seeded from (seed, step) at every step, a step draws the same masks
        # in a resumed run as in one that never stopped (and in any two runs). A graph that draws
        # nothing skips it (measured: ~2% of the digits MLP's step).
        reseed = draws_random(folder / "training_model.onnx")
        module.train()

        def export(path: Path) -> None:  # the model as ONNX for inference: at checkpoints and at the end
            module.export_model_for_inferencing(str(path), ["logits"])

        for step in meter.steps(start=done + 1):
            if reseed:
                set_seed((t.seed * 2**32 + step) % 2**63)
            loss_sum = 0.0
            for micro in range(K):  # each train step adds its gradients to ORT's buffers
                x, y = job.train_batch(step, micro)
                loss, _ = module(x.numpy(), y.numpy())
                loss_sum += float(loss)
            grad_norm = sync.before_update(step, state)  # all-reduce the gradients across workers
            # A nan or inf loss stops the run here, before the weights change (or, with
            # trainer.on_nonfinite=skip, drops this update): every rank decides alike. (ORT hands
            # the loss back in host memory: reading it costs nothing.)
            if not meter.record(step, loss_sum * job.loss_weight, grad_norm,
                                grads=lambda: [torch.from_numpy(p.grad) for _, p in state.parameters if p.requires_grad]):
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            elif t.lr_schedule != LRSchedule.constant:
                optimizer.set_learning_rate(job.lr * t.lr_factor(step))
            # Gradients are zeroed inside the next train step's graph, not by a separate pass.
            module.lazy_reset_grad()
            sync.after_update(step, module)  # or average the parameters every N updates

            meter.evaluate(step, lambda: self.evaluate(module, job))
            job.checkpoints.save(step, lambda path: self.save_checkpoint(path, state, step, job), suffix=".ckpt",  # noqa: B023
                                 export=export)
            if meter.stop_early(step):  # a pruning sweep's pruner stopped this trial
                break

        if parallel.logging:
            job.export_model(export)

    def open(self, job, folder: Path):
        """(CheckpointState, Module, Optimizer) of the run: over the check's artifacts of this very
        model (written to `folder`), or artifacts generated now; from the initial parameters, or
        the resumed run's state (`job.resume_state`). ORT's artifact builder logs its graph
        transformations at INFO from C++ whatever the settings: its lines go through logging (the
        log file; the console from backend.log_level)."""
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        resume = job.resume_state
        with ort.stderr_logged():
            checked = job.built.pop(self.artifacts_key(job), None)  # the check's build, of this very model
            if checked is not None:
                files, said = checked
                folder.mkdir(parents=True, exist_ok=True)
                for name, content in files.items():
                    (folder / name).write_bytes(content)
                ort.replay(said)  # what the build logged, in this run's log as if built here
            else:
                self.generate_artifacts(job, folder)
            options = ort.session_options(job.cpu.threads, self.allow_spinning, self.mapped_dimensions,
                                          self.log_level)
            # The parameters generate_artifacts started from, or the resumed run's. An Optimizer
            # built over a state that holds optimizer state takes it up: AdamW's moments and the
            # step count (measured: the resumed run then repeats the uninterrupted one exactly).
            state = (self.load_state(resume["checkpoint"]) if resume is not None
                     else CheckpointState.load_checkpoint(str(folder / "checkpoint")))
            module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                            device=job.trainer.device.value, session_options=options)
            return state, module, Optimizer(str(folder / "optimizer_model.onnx"), module)

    def evaluate(self, module, job) -> tuple[float, float | None]:
        """Forward only, through the eval graph that shares the training parameters (and the
        BatchNorm statistics)."""
        module.eval()
        loss = losses.get(job.data.loss)
        total, loss_sum, acc_sum = 0, 0.0, 0.0
        for x, y in job.data.eval_batches(job.trainer.eval_batch_size):
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
        return {name: p.data for name, p in state.parameters}

    @staticmethod
    def save_checkpoint(path: Path, state, step: int, job) -> None:
        """ORT's CheckpointState with the optimizer state (AdamW's moments and step count) and, as
        its properties (ints, floats and strings), where the run stands (`checkpoints.progress`)."""
        from onnxruntime.training.api import CheckpointState

        for key, value in checkpoints.progress(step, job).items():
            state.properties[key] = value
        CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)

    def load_checkpoint(self, source: Path | bytes) -> dict:
        """The checkpoint's properties (`step` and the rest of `checkpoints.progress`) and the file
        itself as bytes, which `fit` builds its CheckpointState from: bytes pickle and reach a
        runner worker on another node, where a path on this one would not."""
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        return {**dict(self.load_state(data).properties), "checkpoint": data}

    @staticmethod
    def load_state(data: bytes):
        """ORT's CheckpointState from a checkpoint file's bytes: ORT 1.19 reads one from a path
        only, and holds it in memory once read (the file can go)."""
        from onnxruntime.training.api import CheckpointState

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "checkpoint"
            path.write_bytes(data)
            return CheckpointState.load_checkpoint(str(path))


class Averaging:
    """The on-device engine's data parallelism across the runner's workers, around each optimizer
    step. ORT's gradient buffers are read and written in place through
    `state.parameters[name].grad` (a live view on the CPU: undocumented, and pinned by the
    runner's equivalence test); parameters go through get_contiguous_parameters and
    copy_buffer_to_parameters. In one process it only logs the norms at display steps."""

    def __init__(self, job):
        self.job, self.parallel, self.every = job, job.parallel, job.parallel.average_every
        self.K, self.world, self.slices = job.micro_batches, job.parallel.world_size, job.slices

    def before_update(self, step: int, state) -> float | None:
        """All-reduce (or average over micro-batches) the gradients; at display steps log their
        norm and return it (None elsewhere)."""
        display = self.job.meter.displaying(step)
        reduce = self.world > 1 and not self.every  # ModelUpdateStep's AllReduce; averaging has none
        if not (reduce or self.K > 1 or display):
            return None  # nothing to do to the gradients this step
        grads = [torch.from_numpy(p.grad) for _, p in state.parameters if p.requires_grad]
        if not (reduce or self.K > 1):  # the norm alone: numpy's dot per buffer, 5x cheaper than a copy
            norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads))
            self.job.meter.log({"train/grad_norm": norm}, step)
            return norm
        flat = torch.cat([g.reshape(-1) for g in grads])
        if reduce:
            self.parallel.all_reduce_(flat)
        if reduce or self.K > 1:
            # ORT sums the micro-batches' gradients: the mean over the step's global batch (all the
            # ranks' slices), or with parameter averaging over this rank's own micro-batches.
            flat /= self.slices if reduce else self.K
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if display:
            norm = flat.norm().item()
            self.job.meter.log({"train/grad_norm": norm}, step)
            return norm
        return None

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
            module.copy_buffer_to_parameters(thirdparty.ort_c_value(OrtValue.ortvalue_from_numpy(params.numpy())),
                                             trainable_only=True)
        if display:
            self.job.meter.log({"train/param_norm": params.norm().item(),
                                **self.parallel.replica_metrics([params])}, step)
