"""The pruner of a sweep over several objectives (hydra/sweeper/pruner=dominated). Optuna's own
pruners rank one intermediate value per step, and Optuna refuses `report` and `should_prune` on a
study with several directions (optuna/optuna#3450). Here each trial records, at every evaluation,
the values its objectives have so far (the last eval loss, the seconds so far, the steady
samples/s, the memory peak: orchestrate.meter.Meter.so_far) as the user attribute
`values_at_<step>`; at that step it is stopped when `beaten_by` trials that completed had, at the
same step, better values on every objective.

Built in the sweep's process (the study's pruner, which Optuna never calls for a study with several
directions) and in every trial's (orchestrate.sweeps.pruning.Trial, which calls `prune`).
"""

from typing import Any

import optuna

from orchestrate.sweeps import pareto

VALUES_AT = "values_at_"  # + the step: a trial's objectives' values at that evaluation


def values_at(trial, step: int) -> list[float] | None:
    return trial.user_attrs.get(f"{VALUES_AT}{step}")


def last_step(trial) -> int | None:
    steps = [int(k.removeprefix(VALUES_AT)) for k in trial.user_attrs if k.startswith(VALUES_AT)]
    return max(steps) if steps else None


class DominatedPruner(optuna.pruners.BasePruner):
    """Stop a trial at an evaluation where `beaten_by` completed trials were better on every
    objective at the same step; never before `min_resource` steps (`auto`: two evaluation periods,
    orchestrate.sweeps.pruning.pruner_settings)."""

    def __init__(self, beaten_by: int = 2, min_resource: Any = 0) -> None:
        if beaten_by < 1:
            raise ValueError(f"hydra.sweeper.pruner.beaten_by={beaten_by}: allowed: 1 or more")
        self.beaten_by = beaten_by
        self.min_resource = 0 if min_resource == "auto" else int(min_resource)

    def prune(self, study: "optuna.Study", trial: "optuna.trial.FrozenTrial") -> bool:
        step = last_step(trial)
        if step is None or step < self.min_resource:
            return False
        completed = [v for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                     if (v := values_at(t, step)) is not None]
        minimize = [d == optuna.study.StudyDirection.MINIMIZE for d in study.directions]
        return pareto.beaten_by(values_at(trial, step), completed, minimize) >= self.beaten_by
