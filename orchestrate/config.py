"""Where configs come from and how they are composed: orchestrate's own `conf/` (inside the
package), a user's primary config or extra groups (`ConfigSource`, Hydra's own flags), one config
(`load_config`), many configs that differ in plain values (`Composer`, a sweep's trials), and a
group's options (`group_options`: the backends, the models). Anything may import it, the backends
included: it builds nothing and imports no backend.
"""

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from orchestrate import schema

# orchestrate's own configs travel inside the package (in a checkout, `conf/` and `experiments/` at
# the top are links to them): the same place whether it runs from a checkout or an installed wheel.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
schema.register()


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
# Module state: where a composition without a source of its own looks (Hydra composes the run's
# config deep inside its own calls); `searching` sets it for its block and puts it back.
_SEARCHED = [ORCHESTRATE]


@contextlib.contextmanager
def searching(source: ConfigSource) -> Iterator[None]:
    """While the block runs, `load_config` and `group_options` called without a source compose from
    `source`'s folders, as they do from the app's own inside the running app: a command's check then
    finds a backend named by another setting (the runner's `backend.engine`, backend=auto's
    candidates) in the user's `--config-dir`, where its run will find it."""
    _SEARCHED.append(source)
    try:
        yield
    finally:
        _SEARCHED.pop()


@contextlib.contextmanager
def _hydra(source: ConfigSource = ORCHESTRATE) -> Iterator[None]:
    """Hydra's config loader: the running app's (its search path), or, outside an app, the search
    path `hydra.main` would build from `source` (the same two steps as Hydra's own `_run_hydra`:
    the primary config folder, then `--config-dir` ahead of it)."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    from orchestrate.thirdparty import hydra_internals

    internals = hydra_internals()
    Hydra, create_automatic_config_search_path = internals.Hydra, internals.create_automatic_config_search_path
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


def load_config(overrides: list[str] = (), source: ConfigSource | None = None,
                run_mode: RunMode = RunMode.RUN, with_hydra: bool = False) -> DictConfig:
    """Compose the primary config (`conf/config.yaml` unless `source` names the user's own) with
    command-line style overrides, `hydra.*` ones included (`hydra.searchpath=[file://DIR]`). Inside
    a running app, its own primary config and search path; without `source`, `searching`'s."""
    source = source or _SEARCHED[-1]
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
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from orchestrate.thirdparty import hydra_apply_overrides, hydra_caching_repo

        if self.repo is None:
            with _hydra(self.source):
                config_name = self.source.config_name
                if HydraConfig.initialized():
                    config_name = HydraConfig.get().job.config_name or config_name
                # The search path as Hydra builds it for a composition, once: a primary config of
                # the user's own may add orchestrate's groups with its `hydra.searchpath`.
                self.repo = hydra_caching_repo(config_name)
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        # Hydra's own split (hydra/_internal/defaults_list.py, Overrides): a group's choice, or a
        # value for the config.
        plain = [o for o in parsed if isinstance(o.value(), dict) or not self.repo.group_exists(o.key_or_group)]
        groups = tuple(o.input_line for o in parsed if o not in plain)
        if groups not in self.composed:
            self.composed[groups] = load_config(list(groups), self.source)
        cfg = copy.deepcopy(self.composed[groups])
        hydra_apply_overrides(plain, cfg)
        return cfg


def group_options(group: str, source: ConfigSource | None = None) -> list[str]:
    """The options of a config group on the search path, e.g. the backends (without `source`,
    `searching`'s)."""
    with _hydra(source or _SEARCHED[-1]):
        return GlobalHydra.instance().config_loader().get_group_options(group)
