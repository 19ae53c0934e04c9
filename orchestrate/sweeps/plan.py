"""A sweep's trials, worked out before anything runs: from the multirun config (composed as Hydra's
`multirun()` composes it: `orchestrate.config.load_config(..., run_mode=RunMode.MULTIRUN)`), its sweep
(`hydra.sweeper.params` plus the command line's sweep overrides) expanded as Hydra's BasicSweeper
expands it. Used by `orchestrate/cli.py` to check every trial's config up front, whatever the
launcher, and by the sweep callbacks to list the trials a grid sweep never reached."""

import hashlib
import itertools
import json

from omegaconf import DictConfig, OmegaConf

from orchestrate.schema import ConfigError
from orchestrate.thirdparty import GRID_SWEEPER

# Settings that say how much of a sweep runs, not which sweep it is: running it again with more
# trials (or more at once) continues the same parent run and the same study.
HOW_MUCH = ("n_trials", "n_jobs", "max_batch_size")
GRID_SWEEPERS = (GRID_SWEEPER,
                 "hydra_plugins.orchestrate_grid_sweeper.grid_sweeper.OrchestrateGridSweeper")


def trials(cfg: DictConfig) -> list[list[str]]:
    """Every trial's overrides, in the order (and so with the `hydra.job.num`) BasicSweeper gives
    them: the config's `hydra.sweeper.params` first, then the command line's overrides, a later
    override of a key replacing an earlier one. A sweeper that samples (Optuna) gets candidates
    instead, enough for each value to be in one: each choice, and both ends of an interval
    (`interval(a, b)`, `tag(log, interval(a, b))`) or a range, between which it samples. Not every
    combination: a search space's product can be far larger than the trials it will run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    node = OmegaConf.select(cfg, "hydra.sweeper.params")
    params = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    lines = [f"{k}={v}" for k, v in params.items()] + list(cfg.hydra.overrides.task)
    grid = is_grid(cfg)
    n_trials = OmegaConf.select(cfg, "hydra.sweeper.n_trials")
    if not grid and n_trials is not None and n_trials < 1:
        raise ConfigError(f"hydra.sweeper.n_trials={n_trials}: must be at least 1")
    choices: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        if grid and override.is_interval_sweep():
            raise ConfigError(f"{key}=interval(...): Hydra's basic sweeper runs a grid and cannot draw from an "
                              "interval; allowed: a list (a,b,c) or range(start,stop,step), or a sampling sweeper "
                              "(+sweep=lr_optuna)")
        if override.is_interval_sweep() or (override.is_range_sweep() and not grid and not override.value().shuffle):
            # Optuna draws from [start, end] of an interval and [start, stop] of a range (its `high`).
            span = override.value()
            values = [span.start, span.end if override.is_interval_sweep() else span.stop]
        elif override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()]
        choices[key] = [f"{key}={v}" for v in values]
    if grid:
        return [list(t) for t in itertools.product(*choices.values())]
    most = max((len(v) for v in choices.values()), default=1)
    return [[v[i % len(v)] for v in choices.values()] for i in range(most)]


def search_space(cfg: DictConfig) -> list[str]:
    """The sweep's search space as written: `hydra.sweeper.params`, where the command line's
    overrides of the same key replace them (a fixed value takes the key out of the space)."""
    node = OmegaConf.select(cfg, "hydra.sweeper.params")
    params = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    from hydra.core.override_parser.overrides_parser import OverridesParser

    space = {k: f"{k}={v}" for k, v in params.items()}
    task = list(cfg.hydra.overrides.task)
    for line, override in zip(task, OverridesParser.create().parse_overrides(task)):
        key = override.get_key_element().lstrip("+~")
        space.pop(key, None)
        if override.is_sweep_override():
            space[key] = line
    return list(space.values())


def is_grid(cfg: DictConfig) -> bool:
    """Whether the sweeper runs exactly `trials(cfg)` (Hydra's basic sweeper), not a sample of them."""
    return OmegaConf.select(cfg, "hydra.sweeper._target_") in GRID_SWEEPERS


def sweep_key(cfg: DictConfig) -> str:
    """Same command line, same sweep definition: same key, hence the same parent run and study on
    a re-run. The launcher is not part of it (a sweep started on Ray can be finished with another),
    nor are HOW_MUCH's settings."""
    sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=False)
    sweeper = {k: v for k, v in sweeper.items() if k not in HOW_MUCH}
    text = json.dumps({"overrides": sorted(cfg.hydra.overrides.task), "sweeper": sweeper}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
