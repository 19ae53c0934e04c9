"""The pruners' defaults (orchestrate.sweeps.pruning.pruner_settings), replayed on measured
curves: benchmarks/pruner_defaults.py ran every shipped sweep that can prune to the end and kept
every trial's eval curve in docs/pruner-curves.json, beside the pruning benchmark's 16-trial
search. Optuna's own pruner is told those curves as a sweep would tell it, two trials at a time,
in the order the trials ran and in 20 other orders."""

import importlib.util
import json

from orchestrate.sweeps.pruning import pruner_settings
from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("pruner_defaults", ROOT / "benchmarks" / "pruner_defaults.py")
pruner_defaults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pruner_defaults)


def replayed(name: str, sweep) -> list[tuple[float, int, int]]:
    pruner = pruner_defaults.pruner_config(name, {}, sweep.period, sweep.steps)
    return [pruner_defaults.replay(sweep, pruner, order) for order in pruner_defaults.orders(sweep)]


def test_the_default_pruner_keeps_every_shipped_sweeps_best_and_saves_on_the_benchmark():
    kept = json.loads(pruner_defaults.CURVES.read_text())
    sweeps = {s.name: s for s in pruner_defaults.sweeps_of(kept, [])}  # each evaluated as shipped
    assert set(pruner_defaults.SHIPPED) < set(sweeps)
    for sweep in sweeps.values():
        best = min(curve[sweep.steps] for curve in sweep.curves)
        results = replayed("successive_halving", sweep)  # the group's default pruner
        assert all(found <= 1.01 * best for found, _, _ in results), (sweep.name, results)
    benchmark = sweeps["benchmark (char LM, 16-trial grid)"]
    steps = [s for _, s, _ in replayed("successive_halving", benchmark)]
    assert sum(steps) / len(steps) <= 0.6 * benchmark.steps * len(benchmark.curves)  # at least 40% saved


def test_auto_first_rung_is_two_evaluations_within_the_run():
    trainer = {"evaluation_period": 100, "max_steps": 1000}
    settings = pruner_settings({"min_resource": "auto", "max_resource": "auto"}, _Trainer(**trainer))
    assert settings == {"min_resource": 200, "max_resource": 1000}
    assert pruner_settings({"min_resource": "auto"}, _Trainer(100, 150)) == {"min_resource": 150}


class _Trainer:
    def __init__(self, evaluation_period: int, max_steps: int):
        self.evaluation_period, self.max_steps = evaluation_period, max_steps
