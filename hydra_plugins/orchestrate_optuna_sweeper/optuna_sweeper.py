"""An asynchronous Optuna sweeper with pruning, for Hydra apps whose jobs report their evaluations
(orchestrate's training loops do: orchestrate.sweeps.pruning).

Hydra's Optuna sweeper asks for `n_jobs` trials, launches them as one batch, waits for the whole
batch and creates its study without a pruner: a slot whose trial ended early idles until the
slowest of its batch ends, and a trial that is clearly losing runs to its last step. This one keeps
every slot busy (a new trial starts as soon as one ends or is pruned: one job per `launch` call, as
many calls at once as there are slots) and gives the study a pruner that running trials consult at
every evaluation, so that a losing trial stops there. The search space is written as for Hydra's
Optuna sweeper (`hydra.sweeper.params`: `choice(...)`, `range(...)`, `interval(...)`,
`tag(log, interval(...))`), and the study lives in a database beside the MLflow store, so that
running the same sweep again continues it.

Shaped like Hydra's own plugins: this thin public class, the `*Conf` dataclasses (the sweeper as
hydra/sweeper=orchestrate_optuna; its samplers and pruners as the config groups
hydra/sweeper/sampler and hydra/sweeper/pruner), and the work in `orchestrate.sweeps._optuna`,
imported only when a sweep starts.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class TPESamplerConf:
    """Optuna's default sampler (tree-structured Parzen estimator)."""

    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None  # the same seed proposes the same trials in the same order
    n_startup_trials: int = 10  # random trials before TPE models the results
    multivariate: bool = False  # model the parameters jointly (better for correlated ones)
    # Several trials run at once: TPE pretends the running ones got a bad value, so that it does
    # not propose the same point to every free slot.
    constant_liar: bool = True


@dataclass
class RandomSamplerConf:
    """Independent uniform draws from the search space."""

    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None  # the same seed draws the same trials


@dataclass
class GridSamplerConf:
    """Every combination of the `choice(...)` and `range(...)` parameters, in a seeded order; the
    search space is filled in from hydra.sweeper.params (an interval cannot be a grid)."""

    _target_: str = "optuna.samplers.GridSampler"
    seed: Optional[int] = None  # the order the points are taken in (the same seed: the same order)


@dataclass
class MedianPrunerConf:
    """Stop a trial whose value at a step is worse than the median of the other trials' at that step."""

    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 4  # trials that always run to the end before any is pruned
    n_warmup_steps: int = 0  # training steps before a trial can be pruned
    interval_steps: int = 1  # steps between prunable reports (evaluations happen every trainer.evaluation_period)
    n_min_trials: int = 1  # trials that must have reported at a step before it can prune there


@dataclass
class SuccessiveHalvingPrunerConf:
    """Asynchronous successive halving (ASHA, Li et al. 2020): at each rung (min_resource x
    reduction_factor^k steps) a trial goes on only if it is in the top 1/reduction_factor of the
    trials that reached that rung; no trial waits for another."""

    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    # Steps before the first rung; auto: two evaluation periods of the app (trainer.evaluation_period,
    # orchestrate.sweeps.pruning.pruner_settings), not Optuna's estimate from the first finished trial.
    min_resource: Any = "auto"
    reduction_factor: int = 4  # keep the top 1/reduction_factor at each rung
    min_early_stopping_rate: int = 0  # skip this many rungs at the start
    # Optuna prunes a trial that is among the first bootstrap_count to reach a rung (0: none is).
    bootstrap_count: int = 0


@dataclass
class HyperbandPrunerConf:
    """Several successive-halving brackets with different first rungs, trials spread across them."""

    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: Any = "auto"  # steps before the first rung of the most aggressive bracket; auto: two evaluation periods
    max_resource: Any = "auto"  # a trial's full length; auto: trainer.max_steps
    reduction_factor: int = 3  # keep the top 1/reduction_factor at each rung; also sets the number of brackets
    # Optuna prunes a trial that is among the first bootstrap_count to reach a rung (0: none is).
    bootstrap_count: int = 0


@dataclass
class DominatedPrunerConf:
    """A sweep over several objectives (a list of directions): stop a trial at an evaluation where
    `beaten_by` completed trials were better on every objective at the same step (Optuna's own
    pruners rank one objective; orchestrate.sweeps.dominated)."""

    _target_: str = "orchestrate.sweeps.dominated.DominatedPruner"
    beaten_by: int = 2  # completed trials that must beat a trial on every objective to stop it
    min_resource: Any = "auto"  # steps before any trial can be stopped; auto: two evaluation periods


@dataclass
class NopPrunerConf:
    """No pruning: every trial runs to the end (the sweep is still asynchronous)."""

    _target_: str = "optuna.pruners.NopPruner"


@dataclass
class OrchestrateOptunaSweeperConf:
    # The sampler and the pruner are config groups: hydra/sweeper/sampler=random,
    # hydra/sweeper/pruner=hyperband.
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "successive_halving"}])
    # The class Hydra instantiates with these settings.
    _target_: str = "hydra_plugins.orchestrate_optuna_sweeper.optuna_sweeper.OrchestrateOptunaSweeper"
    # The sampler and pruner reach the sweeper as configs (built in the sweep; the pruner is built
    # again wherever a trial runs), not as objects.
    _recursive_: bool = False
    # Whether sweep.metric (what each trial returns and reports at every evaluation) is better low
    # or high: minimize or maximize; a list, one per metric, for several objectives (sweep.metric a
    # list of as many; the summary gives the Pareto front). By default the app's sweep.direction.
    direction: Any = "${sweep.direction}"
    # The Optuna study; null: named after the sweep (the same command and sweep settings, not
    # counting n_trials and n_jobs: the same study), so that running a sweep again continues it.
    study_name: Optional[str] = None
    # Where the study lives (an SQLAlchemy URL every trial can reach); null: beside the MLflow store
    # (sqlite:///DIR/NAME.db -> sqlite:///DIR/NAME-optuna.db; a PostgreSQL store -> a database
    # named DB_optuna on the same server; any other store: sqlite:///optuna.db in the working folder).
    storage: Optional[str] = None
    # Trials of the study in all, counting those that finished or were pruned in earlier attempts.
    n_trials: int = 20
    # Trials running at once; null: as many as the launcher can run (orchestrate_ray: as many as
    # the cluster fits; basic: one, in this process; other launchers: one).
    n_jobs: Optional[int] = None
    # Failed trials tolerated, as a fraction of n_trials; past it the sweep stops with the first error.
    max_failure_rate: float = 0.0
    sampler: Any = MISSING  # hydra/sweeper/sampler: tpe (default), random, grid
    # hydra/sweeper/pruner: successive_halving (default), median, hyperband, none; with several
    # objectives: dominated or none.
    pruner: Any = MISSING
    # The search space: key -> choice(...), range(...), interval(...), tag(log, interval(...)), or a
    # fixed value, as Hydra's Optuna sweeper reads it. Sweeps on the command line are added to it.
    params: Optional[dict[str, str]] = None


_store = ConfigStore.instance()
_store.store(group="hydra/sweeper", name="orchestrate_optuna", node=OrchestrateOptunaSweeperConf, provider="orchestrate")
for _name, _node in [("tpe", TPESamplerConf), ("random", RandomSamplerConf), ("grid", GridSamplerConf)]:
    _store.store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="orchestrate")
for _name, _node in [("median", MedianPrunerConf), ("successive_halving", SuccessiveHalvingPrunerConf),
                     ("hyperband", HyperbandPrunerConf), ("dominated", DominatedPrunerConf),
                     ("none", NopPrunerConf)]:
    _store.store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="orchestrate")


class OrchestrateOptunaSweeper(Sweeper):
    """Runs an Optuna study's trials as Hydra jobs, each as soon as a slot frees; see
    `orchestrate.sweeps._optuna`."""

    def __init__(self, **conf: Any) -> None:
        self.conf = conf  # the settings above, as Hydra composed them (sampler and pruner as configs)
        self.config: Optional[DictConfig] = None
        self.launcher: Any = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        from orchestrate.sweeps import _optuna

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        launcher = type(self.launcher)
        _optuna.check_settings(self.conf["direction"], self.conf.get("n_jobs"), f"{launcher.__module__}.{launcher.__name__}",
                               metric=OmegaConf.select(config, "sweep.metric"),
                               pruner=OmegaConf.select(self.conf["pruner"], "_target_") if self.conf.get("pruner") else None)

    def sweep(self, arguments: list[str]) -> None:
        from orchestrate.sweeps import _optuna

        _optuna.sweep(self, arguments)
