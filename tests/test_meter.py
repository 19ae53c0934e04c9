"""The meter: train loss averaged over each display window, evaluation at its period (and after
the last step), nothing logged twice when a run is resumed."""

import pytest
import torch

from orchestrate.meter import Meter
from orchestrate.schema import TrainerConf


def make_meter(tmp_path, **trainer) -> Meter:
    t = TrainerConf(progress=False, **trainer)
    return Meter(t, "test", lr=0.1, samples_per_step=t.batch_size, out_dir=tmp_path)


def test_window_means_and_eval_steps(tmp_path):
    meter = make_meter(tmp_path, max_steps=10, display_loss_steps=4, evaluation_period=5)
    displayed = []
    meter.on_display = lambda step, metrics: displayed.append(step)
    for step in meter.steps():
        meter.record(step, float(step))
        meter.evaluate(step, lambda: (1.0 / step, None))  # noqa: B023
    assert meter.history["train/loss"] == [(4, 2.5), (8, 6.5), (10, 9.5)]
    assert [s for s, _ in meter.history["eval/loss"]] == [5, 10]
    assert displayed == [4, 8, 10]
    final = meter.summary()
    assert final["train_loss"] == 9.5 and final["eval_loss"] == pytest.approx(0.1)
    assert final["samples_per_sec"] > 0 and "eval_accuracy" not in final


def test_a_resumed_run_logs_no_step_twice(tmp_path):
    meter = make_meter(tmp_path, max_steps=6, display_loss_steps=1)
    meter.continue_history({"train/loss": [(1, 9.0), (2, 8.0), (3, 7.0)]})
    for step in meter.steps(start=3):
        meter.record(step, 1.0)
    assert [s for s, _ in meter.history["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert meter.history["train/loss"][2] == (3, 7.0)  # the value already in MLflow stays


def test_other_workers_do_not_evaluate(tmp_path):
    t = TrainerConf(progress=False, max_steps=2, evaluation_period=1)
    meter = Meter(t, "rank1", lr=0.1, samples_per_step=1, out_dir=tmp_path, logging=False)
    for step in meter.steps():
        meter.evaluate(step, lambda: pytest.fail("rank 1 evaluated"))
    assert "eval/loss" not in meter.history


def test_a_non_finite_loss_or_gradient_norm_stops_the_run_naming_what_and_where(tmp_path):
    from orchestrate.meter import Diverged

    meter = make_meter(tmp_path, max_steps=10)
    assert meter.finite(1, 0.5) and meter.finite(2, 0.5, grad_norm=3.0)
    with pytest.raises(Diverged, match="^loss became inf at step 3$"):
        meter.finite(3, float("inf"))
    with pytest.raises(Diverged, match="^gradient norm became nan at step 4$"):
        meter.finite(4, 0.5, grad_norm=float("nan"))
    # The runner: this rank's numbers are fine, another worker's are not; every rank stops alike.
    meter.update_allowed = lambda finite, grads: False
    with pytest.raises(Diverged, match="^loss became nan or inf on another worker at step 5$"):
        meter.finite(5, 0.5)


def test_skipped_steps_are_counted_and_left_out_of_the_mean_loss(tmp_path):
    meter = make_meter(tmp_path, max_steps=4, display_loss_steps=4, on_nonfinite="skip")
    for step in meter.steps():
        loss = float("nan") if step in (2, 3) else float(step)
        assert meter.record(step, loss) is (step in (2, 3))  # True: the update is dropped
    assert meter.history["train/skipped_steps"] == [(2, 1), (3, 2)]
    assert meter.history["train/loss"] == [(4, 2.5)]  # steps 1 and 4
    assert meter.summary()["skipped_steps"] == 2


# ---- decided on the device: nothing read between reading steps, the same outcome ------------------
def device_run(tmp_path, losses: dict[int, float], **trainer):
    """Record `losses` (step -> value, 1.0 elsewhere) as tensors with on_device=True; returns the
    meter and each step's answer (a tensor's value, or the host's bool at reading steps)."""
    meter = make_meter(tmp_path, evaluation_period=0, checkpoint_period=0, **trainer)
    answers = {}
    for step in meter.steps():
        held = meter.record(step, torch.tensor(losses.get(step, 1.0)), on_device=True)
        answers[step] = float(held) if isinstance(held, torch.Tensor) else held
    return meter, answers


def test_on_the_device_a_nan_holds_every_update_after_it_and_stops_at_the_next_reading_step(tmp_path):
    from orchestrate.meter import Diverged

    meter = make_meter(tmp_path, max_steps=12, display_loss_steps=5, evaluation_period=0, checkpoint_period=0)
    answers = {}
    with pytest.raises(Diverged, match="^loss became nan at step 3$"):  # named, though read at step 5
        for step in meter.steps():
            held = meter.record(step, torch.tensor(float("nan") if step == 3 else 1.0), on_device=True)
            answers[step] = held
    assert meter.step == 5  # the reading step
    assert [float(answers[s]) for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]  # step 4 is finite, held all the same
    assert "train/loss" not in meter.history


def test_on_the_device_skipped_steps_are_counted_at_their_own_steps(tmp_path):
    meter, answers = device_run(tmp_path, {2: float("nan"), 3: float("inf"), 7: float("nan")}, max_steps=8,
                                display_loss_steps=4, on_nonfinite="skip")
    assert answers == {1: 0.0, 2: 1.0, 3: 1.0, 4: False, 5: 0.0, 6: 0.0, 7: 1.0, 8: False}
    assert meter.history["train/skipped_steps"] == [(2, 1), (3, 2), (7, 3)]
    assert meter.history["train/loss"] == [(4, 1.0), (8, 1.0)]  # the finite steps' mean
    summary = meter.summary()
    assert summary["skipped_steps"] == 3 and summary["train_loss"] == 1.0


def test_on_the_device_the_window_means_are_the_hosts(tmp_path):
    values = {s: float(s) for s in range(1, 11)}
    meter, answers = device_run(tmp_path, values, max_steps=10, display_loss_steps=4)
    assert meter.history["train/loss"] == [(4, 2.5), (8, 6.5), (10, 9.5)]
    assert [s for s, v in answers.items() if isinstance(v, bool)] == [4, 8, 10]  # read only there


class StopAt:
    """A pruning sweep's trial (orchestrate.sweeps.pruning.Trial) whose pruner says stop at `step`."""

    def __init__(self, step: int):
        self.step, self.told, self.asked = step, [], []

    def report(self, step, metrics, ask=True):
        self.told.append((step, metrics["eval_loss"]))
        if ask:
            self.asked.append(step)
        return ask and step >= self.step


def test_a_pruned_trial_stops_after_the_evaluation_where_its_pruner_says(tmp_path):
    meter = make_meter(tmp_path, max_steps=40, display_loss_steps=5, evaluation_period=10)
    meter.trial = StopAt(20)
    ran = []
    for step in meter.steps():
        ran.append(step)
        meter.record(step, 1.0)
        meter.evaluate(step, lambda: (1.0 / step, None))  # noqa: B023
        if meter.stop_early(step):
            break
    assert ran[-1] == 20 and meter.pruned_at == 20 and meter.summary()["pruned_at"] == 20
    assert [s for s, _ in meter.trial.told] == [10, 20]
    assert "wall_time_s" in meter.final  # the loop ended early: still timed


def test_the_last_step_is_reported_but_never_pruned(tmp_path):
    meter = make_meter(tmp_path, max_steps=20, evaluation_period=10)
    meter.trial = StopAt(20)
    for step in meter.steps():
        meter.evaluate(step, lambda: (0.5, None))
        assert not meter.stop_early(step)
    assert meter.trial.told == [(10, 0.5), (20, 0.5)] and meter.trial.asked == [10]
    assert meter.pruned_at is None


def test_other_ranks_stop_where_the_logging_rank_says(tmp_path):
    """Rank 1 neither evaluates nor asks: it takes rank 0's answer (`agree`: true on every rank)."""
    t = TrainerConf(progress=False, max_steps=30, evaluation_period=10)
    rank0_says = {10: False, 20: True}
    meter = Meter(t, "rank1", lr=0.1, samples_per_step=1, out_dir=tmp_path, logging=False,
                  agree=lambda flag: flag and rank0_says[step])
    meter.trial = StopAt(0)
    for step in meter.steps():
        meter.evaluate(step, lambda: pytest.fail("rank 1 evaluated"))
        if meter.stop_early(step):
            break
    assert step == 20 and meter.trial.told == []
