"""`python -m orchestrate [overrides]`, a training run or a sweep: check the command line, then
hand it to the Hydra app.

Bad input (an unknown key or choice, a wrong type, an impossible combination) is caught here by
composing the config and building its objects once, before Hydra creates an output folder or a
run is opened in MLflow: one plain message, exit code 2. A sweep (`-m`, `+sweep`) is checked the
same way, every trial of it, before any runs, whatever the launcher; and its MLflow bookkeeping
(orchestrate.sweeps.callbacks) is closed here even when the sweeper raised.
"""

import contextlib
import io
import os
import sys

from hydra.types import RunMode
from omegaconf import OmegaConf

from orchestrate import app, errors, schema
from orchestrate.boundary import CHECK, COMMAND, Where, boundary
from orchestrate.cluster.runtime import COLD, Runtime, entered
from orchestrate.config import ORCHESTRATE, Composer, ConfigSource, load_config, searching

MULTIRUN_FLAGS = ("-m", "--multirun")


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's own flags (--cfg, -m, hydra/...) versus config overrides."""
    flags, overrides = [], []
    it = iter(argv)
    for arg in it:
        if arg.startswith("-"):
            flags.append(arg)
            if arg in ("--cfg", "-c", "--package", "-p", "--info", "--experimental-rerun",
                       *ConfigSource.FLAGS) and "=" not in arg:
                nxt = next(it, None)
                if nxt is not None:
                    flags.append(nxt)
        elif arg.startswith(("hydra.", "hydra/", "+hydra", "~hydra")):
            flags.append(arg)
        else:
            overrides.append(arg)
    return flags, overrides


def validate(overrides: list[str], source: ConfigSource, hydra_overrides: list[str] = (),
             trial: str = "", compose: Composer | None = None, cache: app.CheckCache | None = None,
             own_run: bool = False, unavailable: dict[str, list[str]] | None = None,
             runtime: Runtime = COLD) -> app.Checked | None:
    """Compose and build one run's config once, from the same config folders and search path as
    the run (`source`, `hydra.searchpath` among `hydra_overrides`); exit 2 with one message if it
    is wrong. `trial` prefixes the message of a config that composes but is refused (which trial
    of a sweep); a sweep's trials share a `compose` (Composer) and what `cache` keeps.
    `own_run`: the run's own command, whose backend may begin what it needs meanwhile; its
    check (app.Checked: the job and the MLflow run) is returned, for the run to take over.
    `unavailable` (a sweep's): a trial whose backend this environment lacks is kept there, under
    the line that says what it lacks, instead of refused, so that the other trials are checked too.
    `runtime`: how the command started (the entry's choice: `main`)."""
    with boundary(Where(CHECK, trial=trial, overrides=overrides, source=source)):
        # Libraries chatter on import (torch's C++ extension loader prints about CUDA): keep the
        # check quiet so that bad input gets one message.
        with contextlib.redirect_stderr(io.StringIO()):
            # One run: composed once, as Hydra will; a sweep's trials: through its Composer.
            cfg = compose(overrides) if compose else load_config([*hydra_overrides, *overrides], source)
            why = app.unavailable(cfg) if unavailable is not None else None
            if why:
                unavailable.setdefault(why, []).append(trial.rstrip(": "))
                return None
            began = app.start_early(cfg, runtime) if own_run and runtime.early_start else contextlib.nullcontext()
            with began, searching(source):
                checked = app.check(cfg, cache, runtime)
    # The run's own command: the run takes the job over instead of building it again.
    return checked if own_run else None


def validate_sweep(flags: list[str], overrides: list[str], source: ConfigSource, runtime: Runtime = COLD) -> None:
    """Check every trial of a sweep before anything runs (no launcher does it for us): the sweep
    expanded as Hydra's basic sweeper expands it, an Optuna search space by its choices and the
    ends of its intervals (orchestrate.sweeps.plan); a bad choice gets the single run's message."""
    from orchestrate.sweeps import early, plan, remote

    hydra_overrides = hydra_words(flags)
    with boundary(Where(CHECK, overrides=[*hydra_overrides, *overrides], source=source)):
        cfg = load_config([*hydra_overrides, *overrides], source, run_mode=RunMode.MULTIRUN, with_hydra=True)
        trials = plan.trials(cfg)
        check_sweeper(cfg)
        remote.check_reporting(cfg)  # trials on a cluster's other hosts: can they report back?
    if not trials:
        fail(f"{' '.join(overrides) or 'the sweep'}: the sweep has no trials (an empty range or list); "
             "allowed: at least one value per swept key")
    check_trial_resources(cfg.hydra.launcher)
    # The sweep's MLflow server and Ray start now, beside the check (stopped again if it refuses).
    compose, cache, unavailable = Composer(source, hydra_overrides), app.CheckCache(), {}
    with early.start_early(cfg, len(trials), runtime) if runtime.early_start else contextlib.nullcontext():
        for index, trial in enumerate(trials):
            validate([o for o in trial if not is_hydra(o)], source, hydra_overrides,
                     trial=f"trial {index} ({' '.join(trial)}): ", compose=compose, cache=cache,
                     unavailable=unavailable, runtime=runtime)
        if unavailable:  # refused once the others are checked: the line says all that is missing
            left = len(trials) - sum(map(len, unavailable.values()))
            fail("; ".join(f"{', '.join(named)}: {why}" for why, named in unavailable.items()) +
                 (f"; the sweep's other {left} trial(s) were checked and train here: drop the ones named"
                  if left else ""))
    if OmegaConf.select(cfg, "hydra.launcher.dry_run", default=False) and not plan.is_grid(cfg):
        # A sampling sweeper (Optuna) picks each trial from the results before it: with nothing
        # run there is no next trial, only the space it would sample from, checked above.
        sweeper = str(cfg.hydra.sweeper._target_).rsplit(".", 1)[-1]
        print(f"dry run: {sweeper} would run {OmegaConf.select(cfg, 'hydra.sweeper.n_trials', default='?')} "
              f"trial(s), each drawn from: {' '.join(plan.search_space(cfg))}; every choice and both ends of "
              "every interval were checked; nothing ran", flush=True)
        sys.exit(0)


def check_sweeper(cfg) -> None:
    """The sweep's objectives (sweep.metric against the sweeper's direction, or sweep.direction),
    a comparison's repeats, and the asynchronous Optuna sweeper's own settings, checked with the
    trials: before the sweep's MLflow run opens (Hydra opens it before it sets the sweeper up)."""
    from orchestrate.sweeps import compare
    from orchestrate.sweeps.pruning import SWEEPER

    # sweep.direction first: the Optuna sweeper's direction follows it, and the trials (their
    # registered model's alias, their pruner) read it.
    schema.objectives(cfg.sweep.metric, cfg.sweep.direction, "sweep.direction")
    if OmegaConf.select(cfg, "hydra.sweeper.direction") is not None:
        schema.objectives(cfg.sweep.metric, cfg.hydra.sweeper.direction, "hydra.sweeper.direction")
    compare.check(cfg)
    if OmegaConf.select(cfg, "hydra.sweeper._target_") != SWEEPER:
        return
    from orchestrate.sweeps import _optuna

    _optuna.check_settings(OmegaConf.select(cfg, "hydra.sweeper.direction"),
                           OmegaConf.select(cfg, "hydra.sweeper.n_jobs"),
                           str(OmegaConf.select(cfg, "hydra.launcher._target_", default="")),
                           pruner=OmegaConf.select(cfg, "hydra.sweeper.pruner._target_", default=None))
    _optuna.check_storage(OmegaConf.select(cfg, "hydra.sweeper.storage"), cfg.tracking.uri)


def is_hydra(word: str) -> bool:
    return word.lstrip("+~").startswith(("hydra.", "hydra/"))


def hydra_words(flags: list[str]) -> list[str]:
    """The `hydra.*` and `hydra/...` overrides among the flags (`hydra.searchpath=[...]`, ...)."""
    return [f for f in flags if is_hydra(f)]


def check_trial_resources(launcher) -> None:
    """orchestrate's Ray launcher on a new local Ray: a trial that asks for more CPUs or GPUs than
    this machine has could never start (the launcher would say so only once Ray is up)."""
    if not str(launcher.get("_target_", "")).endswith("OrchestrateRayLauncher"):
        return
    address, key = (launcher.address, "hydra.launcher.address") if launcher.address else \
        (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
    if address:
        from orchestrate.cluster import ray_cluster
        from orchestrate.launch import _core

        _core.before_ray_import()  # the check imports Ray: the launcher's settings first
        try:  # a cluster that is not there or refuses this process: seconds, before any run opens
            ray_cluster.check_access(address, key)
        except ray_cluster.RayUnavailable as e:
            fail(str(e))
    if launcher.address or os.environ.get("RAY_ADDRESS"):
        return  # a cluster: the launcher waits placement_timeout_s for room, which may come
    cpus = launcher.num_cpus if launcher.num_cpus is not None else os.cpu_count()
    if launcher.cpus_per_trial > cpus:
        fail(f"hydra.launcher.cpus_per_trial={launcher.cpus_per_trial:g}: a trial asks for more CPUs than the local "
             f"Ray instance has ({cpus:g}); allowed: 0 to {cpus:g}, or hydra.launcher.address of a larger cluster")
    if launcher.gpus_per_trial:
        import torch

        gpus = torch.cuda.device_count()
        if launcher.gpus_per_trial > gpus:
            fail(f"hydra.launcher.gpus_per_trial={launcher.gpus_per_trial:g}: this machine has {gpus} GPU(s); "
                 "allowed: 0, or hydra.launcher.address of a cluster with GPUs")


def strip_source_flags(flags: list[str]) -> list[str]:
    """The flags without --config-path/-name/-dir (and their values): ConfigSource.as_flags
    gives them back, absolute."""
    out, it = [], iter(flags)
    for flag in it:
        if flag.partition("=")[0] in ConfigSource.FLAGS:
            if "=" not in flag:
                next(it, None)
        else:
            out.append(flag)
    return out


def fail(message: str) -> None:
    """Refuse the command line: its line, exit code 2 (the boundary around `main`'s check)."""
    raise errors.Refused(message)


def rewrite_sweep_words(argv: list[str], source: ConfigSource = ORCHESTRATE) -> list[str]:
    """Hydra's grammar rejects a bare `+sweep` ("missing EQUAL"), so it is read here:
    `+sweep` -> multirun with the experiment's sweep; `+sweep=NAME` -> multirun with
    conf/sweep/NAME.yaml; `+dry_run` -> print the sweep's plan and run nothing."""
    out, multirun = [], False
    for arg in argv:
        if arg == "+sweep":
            multirun = True
        elif arg.startswith("+sweep="):
            multirun = True
            out.append(arg[1:])  # `sweep` is in the defaults list: override the choice
        elif arg == "+dry_run":
            multirun = True
            out.append("hydra.launcher.dry_run=true")
        else:
            out.append(arg)
    if "+sweep" in argv:
        # The experiment's sweep, or the configured default when it names none.
        flags, overrides = split_args(out)
        try:
            cfg = load_config([*hydra_words(flags), *overrides], source)
            if cfg.sweep.name == "none":
                out.append(f"sweep={cfg.sweep.default}")
        except Exception:
            pass  # composition errors are reported by Hydra itself, with the whole command line
    if multirun and not any(a in MULTIRUN_FLAGS for a in out):
        out.insert(0, "--multirun")
    return out


def check_flags(argv: list[str]) -> None:
    """Options Hydra's parser does not know (`--nope`) or refuses (`--cfg nope`): one line, not
    argparse's usage text."""
    from orchestrate.thirdparty import hydra_internals, option_strings

    parser = hydra_internals().get_args_parser()

    def refuse(message: str) -> None:
        raise ValueError(message)

    parser.error = refuse
    try:
        _, unknown = parser.parse_known_args(argv)
    except ValueError as e:
        fail(f"{e}; see --help")
    if unknown:
        options = ", ".join(option_strings(parser))
        fail(f"{unknown[0]}: unknown option; allowed: {options}")


def check_sweep_choice(overrides: list[str]) -> None:
    """`sweep=NAME` alone would run one job with the sweep's settings unused."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "sweep" and value not in ("", "none"):
            fail(f"{o}: a sweep runs with -m or +sweep={value}; without them this would be one run, the sweep "
                 "unused; allowed without -m: sweep=none")


def main() -> None:
    """The command: its runtime chosen once, here (cold, or the warm stack `orchestrate up` left
    running: orchestrate.cluster.runtime), then checked, then run with that runtime handed down."""
    from orchestrate.cluster import warm

    with boundary(Where(CHECK)):  # its record and sockets read in one line if anything goes wrong
        chosen = warm.runtime()
    with entered(chosen):
        run(chosen)


def run(chosen: Runtime) -> None:
    from orchestrate.cluster import ray_cluster

    had_ray = ray_cluster.how() is not None  # a caller's own (a notebook, a test session): left as it is
    with boundary(Where(CHECK)):
        # Options only: overrides may come before or after them (they are handed to Hydra after them).
        check_flags([f for f in split_args(sys.argv[1:])[0] if not is_hydra(f)])
        # --config-path, --config-name, --config-dir: the user's own config folders.
        source = ConfigSource.from_flags(split_args(sys.argv[1:])[0])
        argv = rewrite_sweep_words(sys.argv[1:], source)
        flags, overrides = split_args(argv)
        multirun = any(f in MULTIRUN_FLAGS for f in flags)
        checked = None  # the single run's check (its job and MLflow run), which the run takes over
        if not any(f.startswith(("--cfg", "-c", "--info", "--help", "-h", "--hydra-help")) for f in flags):
            if multirun:
                validate_sweep(flags, overrides, source, chosen)
            else:
                check_sweep_choice(overrides)
                checked = validate(overrides, source, hydra_words(flags), own_run=True, runtime=chosen)
    # Hydra gets the same folders, made absolute (it would read a relative --config-path as
    # relative to orchestrate's code, not to where the user is).
    flags = strip_source_flags(flags)
    sys.argv = [sys.argv[0], *source.as_flags(), *flags, *overrides]
    where = Where(COMMAND, multirun=multirun)
    from orchestrate.sweeps import slurm

    try:
        # What Hydra would print as a traceback: one line here (the boundary's).
        with boundary(where), errors.hydra_raising(), slurm.jobs_in_one_line():
            app.hydra_app(checked, chosen)()
    finally:
        if multirun:
            # Hydra calls the callbacks' on_multirun_end only when the sweeper returns; a failed
            # trial makes it raise. The summary, the parent run and the server are closed here.
            from orchestrate.sweeps import early
            from orchestrate.sweeps.callbacks import close_open_sweeps

            # A Slurm sweep's launcher stops at the first job that ended without a result: the
            # jobs still on the cluster are waited for (cancelled after Ctrl-C) before the summary.
            slurm.settle(cancel=isinstance(where.handled, KeyboardInterrupt))
            close_open_sweeps()
            early.release()  # a server started early that no sweep took (Hydra stopped first)
        # A Ray started early and never taken (Hydra stopped before the launcher or the run asked
        # for it) is shut down here, not torn down mid-start when the process exits; the Ray the
        # command started or joined (a sweep's launcher) is let go.
        ray_cluster.cancel_background_init()
        if not had_ray:
            ray_cluster.leave()
