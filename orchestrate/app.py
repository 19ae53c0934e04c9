"""One training run, in order: validate, seed, start tracking, fit, summarise.

    python -m orchestrate                                   # defaults: conf/config.yaml
    python -m orchestrate backend=ondevice trainer.max_steps=500
    python -m orchestrate model=char_transformer data=python_source
"""

import contextlib
import copy
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from orchestrate import checkpoints, plots, process, schema
from orchestrate.job import Job
from orchestrate.meter import Diverged
from orchestrate.redact import redact_text
from orchestrate.resume import close_orphans, config_key, find_resume
from orchestrate.tracking import Tracker, finished_run_metrics, handed_over_run, reachable, ui_command


# orchestrate's own configs travel inside the package (in a checkout, `conf/` and `experiments/` at
# the top are links to them): the same place whether it runs from a checkout or an installed wheel.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
schema.register()


@dataclass
class Result:
    run_id: str
    metrics: dict[str, float]
    out_dir: Path
    history: dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], as logged


@dataclass(frozen=True)
class ConfigSource:
    """Where the configs come from, as Hydra's own command-line flags say: the primary config
    (orchestrate's `conf/config.yaml`, or a user's own with `--config-path DIR --config-name NAME`),
    plus a user's folder of extra groups (`--config-dir DIR`); `hydra.searchpath` overrides are
    read by Hydra itself. The up-front checks compose with exactly the search path the run will use."""

    config_path: str | None = None  # absolute; None: orchestrate's conf/
    config_name: str = "config"
    config_dir: str | None = None  # absolute

    FLAGS = {"--config-path": "config_path", "-cp": "config_path", "--config-name": "config_name",
             "-cn": "config_name", "--config-dir": "config_dir", "-cd": "config_dir"}

    @classmethod
    def from_flags(cls, flags: list[str]) -> "ConfigSource":
        """Read `--config-path`, `--config-name`, `--config-dir` (and -cp, -cn, -cd, `=VALUE` or
        the next word). Folders are taken relative to the working directory, as users mean them
        (Hydra would take a relative --config-path relative to orchestrate's own code)."""
        found: dict[str, str] = {}
        it = iter(flags)
        for flag in it:
            name, _, value = flag.partition("=")
            if name in cls.FLAGS:
                found[cls.FLAGS[name]] = value or next(it, "")
        for key in ("config_path", "config_dir"):
            if key in found:
                folder = Path(found[key]).expanduser().resolve()
                if not folder.is_dir():
                    flag = "--" + key.replace("_", "-")
                    raise schema.ConfigError(f"{flag} {found[key]}: no such folder ({folder})")
                found[key] = str(folder)
        return cls(**found)

    def as_flags(self) -> list[str]:
        """The same flags for Hydra's own command line, folders made absolute."""
        flags = [f"--config-name={self.config_name}"]
        if self.config_path:
            flags.append(f"--config-path={self.config_path}")
        if self.config_dir:
            flags.append(f"--config-dir={self.config_dir}")
        return flags


ORCHESTRATE = ConfigSource()


@contextlib.contextmanager
def _hydra(source: ConfigSource = ORCHESTRATE) -> Iterator[None]:
    """Hydra's config loader: the running app's (its search path), or, outside an app, the search
    path `hydra.main` would build from `source` (the same two steps as Hydra's own `_run_hydra`:
    the primary config folder, then `--config-dir` ahead of it)."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.version import setbase

    setbase("1.3")
    search_path = create_automatic_config_search_path(None, __name__, source.config_path or "conf")
    if source.config_dir:
        search_path.prepend(provider="command-line", path=f"file://{source.config_dir}",
                            anchor=SearchPathQuery(provider="schema"))
    Hydra.create_main_hydra2(task_name="app", config_search_path=search_path)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def load_config(overrides: list[str] = (), source: ConfigSource = ORCHESTRATE,
                run_mode: RunMode = RunMode.RUN, with_hydra: bool = False) -> DictConfig:
    """Compose the primary config (`conf/config.yaml` unless `source` names the user's own) with
    command-line style overrides, `hydra.*` ones included (`hydra.searchpath=[file://DIR]`). Inside
    a running app, its own primary config and search path."""
    with _hydra(source):
        config_name = source.config_name
        if HydraConfig.initialized():
            config_name = HydraConfig.get().job.config_name or config_name
        cfg = GlobalHydra.instance().hydra.compose_config(
            config_name=config_name, overrides=list(overrides), run_mode=run_mode,
            from_shell=run_mode == RunMode.MULTIRUN, with_log_configuration=False)
    if not with_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


class Composer:
    """The configs of many runs that differ in plain values, such as a sweep's trials, composed as
    `load_config` composes each, for a fraction of the cost: Hydra composes each distinct choice
    of config groups once (reading and merging a dozen files, about 0.1 s), and a run's other
    overrides (`optimizer.lr=0.01`, `+trainer.x=1`, `~key`) are applied to a copy of it, as Hydra
    itself applies them after composing (`ConfigLoaderImpl._apply_overrides_to_config`, on the
    struct-mode config). With a `hydra.searchpath` override, which changes where groups are
    found, every run is composed in full; Hydra's other settings do not reach the run's config."""

    def __init__(self, source: ConfigSource = ORCHESTRATE, hydra_overrides: list[str] = ()):
        self.source, self.hydra_overrides = source, list(hydra_overrides)
        self.in_full = any(o.lstrip("+~").startswith("hydra.searchpath") for o in self.hydra_overrides)
        self.composed: dict[tuple[str, ...], DictConfig] = {}
        self.repo = None  # Hydra's config repository on the composition's search path, made once

    def __call__(self, overrides: list[str]) -> DictConfig:
        if self.in_full:
            return load_config([*self.hydra_overrides, *overrides], self.source)
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser

        if self.repo is None:
            with _hydra(self.source):
                config_name = self.source.config_name
                if HydraConfig.initialized():
                    config_name = HydraConfig.get().job.config_name or config_name
                # The search path as Hydra builds it for a composition, once: a primary config of
                # the user's own may add orchestrate's groups with its `hydra.searchpath`.
                _, self.repo = GlobalHydra.instance().config_loader()._parse_overrides_and_create_caching_repo(
                    config_name, [])
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        # Hydra's own split (hydra/_internal/defaults_list.py, Overrides): a group's choice, or a
        # value for the config.
        plain = [o for o in parsed if isinstance(o.value(), dict) or not self.repo.group_exists(o.key_or_group)]
        groups = tuple(o.input_line for o in parsed if o not in plain)
        if groups not in self.composed:
            self.composed[groups] = load_config(list(groups), self.source)
        cfg = copy.deepcopy(self.composed[groups])
        ConfigLoaderImpl._apply_overrides_to_config(plain, cfg)
        return cfg


def group_options(group: str, source: ConfigSource = ORCHESTRATE) -> list[str]:
    """The options of a config group on the search path, e.g. the backends."""
    with _hydra(source):
        return GlobalHydra.instance().config_loader().get_group_options(group)


def device_name(cfg: DictConfig) -> str:
    import platform

    import torch

    if cfg.trainer.device.value == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()})"


def head_start(cfg: DictConfig) -> contextlib.AbstractContextManager:
    """The backend's head start (`Backend.head_start`: the runner's Ray) around the check of a
    run's config; a config whose backend does not build gets none (the check says why)."""
    try:
        backend = schema.target_of(cfg.backend, "backend")
    except Exception:
        return contextlib.nullcontext()
    return backend.head_start(cfg.backend)


@dataclass
class Checked:
    """What the checks of many configs (a sweep's trials) share."""

    stores: dict[str, str | None] = field(default_factory=dict)  # tracking URI -> `reachable`'s answer
    models: dict[str, Any] = field(default_factory=dict)  # built and run on their data (Job.prepare's `models`)


def check(cfg: DictConfig, checked: Checked | None = None) -> None:
    """Refuse bad input before anything is written or run: build the job once (data, model,
    backend) and resolve `trainer.resume` (which only reads the store). Raises schema.ConfigError.
    Checks of many configs share `checked`: each tracking URI is asked once, and a model is built
    and run once per distinct model, data and seed."""
    checked = checked or Checked()
    uri = cfg.tracking.uri
    if uri not in checked.stores:  # first: a store that is not there fails in seconds, not minutes
        checked.stores[uri] = reachable(uri)
    if checked.stores[uri]:
        raise schema.ConfigError(checked.stores[uri])
    Job.prepare(cfg, out_dir="unused", models=checked.models)
    find_resume(cfg)


def train(cfg: DictConfig, out_dir: Path) -> Result:
    """Train once as `cfg` says; the MLflow run holds everything the run produced. The process
    is left as it was found (thread counts, environment: orchestrate.process)."""
    job = Job.prepare(cfg, out_dir)  # ConfigError here: nothing has been written anywhere yet
    in_sweep = handed_over_run() is not None  # a sweep's trial (MLflow's end_run takes the variable back)
    choices = f"{job.backend.name}-{Path(cfg.model._target_).suffix[1:]}-{Path(cfg.data._target_).suffix[1:]}"
    tags = {"backend": job.backend.name, "device": device_name(cfg), "model": cfg.model._target_,
            "data": cfg.data._target_, "config_key": config_key(cfg)}
    # e.g. a Ray cluster with room for the runner's workers; ConfigError before any run opens if not.
    # SIGTERM stops the run as Ctrl-C does: the MLflow run ends KILLED, Ray is shut down.
    with process.kept(), process.stop_on_signals(), job.backend.connect(job):
        resume = find_resume(cfg)  # trainer.resume: the run and checkpoint to continue, or None
        if resume is not None:
            job.resume_state = checkpoints.load_checked(job.backend, job.model,
                                                        resume.fetch(job.out_dir / "checkpoints"))
            print(f"resuming MLflow run {resume.run_id} after step {resume.step}", flush=True)
        elif cfg.trainer.resume == "auto":
            print("trainer.resume=auto: no unfinished run with this config has a checkpoint; starting a new run",
                  flush=True)
        with Tracker(cfg, run_name=choices.lower(), tags=tags, out_dir=job.out_dir,
                     resume_run_id=resume.run_id if resume else None) as tracker:
            job.track(tracker)
            if cfg.trainer.resume == "auto":
                for orphan in close_orphans(cfg, tracker.run_id):
                    print(f"MLflow run {orphan} marked KILLED: its process ended without closing it", flush=True)
            if resume is not None:
                job.meter.continue_history(tracker.logged_history())
            job.backend.fit(job)
            job.meter.close()
            metrics = job.meter.summary()
            tracker.log_metrics({f"final/{k}": v for k, v in metrics.items()}, step=cfg.trainer.max_steps)
            png = plots.loss_curves({job.backend.name: job.meter.history}, job.out_dir / "loss_curves.png",
                                    title=choices)
            tracker.log_artifact(png)
    result = Result(run_id=tracker.run_id, metrics=metrics, out_dir=job.out_dir, history=job.meter.history)
    print_summary(cfg, job, result, in_sweep)
    return result


def print_summary(cfg: DictConfig, job: Job, result: Result, in_sweep: bool) -> None:
    m = result.metrics
    lines = [f"backend {job.backend.name}: {cfg.trainer.max_steps} steps in {m.get('wall_time_s', 0):.1f} s"]
    for key, label in [("train_loss", "final train loss"), ("eval_loss", "eval loss"),
                       ("eval_accuracy", "eval accuracy"), ("samples_per_sec", "samples/s"),
                       ("step_time_ms", "step time (ms)")]:
        if key in m:
            lines.append(f"  {label:<18} {m[key]:,.4f}" if m[key] < 100 else f"  {label:<18} {m[key]:,.0f}")
    lines += [f"  MLflow run         {result.run_id} (experiment '{cfg.tracking.experiment}' in "
              f"{redact_text(cfg.tracking.uri)})",
              f"  outputs            {result.out_dir}"]
    # Hydra's job log (hydra.job_logging's file handler): all of the run's logging, ORT's output that
    # the console left out (backend.log_level) included. Only for the Hydra job this run is.
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is not None and Path(hydra_cfg.runtime.output_dir).resolve() == result.out_dir.resolve():
        handler = (hydra_cfg.job_logging or {}).get("handlers", {}).get("file") or {}
        if handler.get("filename") and Path(handler["filename"]).is_file():
            lines.append(f"  full log           {handler['filename']}")
    if job.backend.distributed:  # the runner's workers log beside it (those on this node)
        from orchestrate.backends.runner.worker import WORKER_LOG

        if any(result.out_dir.glob(WORKER_LOG.format(rank="*"))):
            lines.append(f"  workers' logs      {result.out_dir / WORKER_LOG.format(rank='*')}")
    if not in_sweep:  # a sweep's trial: the sweep's summary says where to look
        lines.append(f"  open the UI with   {ui_command(cfg.tracking.uri)}")
    print("\n".join(lines), flush=True)


def diverged_message(e: Diverged, folder: Path) -> str:
    """One line: the step, the run FAILED, the checkpoint kept from before it, what to do next."""
    kept = checkpoints.latest(folder)
    return (f"{e}; the MLflow run is marked FAILED. "
            + (f"The last checkpoint before it, {kept}, is kept: " if kept else "No checkpoint was written before it: ")
            + "lower optimizer.lr and run again (a new run), or keep the updates of finite steps only with "
              "trainer.on_nonfinite=skip")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    """One job: a single run, or one trial of a sweep (which returns `sweep.metric` to the sweeper)."""
    hydra_cfg = HydraConfig.get()
    earlier = finished_run_metrics()
    if earlier is not None:  # a resumed sweep hands a finished trial its old run: nothing to train
        print(f"trial {hydra_cfg.job.num} ({','.join(hydra_cfg.overrides.task)}) finished in an earlier attempt: "
              "skipped", flush=True)
        return earlier.get(f"final/{cfg.sweep.metric}")
    try:
        result = train(cfg, Path(hydra_cfg.runtime.output_dir))
    except schema.ConfigError as e:
        if hydra_cfg.mode != RunMode.RUN:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except checkpoints.CheckpointError as e:  # a full disk: one line, not a traceback through torch
        if hydra_cfg.mode != RunMode.RUN:
            raise
        print(f"error: {e}; the MLflow run is marked FAILED", file=sys.stderr)
        sys.exit(1)
    except Diverged as e:
        if hydra_cfg.mode != RunMode.RUN:
            raise
        print(f"error: {diverged_message(e, Path(hydra_cfg.runtime.output_dir) / 'checkpoints')}", file=sys.stderr)
        sys.exit(1)
    except process.Stopped as e:
        if hydra_cfg.mode != RunMode.RUN:
            raise
        print(f"stopped by {e}: the MLflow run is marked KILLED; the same command with trainer.resume=auto "
              "continues it from its last checkpoint", file=sys.stderr)
        sys.exit(128 + e.signum)  # as a shell reports a process ended by the signal
    return result.metrics.get(cfg.sweep.metric)
