"""What a backend's loop gets: the objects built from the config (data, model, backend), the
settings it reads (built once, plain objects, read-only), and the three helpers it reports to:
the meter (steps, progress, metrics), the checkpoints, and the data-parallel context (one
process unless the runner's workers say otherwise)."""

import dataclasses
import inspect
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from orchestrate import checkpoints, cpu, ort, schema
from orchestrate.checkpoints import Checkpoints
from orchestrate.cluster.runtime import COLD, Runtime
from orchestrate.cpu import Budget
from orchestrate.errors import first_line
from orchestrate.meter import Meter
from orchestrate.parallel import Parallel
from orchestrate.tasks import loader, losses
from orchestrate.tasks.data import DataSet

# Module state: data sets built in this process, by their resolved config, so that the trials a
# Ray worker runs in turn build theirs once; read-only (batches are served by position, and a
# run's end stops a MapData's loader processes), so a run finds one as the last run left it.
_DATA: dict[str, DataSet] = {}
DATA_KEPT = 4  # at most this many: a Ray worker runs trial after trial of a sweep, mostly on one data set


def build_data(node: DictConfig) -> DataSet:
    """The data set `node` describes, built once per process: data sets are read-only (batches are
    served by position), so the trials of a sweep that one Ray worker runs in turn share it."""
    key = OmegaConf.to_yaml(node, resolve=True)
    if key not in _DATA:
        while len(_DATA) >= DATA_KEPT:
            _DATA.pop(next(iter(_DATA)))
        built = schema.build(node, "data")
        if loader.is_map_dataset(built):  # a torch Dataset of the user's own: served by MapData's defaults
            try:
                built = loader.MapData(built)
            except ValueError as e:
                raise schema.ConfigError(f"data ({node._target_}): {e}") from None
        _DATA[key] = built
    return _DATA[key]


def model_key(cfg: DictConfig) -> str | None:
    """What a model built for a check depends on: its config, its data's and the seed (None when
    they do not resolve: building the model then says why)."""
    try:
        return OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, ["model", "data"]), resolve=True) + str(cfg.trainer.seed)
    except Exception:
        return None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def dtype_hint(model: torch.nn.Module, sample: torch.Tensor) -> str | None:
    """What to cast when floating-point inputs and the model's parameters differ in precision
    (float64 from numpy into a float32 model); None when they agree."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None or not sample.is_floating_point() or param.dtype == sample.dtype:
        return None
    want = str(param.dtype).removeprefix("torch.")
    return (f"the data's inputs are {str(sample.dtype).removeprefix('torch.')} and the model's parameters {want}: "
            f"cast the inputs to {want} in the data set (numpy: x.astype(np.{want}); torch: x.to(torch.{want}))")


def check_forward(model: torch.nn.Module, data: DataSet, cfg: DictConfig) -> None:
    """Run the model once on the data's sample batch (eval mode, no gradients, no ORT export), so
    that a layer sized for other data is refused here rather than in the first training step.
    The RNG is forked and the mode restored: every backend still starts from the same state. A
    parameter with no elements (a layer of width 0) is refused first: torch runs it, ORT does not."""
    sample = data.sample_input()
    target = cfg.model._target_
    check_finite_inputs(data, sample)
    for name, parameter in model.named_parameters():
        if parameter.numel() == 0:
            raise schema.ConfigError(f"model ({target}): parameter {name} has no elements (shape "
                                     f"{list(parameter.shape)}); check the model's sizes")
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            out = model(sample)
    except Exception as e:  # whatever the model's own code raises, the run would stop on it
        raise schema.ConfigError(
            f"model ({target}) cannot run on data's sample batch of shape {list(sample.shape)} "
            f"({str(sample.dtype).removeprefix('torch.')}): {first_line(e)}; {dtype_hint(model, sample) or size_hint(cfg)}"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise schema.ConfigError(f"model ({target}) returns {type(out).__name__}; the loops need one tensor of "
                                 "logits (or predictions) per batch")
    # Targets hold data.num_classes values per sample (class ids below it for cross_entropy):
    # fewer logits fail on the first label above them, and mse, l1 and bce_with_logits compare
    # output and target value by value. More logits than classes does train with cross_entropy.
    classes, outputs = cfg.data.get("num_classes"), (out.shape[-1] if out.dim() else 1)
    if isinstance(classes, int) and (outputs < classes or (outputs > classes and data.loss != "cross_entropy")):
        raise schema.ConfigError(f"model ({target}) gives {outputs} outputs per sample and data.num_classes={classes} "
                                 f"(data.loss={data.loss}); {size_hint(cfg)}")
    # cross_entropy scores one row of logits per target: a language model (logits per token) needs
    # per-token targets, a classifier (logits per sample) per-sample ones. Paired the other way, the
    # first step would fail on "input batch_size (B*T) to match target batch_size (B)".
    _, targets = data.train_batch(0, len(sample), cfg.trainer.seed)
    if data.loss == "cross_entropy" and out.dim() >= 1 and tuple(out.shape[:-1]) != tuple(targets.shape):
        raise schema.ConfigError(
            f"model ({target}) gives logits of shape {list(out.shape)} for data's batch of {len(sample)}, whose "
            f"targets have shape {list(targets.shape)}: data.loss=cross_entropy needs one row of logits per target "
            "(a model that scores every position, such as a language model, needs per-position targets, e.g. "
            "data=python_source; a classifier needs one target per sample)")
    # The loss itself, as the loops compute it: one that does not fit the targets (mse on class ids)
    # would otherwise fail the first step, after the MLflow run opened; one that only warns
    # broadcasts the two shapes against each other and trains on the wrong pairs.
    try:
        score(losses.get(data.loss), out, targets)
    except Exception as e:  # whatever torch raises, the first step would raise too
        raise schema.ConfigError(
            f"data.loss={data.loss} cannot score model ({target})'s output of shape {list(out.shape)} against data's "
            f"targets of shape {list(targets.shape)} ({str(targets.dtype).removeprefix('torch.')}): {first_line(e)}; allowed: "
            f"{', '.join(fitting_losses(out, targets)) or 'a loss that takes these shapes'}") from None


def score(loss: losses.Loss, out: torch.Tensor, targets: torch.Tensor) -> None:
    """The loss as the loops compute it, a warning raised as an error."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        loss.torch(out, targets)


def fitting_losses(out: torch.Tensor, targets: torch.Tensor) -> list[str]:
    """The registry's losses that score `out` against `targets` without an error."""
    fitting = []
    for name, loss in losses.LOSSES.items():
        try:
            score(loss, out, targets)
            fitting.append(f"data.loss={name}")
        except Exception:  # noqa: BLE001 - any refusal means it does not fit
            pass
    return fitting


def check_lengths(data: DataSet) -> None:
    """A data set whose num_train (the positions its sampler draws from) is more than its arrays
    hold would fail in the epoch that first draws a position past their end."""
    arrays = {name: getattr(data, name) for name in ("x_train", "y_train") if hasattr(data, name)}
    num_train = getattr(data, "num_train", None)
    for name, array in arrays.items():
        if isinstance(num_train, int) and num_train > len(array):
            raise schema.ConfigError(
                f"data ({type(data).__name__}): num_train={num_train}, but {name} holds {len(array)} samples; "
                f"num_train must not exceed the length of x_train and y_train "
                f"({', '.join(f'{n}: {len(a)}' for n, a in arrays.items())})")


def check_finite_inputs(data: DataSet, sample: torch.Tensor) -> None:
    """Inputs with nan or inf make the first loss non-finite whatever the learning rate: refused
    here, over the whole training set where it is in memory (TensorData), else the sample batch."""
    inputs = getattr(data, "x_train", sample)
    if not (isinstance(inputs, torch.Tensor) and inputs.is_floating_point()):
        return
    bad = ~torch.isfinite(inputs)
    if bad.any():
        where = bad.reshape(len(inputs), -1).any(dim=1).nonzero()[0].item() if inputs.dim() else 0
        raise schema.ConfigError(
            f"data ({type(data).__name__}): {int(bad.sum())} of {inputs.numel()} training input values are nan or "
            f"inf (the first in sample {where}); the first loss would be non-finite whatever the learning rate: "
            "clean or impute them in the data set")


def size_hint(cfg: DictConfig) -> str:
    """The sizes that must agree between model and data: their integer keys (resolved)."""
    def sizes(group: str) -> str:
        return ", ".join(f"{group}.{k}={v}" for k, v in cfg[group].items()
                         if isinstance(v, int) and not isinstance(v, bool) and k != "seed")

    return f"check the model's sizes ({sizes('model')}) against the data's ({sizes('data')})"


def check_optimizer(node: DictConfig, model: torch.nn.Module) -> None:
    """Build the optimizer once on the model's parameters (nothing is stepped): torch checks its
    arguments in the constructor (a negative learning rate, betas outside [0, 1)), and the
    backends build it only inside the run."""
    if schema.target_of(node, "optimizer").__module__.startswith("onnxruntime."):
        # ORT's FusedAdam checks none of its arguments, and building it needs CUDA and ORT's C++
        # extensions (which ORTModule builds on first use): only its keys are checked.
        schema.build(node, "optimizer")  # `_partial_`: the class is not called
        return
    schema.build(node, "optimizer", list(model.parameters()))


@dataclass
class Job:
    cfg: DictConfig
    backend: Any  # orchestrate.backends.base.Backend
    data: DataSet
    model: torch.nn.Module
    out_dir: Path | None  # the run's folder; None: a checked job not yet placed in one (it writes nothing)
    parallel: Parallel = field(default_factory=Parallel)  # the runner's workers replace it
    resume_state: dict | None = None  # trainer.resume (or a restarted worker): the checkpoint to go on from
    # Every RNG state right after the model was built from the seed: a run that takes over the
    # job its command checked (`Checked.take`) starts from them, as if it had built the model itself.
    rng_after_build: dict | None = None
    ray: str | None = None  # how the run got its Ray (orchestrate.cluster.ray_cluster.how): warm, cold, cluster; None: none
    runtime: Runtime = COLD  # how the command started (orchestrate.cluster.runtime), as its entry handed it down
    # What the checks built that the run reuses instead of building it again, by the backend's
    # own key (the on-device training artifacts: OnDeviceBackend.check_gradients).
    built: dict[str, Any] = field(default_factory=dict)
    cpu: Budget | None = None  # the CPU budget the loop trains with, once it started (`use_cores`)
    busy: float | None = None  # the cores other processes kept busy when first asked (`busy_cores`)

    @classmethod
    def prepare(cls, cfg: DictConfig, out_dir: Path | str | None = None, models: dict | None = None,
                parallel: Parallel | None = None, built: dict | None = None, runtime: Runtime = COLD) -> "Job":
        """`build`, then `check`: the job of `cfg`, every refusal (schema.ConfigError) before any
        compute; nothing is written (`out_dir` None: the job is only checked, and a run may take it
        over: `Checked`). `models`: for checks only (app.check), models already built
        and run on their data, by config, reused instead of built again (the job is not run: a grid
        over the learning rate builds its model once); `built`: what the backends' checks built, shared
        the same way (the on-device artifacts of one model and backend setting, built once);
        `runtime`: how the command started, which the backends' checks read (the warm head's CPUs)."""
        schema.check_settings(cfg)  # every setting against its declared range, before anything is built
        key = model_key(cfg) if models is not None else None
        job = cls.build(cfg, out_dir, parallel=parallel, model=models.get(key) if key is not None else None)
        if built is not None:
            job.built = built
        job.runtime = runtime
        job.check(model_checked=key is not None and key in models)
        if key is not None:
            models[key] = job.model
        return job

    @classmethod
    def build(cls, cfg: DictConfig, out_dir: Path | str | None = None, parallel: Parallel | None = None,
              model: torch.nn.Module | None = None) -> "Job":
        """The objects `cfg` describes, built and nothing checked: the backend, the data (once per
        process) and the model (from the seed: every backend starts from the same weights), or
        `model` when one built from the same config is handed in. `parallel`: the data-parallel
        context the loop runs in (the runner's workers give theirs; one process by default), which
        also sets the device, who logs and the samples a step counts. The runner's workers build
        their job with this alone: the driver checked the config."""
        ort.load()  # before anything imports it: what its import prints goes to the log
        backend = schema.build(cfg.backend, "backend")
        why = backend.unavailable()  # a package this environment lacks: one line, before anything is built
        if why:
            raise schema.ConfigError(why)
        data = build_data(cfg.data)
        rng_after_build = None
        if model is None:
            seed_everything(cfg.trainer.seed)
            model = schema.build(cfg.model, "model")
            rng_after_build = checkpoints.rng_state()
        return cls(cfg=cfg, backend=backend, data=data, model=model,
                   out_dir=Path(out_dir) if out_dir is not None else None,
                   parallel=parallel or Parallel(), rng_after_build=rng_after_build)

    def check(self, model_checked: bool = False) -> None:
        """Refuse what would fail only inside the loop, after the MLflow run opened
        (schema.ConfigError): the data's lengths, the model's forward and the loss on the data's
        sample batch (not again for a model already run on its data: `model_checked`), the
        optimizer's arguments, then the backend's own checks, which may keep on the job what the
        run can reuse (`Job.built`: the on-device artifacts)."""
        cfg, backend = self.cfg, self.backend
        check_lengths(self.data)
        if not model_checked:
            check_forward(self.model, self.data, cfg)
        check_optimizer(cfg.optimizer, self.model)
        backend.check_precision(self)
        backend.check_workers(self)
        backend.check_resume(self)
        backend.check(self)
        try:
            self.train_batch(1)  # the data set can serve this batch size
        except ValueError as e:
            raise schema.ConfigError(str(e)) from None

    def placed(self, cfg: DictConfig, out_dir: Path | str) -> "Job":
        """This checked job for the run of `cfg` (the same config, as the run composed it),
        writing to `out_dir`: the same built backend, data and model (nothing is built twice),
        the RNG as it was right after the model's build."""
        if self.rng_after_build is not None:
            checkpoints.set_rng_state(self.rng_after_build)
        return dataclasses.replace(self, cfg=cfg, out_dir=Path(out_dir))

    def __post_init__(self) -> None:
        # Plain objects, not DictConfig: an OmegaConf attribute read costs microseconds, and the
        # loop reads these settings several times a step.
        self.trainer: schema.TrainerConf = OmegaConf.to_object(self.cfg.trainer)
        try:
            self.lr = float(self.cfg.optimizer.lr)
        except (TypeError, ValueError):  # not a number: `check` refuses it, in the optimizer's own words
            self.lr = math.nan
        self.device = self.parallel.device or torch.device(self.trainer.device.value)
        self.checkpoints = Checkpoints(self.trainer, self.out_dir / "checkpoints" if self.out_dir else None,
                                       log_to_tracker=self.cfg.tracking.log_checkpoints, writer=self.parallel.logging,
                                       sample=lambda: self.data.sample_input().cpu().numpy())
        t, p = self.trainer, self.parallel
        # A step's global batch is `slices` micro-batches of batch_size, the same at any worker count:
        # gradient_accumulation_steps of them for each of the num_workers ranks of a full-size run.
        # The ranks present take them in turn (rank r the r-th, the (r+N)-th, ...), so with fewer
        # workers (an elastic run) each runs more of them, and a rank's losses are weighted so that
        # the all-reduced gradients are the mean over the whole global batch (`loss_weight`).
        # With pipeline stages the data-parallel ranks are the replicas (each stage of replica d
        # reads replica d's slices: the first its inputs, the last its targets).
        self.slices = t.gradient_accumulation_steps * t.replicas
        self.micro_batches = len(range(p.replica, self.slices, p.replicas))  # this rank's, per step
        self.loss_weight = p.replicas / self.slices  # 1/K at full size; DDP then averages over the ranks
        samples = t.batch_size * self.slices
        self.meter = Meter(t, self.backend.name, self.lr, samples, self.out_dir, logging=self.parallel.logging,
                           paused=lambda: self.checkpoints.seconds,
                           update_allowed=self.parallel.update_allowed, agree=self.parallel.agree, summed=self.parallel.sum_,
                           hold=self.parallel.hold)

    def busy_cores(self) -> float:
        """How many cores other processes keep busy (orchestrate.cpu.busy_elsewhere): measured
        once per job, when a budget first needs it (a tenth of a second), or as the caller measures
        it (`Parallel.busy`: backend=auto's probes share the run's), so that the run's params and
        its loop agree."""
        if self.busy is None:
            self.busy = (self.parallel.busy or cpu.busy_elsewhere)()
        return self.busy

    def use_cores(self, backend) -> Budget:
        """Size this process for `backend`'s loop (each loop calls it first): its CPU budget
        (orchestrate.cpu: the cores split between training threads and the data loader's
        processes) applied to torch's thread pool and to the loader; ORT's sessions take
        `job.cpu.threads`. Put back when the run ends (orchestrate.process.kept)."""
        self.cpu = backend.budget(self)
        self.cpu.apply()
        if hasattr(self.data, "use_processes"):
            self.data.use_processes(self.cpu.loader_processes)
        return self.cpu

    def track(self, tracker: Any) -> None:
        """Send metrics and checkpoints to this MLflow run from now on."""
        self.meter.tracker = self.checkpoints.tracker = tracker

    def make_optimizer(self, params, fused: bool = False) -> torch.optim.Optimizer:
        """The configured optimizer on `params`. `fused`: a torch.optim optimizer that has a fused
        implementation (AdamW, Adam, SGD, Adagrad) gets it unless `optimizer.fused` is set: one
        kernel for the whole update, which can also skip an update on the device (its `found_inf`,
        as GradScaler uses it), so that the loop's divergence guard never waits for the device."""
        node = self.cfg.optimizer
        target = schema.target_of(node, "optimizer")
        params = list(params)
        if (fused and "fused" not in node and target.__module__.startswith("torch.optim")
                and "fused" in inspect.signature(target).parameters):
            try:
                return schema.build(node, "optimizer", params, fused=True)
            except schema.ConfigError:  # parameters the fused kernels do not take: the plain one
                pass
        return schema.build(node, "optimizer", params)

    def train_batch(self, step: int, micro: int = 0):
        """This worker's micro-batch `micro` (of its `micro_batches`) of 1-based `step`, from the
        seeded order. Slice f of the step's `slices` is part f mod num_workers of global batch
        (step-1) x K + f div num_workers (K = gradient_accumulation_steps), and this rank's micro-th
        slice is f = micro x N + rank with N workers present: at full size (N = num_workers) rank r
        reads part r of the step's K global batches, as ORT's TrainingRunner shards them, and with
        fewer workers the same slices are read, by fewer ranks."""
        t, p = self.trainer, self.parallel
        flat = micro * p.replicas + p.replica
        position = (step - 1) * t.gradient_accumulation_steps + flat // t.replicas
        return self.data.train_batch(position, t.batch_size, t.seed, flat % t.replicas, t.replicas)

    def registration(self):
        """Where the final model is registered (tracking.register_model), None: not registered. The
        alias `best` goes by the sweep's (first) metric, as the model's evaluation names it (the
        meter's final `eval_loss` is the evaluation's `eval/loss`); a sweep over several objectives
        also gives its Pareto front's versions an alias per objective (orchestrate.sweeps._runs)."""
        from orchestrate.tracking.models import Registration

        name = self.cfg.tracking.register_model
        metric, minimize = schema.objectives(self.cfg.sweep.metric, self.cfg.sweep.direction, "sweep.direction")[0]
        return Registration(name, metric.replace("_", "/", 1), minimize) if name else None

    def close_data(self) -> None:
        """At the run's end: a data set read by loader processes (MapData) stops them."""
        if hasattr(self.data, "close"):
            self.data.close()

    def export_model(self, write) -> Path | None:
        """Save the trained model as ONNX for inference (`model.onnx`) and log it to the run. Not
        for a trial a sweep's pruner stopped: it lost, and its export (a second or more for a
        transformer) would be most of what a trial pruned early costs; its checkpoints stay."""
        if self.meter.pruned_at is not None:
            return None
        path = self.out_dir / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
        if self.meter.tracker is not None:
            self.meter.tracker.log_artifact(path)
            sample = self.data.sample_input().cpu().numpy()
            self.meter.tracker.log_model(path, sample, self.meter.step, self.registration())
        return path


@dataclass(frozen=True)
class Checked:
    """One config's check, which the run of that config takes over instead of building and
    checking it again: the job, built and checked (placed in no folder yet), and for a tracked run
    the MLflow run it logs into (orchestrate.tracking.run.RunChoice); or why the config was
    refused. The command line hands it to its run (app.hydra_app), backend=auto to its probes."""

    config: str  # the config as checked (YAML): a run of another config does not take it over
    job: Job | None = None
    run: Any = None  # orchestrate.tracking.run.RunChoice: which MLflow run; None for an untracked probe
    refused: str | None = None  # the ConfigError's line (then no job)

    @classmethod
    def of(cls, cfg: DictConfig, prepare: Callable[[], Job]) -> "Checked":
        """`prepare()`'s job for `cfg` (untracked: a probe's), or the refusal it raised."""
        try:
            return cls(OmegaConf.to_yaml(cfg), prepare())
        except schema.ConfigError as e:
            return cls(OmegaConf.to_yaml(cfg), refused=str(e))

    def take(self, cfg: DictConfig, out_dir: Path | str) -> Job | None:
        """The checked job for the run of `cfg` writing to `out_dir` (`Job.placed`), its refusal
        raised again, or None when `cfg` is not the config checked (the run builds its own)."""
        if self.config != OmegaConf.to_yaml(cfg):
            return None
        if self.refused is not None:
            raise schema.ConfigError(self.refused)
        return self.job.placed(cfg, out_dir)
