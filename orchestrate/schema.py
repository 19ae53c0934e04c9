"""Config schemas, registered in Hydra's ConfigStore so that a typo or a wrong type fails at
composition, before any compute. Groups whose objects are built with `_target_` (backend, model,
data, optimizer) are checked against their target's signature when they are built (`build`)."""

import enum
import functools
import inspect
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Annotated, Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from orchestrate import errors, extras


class ConfigError(ValueError):
    """Bad input: a wrong key or value, a missing file, an impossible combination.
    The command line prints its message alone and exits with code 2."""


def shown(value: Any) -> str:
    """A config value as an override writes it (true, null), for messages."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


class LRSchedule(str, enum.Enum):
    constant = "constant"
    linear = "linear"  # linear warm-up, then linear decay to 0 (ORT's LinearLRScheduler)
    cosine = "cosine"  # linear warm-up, then cosine decay to 0


class Device(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"


class Precision(str, enum.Enum):
    fp32 = "fp32"  # on CUDA, matrix products in TF32 unless trainer.tf32=false
    fp16 = "fp16"  # CUDA only: autocast to float16 with a dynamic loss scaler
    # The PyTorch loop (backend=torch, the runner's torch engine): autocast to bfloat16, no loss scaler; CUDA or CPU.
    bf16 = "bf16"


class NonFinite(str, enum.Enum):
    stop = "stop"  # the run stops at that step, FAILED, its last finite checkpoint kept
    skip = "skip"  # that step's update is dropped (as fp16's loss scaler does), counted in train/skipped_steps


@dataclass(frozen=True)
class Range:
    """The values a numeric setting allows, declared beside its type (`Annotated[int, AT_LEAST_1]`
    on a schema's field, a backend's field, a model's or data set's constructor parameter) and
    checked in one place (`check_value`); a list's elements are each checked (`model.hidden`)."""

    low: float | None = None
    high: float | None = None
    open: bool = False  # the ends themselves are not allowed (a fraction in (0, 1))

    def allows(self, value: float) -> bool:
        if self.open:
            return (self.low is None or value > self.low) and (self.high is None or value < self.high)
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.open:
            return f"above {self.low}" if self.high is None else f"in ({self.low}, {self.high})"
        if self.high is None:
            return "0 or more" if self.low == 0 else f"at least {self.low}"
        return f"from {self.low} to {self.high}"


AT_LEAST_1 = Range(1)  # sizes and counts
AT_LEAST_0 = Range(0)  # periods (0: only at the end), thread counts (0: the default)
ABOVE_0 = Range(0, open=True)  # amounts (CPUs, seconds)
FRACTION = Range(0, 1, open=True)
PROBABILITY = Range(0, 1)  # dropout
SEED = Range(0, 2**32 - 1)  # what numpy's and torch's generators take


@functools.cache  # a class's annotations do not change; a sweep's check builds each class per trial
def ranges_of(target: Any) -> dict[str, Range]:
    """Each field's (a dataclass) or constructor parameter's declared Range, by name."""
    import typing

    try:
        hints = typing.get_type_hints(target if is_dataclass(target) else target.__init__, include_extras=True)
    except Exception:  # noqa: BLE001 - a class whose annotations do not resolve declares nothing
        return {}
    return {name: meta for name, hint in hints.items() for meta in getattr(hint, "__metadata__", ())
            if isinstance(meta, Range)}


def check_value(key: str, value: Any, declared: Range | None = None) -> None:
    """A setting's numbers against its declared range; a float must be finite wherever it is (no
    setting takes nan or inf). ConfigError naming the key and what is allowed."""
    values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    for number in values:
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            continue
        if isinstance(number, float) and not math.isfinite(number):
            raise ConfigError(f"{key}={shown(value)}: must be a finite number" + (f", {declared}" if declared else ""))
        if declared is not None and not declared.allows(number):
            raise ConfigError(f"{key}={shown(value)}: must be {declared}")


@dataclass
class TrainerConf:
    max_steps: Annotated[int, AT_LEAST_1] = 300  # optimizer updates to run
    batch_size: Annotated[int, AT_LEAST_1] = 64  # samples per step (per worker)
    eval_batch_size: Annotated[int, AT_LEAST_1] = 512
    seed: Annotated[int, SEED] = 0  # same seed -> same initial weights and batch order on every backend
    display_loss_steps: Annotated[int, AT_LEAST_1] = 25  # log train loss and throughput every N steps
    evaluation_period: Annotated[int, AT_LEAST_0] = 100  # evaluate every N steps (and after the last); 0: at the end
    checkpoint_period: Annotated[int, AT_LEAST_0] = 150  # checkpoint every N steps; 0: only after the last step
    max_num_checkpoints: Annotated[int, AT_LEAST_1] = 2  # checkpoints kept on disk (MLflow keeps every logged one)
    lr_schedule: LRSchedule = LRSchedule.constant
    warmup_steps: Annotated[int, AT_LEAST_0] = 0
    device: Device = Device.cpu
    precision: Precision = Precision.fp32  # each backend states the ones it takes (Backend.precisions)
    # fp32 matrix products on CUDA in TF32 (torch.backends.cuda.matmul.allow_tf32, cuDNN's too): about
    # 2.5x the fp32 throughput on an H200 for a 10-bit mantissa in the products; no effect on CPU.
    tf32: bool = True
    on_nonfinite: NonFinite = NonFinite.stop  # a nan or inf loss (or gradient norm, at display steps)
    progress: bool = True  # progress bar on the console
    num_workers: Annotated[int, AT_LEAST_1] = 1  # data-parallel workers (backend=runner)
    # Elastic (backend=runner): start once this many workers fit, grow toward num_workers as nodes
    # join, shrink (down to it) when one leaves; null: always num_workers. batch_size stays per
    # worker at num_workers, so a step's global batch is the same at any size.
    min_workers: Annotated[Optional[int], AT_LEAST_1] = None
    gradient_accumulation_steps: Annotated[int, AT_LEAST_1] = 1  # micro-batches per weight update (backend=runner)
    # Pipeline stages (backend=runner): the model cut into this many stages, one per worker, so
    # num_workers = pipeline_parallel_size x data-parallel replicas. Each step's
    # gradient_accumulation_steps micro-batches (per replica) go through the stages as
    # pipeline_schedule orders them (docs/runner.md#pipeline-stages).
    pipeline_parallel_size: Annotated[int, AT_LEAST_1] = 1
    pipeline_schedule: str = "gpipe"  # gpipe (all forwards, then all backwards) or 1f1b (one forward, one backward)
    # Where stages 2..P begin: P-1 names of the model's submodules (e.g. [blocks.1]); null: cut where
    # the parameter counts balance (backend.runner.stages lists the places a model can be cut).
    pipeline_split: Optional[list[str]] = None
    # "auto": continue the newest unfinished MLflow run with this same config from its latest
    # checkpoint (a fresh run when there is none); a run id: continue that run. Same MLflow run,
    # each step logged once.
    resume: Optional[str] = None
    tensorboard: bool = False  # also write TensorBoard event files to <outputs>/tensorboard

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the model (of each pipeline stage): num_workers / pipeline_parallel_size."""
        return max(1, self.num_workers // self.pipeline_parallel_size)

    @property
    def elastic(self) -> bool:
        """Whether the runner's worker count may change during the run (min_workers below num_workers)."""
        return self.min_workers is not None and self.min_workers < self.num_workers

    def due(self, step: int, period: int) -> bool:
        """Periodic work happens every `period` steps and always after the last one."""
        return step == self.max_steps or (period > 0 and step % period == 0)

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base learning rate for update number `step` (0-based)."""
        if self.lr_schedule == LRSchedule.constant:
            return 1.0
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        if self.lr_schedule == LRSchedule.linear:
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrackingConf:
    # MLflow's own variables, when set, as MLflow's client and Lightning's MLFlowLogger read them;
    # else the embedded default, a SQLite store in the working directory. An override wins. (A
    # sweep's trial gets ORCHESTRATE_TRACKING_URI, its sweep's store: MLFLOW_TRACKING_URI is then
    # the sweep's own server, which the trial logs through.)
    uri: str = "${oc.env:ORCHESTRATE_TRACKING_URI,${oc.env:MLFLOW_TRACKING_URI,'sqlite:///mlflow.db'}}"
    experiment: str = "${oc.env:MLFLOW_EXPERIMENT_NAME,orchestrate}"
    run_name: Optional[str] = None  # default: "<backend>-<model>-<data>"
    log_checkpoints: bool = True  # upload each checkpoint as an artifact, and its model as a LoggedModel
    # Register each run's trained model (its MLflow LoggedModel) as a new version of this registered
    # model; the alias `best` marks the version with the best evaluation (sweep.metric and
    # sweep.direction); null: logged, not registered.
    register_model: Optional[str] = None
    # MLflow's system metrics (CPU, memory, disk, network; GPU where pynvml is installed) under
    # system/*, sampled every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds (10 by default).
    system_metrics: bool = False
    tags: dict[str, str] = field(default_factory=dict)


# The final metrics every run logs (final/<name> in MLflow; eval_accuracy: classifiers only), which
# sweep.metric may name: what a trial returns to its sweeper, ranks the summary, forms the Pareto
# front of a sweep over several objectives. orchestrate.meter writes them.
SWEEP_METRICS = {
    "eval_loss": "the last evaluation's loss",
    "eval_accuracy": "the last evaluation's accuracy (classifiers)",
    "train_loss": "the last display window's training loss",
    "wall_time_s": "seconds the training loop ran, evaluations included",
    "samples_per_sec": "training throughput over the steady steps",
    "step_time_ms": "milliseconds a steady step took",
    "warmup_s": "seconds the first display window took beyond its steps at the steady rate (export, graph build, compile)",
    "peak_rss_mb": "the process's (the runner: its largest worker's) resident memory high-water mark while training",
    "peak_cuda_mb": "CUDA runs: the most memory torch's allocator held (not ORT's own arena, which the on-device API uses)",
}


@dataclass
class SweepConf:
    name: str = "none"  # the conf/sweep file in use (each sets its own); none: plain Hydra multirun
    default: str = "lr_grid"  # what a bare `+sweep` runs when no experiment picked a sweep
    # The final metric a trial returns (Optuna optimises it; the summary ranks by it), one of
    # SWEEP_METRICS; a list of them for a sweep over several objectives (the summary's Pareto
    # front), with a list of as many directions.
    metric: Any = "eval_loss"
    # Whether the metric is better low or high (minimize, maximize; a list: one per metric): the
    # summary ranks by it, and it is the Optuna sweeper's direction unless hydra.sweeper.direction
    # says otherwise.
    direction: Any = "minimize"


@dataclass
class CompareConf:
    """A comparison (conf/sweep/compare.yaml): the same model and data trained by each swept
    configuration (by default each backend) `repeats` times, interleaved; the sweep's summary gives
    means with confidence intervals and a verdict (orchestrate.sweeps.compare). A sweep that varies
    compare.repeat is a comparison."""

    repeats: int = 3  # runs of each configuration; a verdict needs an interval, so at least 2
    repeat: int = 0  # which repeat a run is (the sweep varies it over range(repeats)); nothing else reads it
    baseline: str = "torch"  # the backend whose loss curve the others are measured against, and whose eval loss is the target
    # The eval loss the time to target is measured to; null: the baseline's (the worst of its repeats' best).
    target: Optional[float] = None
    confidence: float = 0.95  # of the intervals


@dataclass
class Config:
    backend: Any = MISSING  # conf/backend/*.yaml: `_target_` is a Backend dataclass
    model: Any = MISSING  # any torch.nn.Module
    data: Any = MISSING  # a data set, see orchestrate.tasks.data
    optimizer: Any = MISSING  # a torch.optim class, `_partial_: true`
    trainer: TrainerConf = field(default_factory=TrainerConf)
    tracking: TrackingConf = field(default_factory=TrackingConf)
    sweep: SweepConf = field(default_factory=SweepConf)
    compare: CompareConf = field(default_factory=CompareConf)


def register() -> None:
    """The schema, as `config_schema` (conf/config.yaml's first default). Experiments are the
    config group `experiment` (conf/experiment/NAME.yaml, `+experiment=NAME`), so that a user's own
    config folder can add to it like to any other group."""
    ConfigStore.instance().store(name="config_schema", node=Config)


def check_settings(cfg: DictConfig) -> None:
    """Value checks that a type cannot express."""
    # `+key=value` adds a key even where the schema has none (Hydra lifts the struct flag for it):
    # nothing would read it, so a typo such as `+trainer.max_step=5` would be ignored quietly.
    for prefix, schema in (("", Config), ("trainer.", TrainerConf), ("tracking.", TrackingConf),
                           ("sweep.", SweepConf), ("compare.", CompareConf)):
        node = OmegaConf.select(cfg, prefix.rstrip(".")) if prefix else cfg
        allowed = [f.name for f in fields(schema)]
        unknown = [str(k) for k in node if k not in allowed]
        if unknown:
            where = f"in {prefix.rstrip('.')}" if prefix else "at the top level"
            raise ConfigError(f"{prefix}{unknown[0]}: unknown key; allowed keys {where}: {', '.join(allowed)} "
                              f"(drop it with ~{prefix}{unknown[0]})")
    t = cfg.trainer
    for key, declared in ranges_of(TrainerConf).items():
        check_value(f"trainer.{key}", t[key], declared)
    if t.min_workers is not None and t.min_workers > t.num_workers:
        raise ConfigError(f"trainer.min_workers={t.min_workers} is above trainer.num_workers={t.num_workers}: an "
                          "elastic run starts with min_workers and grows to num_workers; allowed: min_workers from 1 "
                          f"to {t.num_workers}")
    if t.warmup_steps >= t.max_steps and t.lr_schedule != LRSchedule.constant:
        raise ConfigError(f"trainer.warmup_steps={t.warmup_steps} must be below trainer.max_steps={t.max_steps}")
    fused_adam = str(cfg.optimizer.get("_target_", "")).endswith("FusedAdam")
    if t.device == Device.cuda or t.precision == Precision.fp16 or fused_adam:
        import torch

        if fused_adam and not torch.cuda.is_available():
            raise ConfigError("optimizer=fused_adam (onnxruntime.training.optim.FusedAdam) needs CUDA, and this "
                              "machine has none; allowed here: optimizer=adamw, optimizer=sgd")
        if (t.device == Device.cuda or t.precision == Precision.fp16) and not torch.cuda.is_available():
            what = "trainer.device=cuda" if t.device == Device.cuda else "trainer.precision=fp16"
            raise ConfigError(f"{what} needs CUDA, and this machine has none; allowed here: trainer.device=cpu, "
                              "trainer.precision=fp32")
    if t.precision == Precision.fp16 and t.device != Device.cuda:
        raise ConfigError("trainer.precision=fp16 needs trainer.device=cuda")
    for group in ["backend", "model", "data", "optimizer"]:
        if "_target_" not in cfg[group]:
            raise ConfigError(f"{group}._target_ is missing: name the class to build")
    if not str(cfg.tracking.experiment).strip():
        raise ConfigError("tracking.experiment='': MLflow needs an experiment name; allowed: any non-empty name "
                          "(default: orchestrate)")
    check_tracking_names(cfg.tracking)
    objectives(cfg.sweep.metric, cfg.sweep.direction, "sweep.direction")
    if not 0 < cfg.compare.confidence < 1:
        raise ConfigError(f"compare.confidence={cfg.compare.confidence}: allowed: between 0 and 1 (e.g. 0.95)")


def objectives(metric: Any, direction: Any, direction_key: str) -> list[tuple[str, bool]]:
    """sweep.metric and a direction (`direction_key`: sweep.direction or hydra.sweeper.direction)
    as (metric, minimize) pairs, one per objective; ConfigError for a metric no run logs, a
    direction that is neither minimize nor maximize, or lists of different lengths."""
    metrics, directions = listed(metric), listed(direction)
    for name in metrics:
        if name not in SWEEP_METRICS:
            raise ConfigError(f"sweep.metric={name}: no run logs it; allowed: {', '.join(SWEEP_METRICS)} "
                              "(or a list of them, one objective each)")
    if len(set(metrics)) < len(metrics):
        raise ConfigError(f"sweep.metric={shown_list(metrics)}: names a metric twice; give each objective once")
    words = [str(getattr(d, "value", d)).lower() for d in directions]
    for word in words:
        if word not in ("minimize", "maximize"):
            raise ConfigError(f"{direction_key}={word}: allowed: minimize, maximize (a list: one per sweep.metric)")
    if len(words) != len(metrics):
        raise ConfigError(f"{direction_key}={shown_list(words)} gives {len(words)} direction(s) for "
                          f"sweep.metric={shown_list(metrics)}, {len(metrics)} metric(s): give one direction per "
                          f"metric, e.g. {direction_key}=[{','.join(['minimize'] * len(metrics))}]")
    return [(m, w == "minimize") for m, w in zip(metrics, words)]


def listed(value: Any) -> list:
    """A setting that takes one value or a list of them (sweep.metric, a direction), as a list."""
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]


def shown_list(values: list) -> str:
    return values[0] if len(values) == 1 else f"[{','.join(map(str, values))}]"


def check_tracking_names(tracking: DictConfig) -> None:
    """The names MLflow checks only when it is handed them (the registered model's at the run's
    end, the tags' at its start), checked before anything runs, by MLflow's own rules."""
    if tracking.register_model is None and not tracking.tags:
        return  # (MLflow's import is not paid for a config that names nothing)
    from mlflow.exceptions import MlflowException

    from orchestrate.thirdparty import mlflow_name_checks  # MLflow's own: no public way to ask them

    tag_name, model_name = mlflow_name_checks()

    checks = [(f"tracking.tags: the key {key!r}", key, tag_name,
               "a key of letters, digits, spaces and _ - . : /, not a path that leaves its folder")
              for key in tracking.tags]
    if tracking.register_model is not None:
        checks.append((f"tracking.register_model={tracking.register_model}", tracking.register_model,
                       model_name,
                       "a non-empty name without '/' or ':', or null (logged, not registered)"))
    for shown, value, validate, allowed in checks:
        try:
            validate(str(value))
        except MlflowException as e:
            raise ConfigError(f"{shown}: {e.message.rstrip('.')}; allowed: {allowed}") from None


def target_of(node: DictConfig, key: str) -> Any:
    try:
        return hydra.utils.get_object(node._target_)
    except Exception as e:
        missing = getattr(e.__cause__ or e, "name", None)  # a module that is not installed
        extra = extras.for_module(missing.split(".")[0]) if isinstance(missing, str) else None
        if extra is not None and not extra.present():
            raise ConfigError(extra.missing(f"{key}._target_={node._target_}")) from None
        reason = str(e).splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}._target_={node._target_}: cannot import it ({reason})") from None


def build(node: DictConfig, key: str, *args: Any, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate` with errors that name the config key and the allowed keys. With
    `args`, the target is `_partial_` and called with them and `kwargs` (the optimizer, on the
    parameters)."""
    target = target_of(node, key)
    parameters = inspect.signature(target).parameters
    # Leading parameters that `args` fill (the optimizer's params) are not config keys.
    allowed = [p for p in parameters if p not in ("self", "args", "kwargs")][len(args):]
    given = [k for k in node if not str(k).startswith("_")]
    unknown = [k for k in given if k not in allowed and "kwargs" not in parameters]
    if unknown:
        named = ", ".join(f"{key}.{k}" for k in unknown)
        raise ConfigError(f"{named}: unknown key{'s' if len(unknown) > 1 else ''} for {node._target_}; allowed keys: "
                          f"{', '.join(allowed)}{how_to_drop(key, unknown, node._target_)}")
    for name in given:
        # e.g. model=char_transformer with data=digits: model.vocab_size is ${data.vocab_size},
        # which digits lacks (OmegaConf's own error names neither key).
        try:
            node[name]
        except InterpolationResolutionError as e:
            raw = OmegaConf.to_container(node, resolve=False)[name]
            raise ConfigError(f"{key}.{name}={raw}: {(e.msg or str(e)).splitlines()[0]}; set {key}.{name} to a value, "
                              "or choose groups that go together") from None
    declared = ranges_of(target)  # Annotated[..., Range] on its fields or constructor parameters
    for name in given:
        check_value(f"{key}.{name}", node[name], declared.get(name))
    if is_dataclass(target):
        # Dataclass targets (the backends) also get their field types checked.
        try:
            OmegaConf.merge(OmegaConf.structured(target), {k: node[k] for k in given})
        except OmegaConfBaseException as e:
            raise ConfigError(f"{key}.{e.key}: {e.msg.splitlines()[0]}") from None
    try:
        built = hydra.utils.instantiate(node, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, (ValueError, TypeError, FileNotFoundError)):
            # First line only: torch lists every signature it expected below it.
            raise ConfigError(f"{key} ({node._target_}): {str(cause).strip().splitlines()[0]}") from None
        errors.mark(cause, what=f"{key} ({node._target_})")  # the user's own error, with its traceback
        raise cause from None
    if not args:
        return built
    try:
        return built(*args, **kwargs)
    except Exception as e:  # torch.optim's own argument checks, or a value they did not expect
        raise ConfigError(refused(node, key, target, args, e)) from None


def how_to_drop(key: str, names: list[str], target: str) -> str:
    """How to get rid of the keys the target does not take (all of them). Typically
    `model._target_=pkg.MyNet` on the command line keeps the default group file's keys
    (model.in_features, model.hidden): delete each with `~`, or, cleaner, give the class a config
    file of its own in the user's config folder."""
    if key not in ("backend", "model", "data", "optimizer"):
        return ""  # e.g. backend.engine: the engine's own conf/backend file is wrong
    stem = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", target.rsplit(".", 1)[-1]).lower()
    drops = " ".join(f"~{key}.{n}" for n in names)
    return (f"; drop {'it' if len(names) == 1 else 'them'} with {drops}, or give {target} a config file of its own "
            f"({key}/{stem}.yaml in a folder passed with --config-dir, then {key}={stem})")


# What torch.optim's constructors accept for the arguments they check (torch/optim/*.py).
TORCH_OPTIM_ALLOWED = {"lr": "a number, 0 or more", "eps": "a number, 0 or more",
                       "weight_decay": "a number, 0 or more", "momentum": "a number, 0 or more",
                       "betas": "two numbers in [0, 1)"}


def refused(node: DictConfig, key: str, target: Any, args: tuple, error: Exception) -> str:
    """The message for a value the target's constructor refused, naming the key when one value
    alone is refused: each given value is tried on its own, the others left at their defaults
    (cheap for an optimizer; values refused only together name no key)."""
    reason = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    values = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not str(k).startswith("_")}
    signature = inspect.signature(target)
    try:
        target(*args)  # all defaults: when this fails too (no parameters at all), no key is to blame
    except Exception:
        return f"{key} ({node._target_}): {reason}"
    for name, value in values.items():
        try:
            signature.bind(*args, **{name: value})
        except TypeError:
            continue  # the target needs more keys than this one: no verdict on it alone
        try:
            target(*args, **{name: value})
        except Exception:
            allowed = TORCH_OPTIM_ALLOWED.get(name) if target.__module__.startswith("torch.optim") else None
            return (f"{key}.{name}={shown(value)} ({node._target_}): {reason}"
                    + (f"; allowed: {allowed}" if allowed else ""))
    return f"{key} ({node._target_}): {reason}"
