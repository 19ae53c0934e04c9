"""Several objectives: the Pareto front, its hypervolume and the dominated pruner's rule
(orchestrate.sweeps.pareto, orchestrate.sweeps.dominated), and a two-objective sweep end to end."""

import json

import optuna
import pytest

from orchestrate.sweeps import pareto
from orchestrate.sweeps.dominated import VALUES_AT, DominatedPruner
from tests.conftest import sweep_runs
from tests.sweeps.test_sweeps import QUICK, sweep

BOTH_LOW = [True, True]


def test_the_front_is_the_points_no_other_dominates():
    points = {"a": [1.0, 5.0], "b": [2.0, 2.0], "c": [3.0, 3.0], "d": [5.0, 1.0], "e": [2.0, 2.0]}
    assert pareto.front(points, BOTH_LOW) == ["a", "b", "d", "e"]  # c: b beats it on both; b, e: equal
    assert pareto.front(points, [True, False]) == ["a"]  # the second better high: a is best on both
    assert pareto.front({"x": [1.0, float("nan")], "y": [2.0, 2.0]}, BOTH_LOW) == ["y"]


def test_the_hypervolume_of_a_front():
    # Two points against the reference (4, 4): 3x1 + 1x2 = 5 (the union of their boxes).
    assert pareto.hypervolume([[1.0, 3.0], [3.0, 1.0]], BOTH_LOW, [4.0, 4.0]) == pytest.approx(5.0)
    # A dominated point adds nothing; a point outside the reference neither.
    assert pareto.hypervolume([[1.0, 3.0], [3.0, 1.0], [3.5, 3.5], [5.0, 0.0]], BOTH_LOW, [4.0, 4.0]) == pytest.approx(5.0)
    # Maximized objectives turn over: (3, 3) up to the reference (0, 0) is 9.
    assert pareto.hypervolume([[3.0, 3.0]], [False, False], [0.0, 0.0]) == pytest.approx(9.0)
    # Three objectives: a unit cube's corner.
    assert pareto.hypervolume([[0.0, 0.0, 0.0]], [True] * 3, [1.0, 2.0, 3.0]) == pytest.approx(6.0)


def test_beaten_counts_only_trials_better_on_every_objective():
    assert pareto.beaten_by([2.0, 2.0], [[1.0, 1.0], [1.0, 3.0], [2.0, 1.0], [0.5, 1.9]], BOTH_LOW) == 2


def test_the_dominated_pruner_stops_a_trial_that_k_completed_trials_beat_at_its_step():
    study = optuna.create_study(directions=["minimize", "minimize"])
    for values in ([0.1, 1.0], [0.2, 2.0], [0.9, 0.5]):  # three completed trials, their values at step 10
        trial = study.ask()
        trial.set_user_attr(f"{VALUES_AT}10", values)
        study.tell(trial, values)
    running = study.ask()
    running.set_user_attr(f"{VALUES_AT}10", [0.5, 3.0])  # beaten on both by the first two
    frozen = study.trials[-1]
    assert DominatedPruner(beaten_by=2).prune(study, frozen)
    assert not DominatedPruner(beaten_by=3).prune(study, frozen)
    assert not DominatedPruner(beaten_by=2, min_resource=20).prune(study, frozen)  # too early to stop
    running.set_user_attr(f"{VALUES_AT}10", [0.15, 3.0])  # only one beats it on both
    assert not DominatedPruner(beaten_by=2).prune(study, study.trials[-1])


@pytest.mark.slow
def test_a_two_objective_sweep_leaves_its_front_on_the_parent_and_aliases_per_objective(tmp_path):
    """`+sweep=tradeoff` (eval loss and seconds) with the dominated pruner and a registered model:
    the summary's front, the parent's table and chart, the front's child runs tagged, and an
    alias per objective on the registered model."""
    done = sweep("+sweep=tradeoff", "hydra.sweeper.n_trials=5", "backend=choice(torch)", *QUICK,
                 "trainer.max_steps=60", "trainer.evaluation_period=10", "hydra/sweeper/pruner=dominated",
                 "hydra.sweeper.pruner.beaten_by=1", "tracking.register_model=tradeoff", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, (parent,), children = sweep_runs(tmp_path)
    assert "Pareto front:" in done.stdout
    finished = {c.info.run_id: [c.data.metrics["final/eval_loss"], c.data.metrics["final/wall_time_s"]]
                for c in children if "pruned" not in c.data.tags}
    on_front = {c.info.run_id for c in children if c.data.tags.get("orchestrate.pareto_front") == "true"}
    assert on_front and on_front == set(pareto.front(finished, BOTH_LOW))  # what MLflow holds agrees
    table = json.loads(open(client.download_artifacts(parent.info.run_id, "pareto_front.json", str(tmp_path))).read())
    assert table["columns"] == ["trial", "overrides", "eval_loss", "wall_time_s", "on_front"]
    assert sum(row[-1] for row in table["data"]) == len(on_front)
    assert "pareto_front.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert parent.data.tags["orchestrate.pareto_front"].count("#") == len(on_front)
    for metric, index in (("eval_loss", 0), ("wall_time_s", 1)):
        version = client.get_model_version_by_alias("tradeoff", f"best_{metric}")
        assert version.run_id in on_front
        assert finished[version.run_id][index] == min(finished[r][index] for r in on_front)
