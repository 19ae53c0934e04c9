"""The comparison (orchestrate.sweeps.compare): its intervals and verdicts on recorded numbers,
and end to end, `+sweep=compare` as a user runs it, read back from MLflow."""

import json
import math

import pytest

from orchestrate.sweeps import compare
from orchestrate.sweeps.compare import Interval, Repeat
from tests.conftest import sweep_runs
from tests.sweeps.test_sweeps import QUICK, sweep

# Recorded: samples/s of 3,000-step runs on this machine (issue 53's measurements and reruns).
# torch's two back-to-back runs were 75,637 and 51,390; a third 68,549.
TORCH = [75_637, 51_390, 68_549]
OVERLAPPING = [57_247, 68_549, 61_100]  # a hand-written loop of the same model beside them
CLEAR = [21_400, 22_900, 20_800]  # a backend a third as fast


def test_the_interval_is_students_t_over_the_repeats():
    i = Interval.of([1.0, 2.0, 3.0], 0.95)
    # mean 2, sd 1, t(0.975, 2) = 4.303: 2 -/+ 4.303 / sqrt(3)
    assert i.mean == 2.0 and i.n == 3
    assert i.low == pytest.approx(2 - 4.3027 / math.sqrt(3), abs=1e-3)
    assert i.high == pytest.approx(2 + 4.3027 / math.sqrt(3), abs=1e-3)
    assert Interval.of([5.0], 0.95).shown(".1f") == "5.0"  # one run: a value, no interval
    assert Interval.of([None, math.nan], 0.95) is None


def test_the_verdict_names_a_winner_only_where_the_intervals_separate():
    rates = {"backend=torch": Interval.of(TORCH, 0.95), "backend=ondevice": Interval.of(CLEAR, 0.95)}
    line = compare.verdict(rates, higher_better=True, what="samples/s", repeats=3)
    assert line.startswith("backend=torch wins (highest samples/s")


def test_the_verdict_says_no_difference_where_the_intervals_overlap():
    rates = {"backend=torch": Interval.of(TORCH, 0.95), "backend=compile": Interval.of(OVERLAPPING, 0.95),
             "backend=ondevice": Interval.of(CLEAR, 0.95)}
    line = compare.verdict(rates, higher_better=True, what="samples/s", repeats=3)
    assert line == ("no difference measurable at 3 repeats between backend=torch, backend=compile (their intervals "
                    "overlap); behind: backend=ondevice")
    # Lower is better (seconds to target): the same numbers, the other way round.
    line = compare.verdict(rates, higher_better=False, what="time to target", repeats=3)
    assert line.startswith("backend=ondevice wins (lowest time to target")


def repeat(group, r, rate, evals, losses, start=1_000):
    return Repeat(group=group, status="FINISHED", run_id=f"{group}-{r}", start_ms=start, repeat=r,
                  metrics={"samples_per_sec": rate, "eval_loss": evals[-1][1]},
                  evals=evals, losses=losses)


def test_target_time_and_loss_gap_against_the_baseline():
    runs = []
    for r in range(2):
        runs.append(repeat("backend=torch", r, 100.0 + r, [(2_000, 0.5), (3_000, 0.30 + r / 100)],
                           [(10, 1.0), (20, 0.5)]))
        runs.append(repeat("backend=compile", r, 50.0 + r, [(5_000, 0.4), (9_000, 0.2)],
                           [(10, 1.0), (20, 0.5 + 1e-3)]))
    result = compare.compare(runs, "torch", None, 0.95)
    assert result.baseline == "backend=torch" and result.target == pytest.approx(0.31)  # the worst of its bests
    torch_, compiled = result.groups
    assert torch_.figures["time_to_target"].mean == pytest.approx(2.0)  # both at 3,000 ms after 1,000
    assert compiled.figures["time_to_target"].mean == pytest.approx(8.0) and compiled.reached == 2
    assert compiled.deviation == pytest.approx(1e-3) and torch_.deviation is None
    assert "verdict, samples/s: backend=torch wins" in result.table()


def test_only_the_keys_that_differ_are_listed():
    differs = compare.differing({"backend=torch": {"backend._target_": "T", "trainer.seed": "0"},
                                 "backend=compile": {"backend._target_": "C", "trainer.seed": "0",
                                                     "backend.mode": "default", "compare.repeat": "1"}})
    assert differs == {"backend._target_": {"backend=torch": "T", "backend=compile": "C"},
                       "backend.mode": {"backend=torch": "-", "backend=compile": "default"}}


def test_a_trials_configuration_is_its_overrides_without_the_repeat():
    assert compare.group_of("compare.repeat=2,backend=torch") == "backend=torch"
    assert compare.group_of("backend=torch,compare.repeat=12,optimizer.lr=0.1") == "backend=torch,optimizer.lr=0.1"


@pytest.mark.slow
def test_a_comparison_leaves_its_table_chart_and_verdict_on_the_parent_run(tmp_path):
    """Two backends twice each, as a user runs it: the children interleaved, the parent's
    comparison table (text and MLflow table), chart, verdict tags and the keys that differ."""
    done = sweep("+sweep=compare", "compare.repeats=2", "backend=torch,compile", *QUICK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, (parent,), children = sweep_runs(tmp_path)
    order = sorted(children, key=lambda c: int(c.data.tags["orchestrate.trial_index"]))
    assert [c.info.run_name for c in order] == ["compare.repeat=0,backend=torch", "compare.repeat=0,backend=compile",
                                                "compare.repeat=1,backend=torch", "compare.repeat=1,backend=compile"]
    for child in children:  # every repeat logs the figures the comparison reads
        assert {"final/samples_per_sec", "final/warmup_s", "final/peak_rss_mb", "final/eval_loss"} <= set(child.data.metrics)
        assert child.data.metrics["final/peak_rss_mb"] > 50
    tags = parent.data.tags
    assert tags["compare.verdict.samples_per_sec"].startswith(("no difference measurable at 2 repeats", "backend="))
    assert "backend._target_" in tags["compare.differs"] and "trainer.seed" not in tags["compare.differs"]
    paths = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"comparison.json", "comparison.png", "summary.md"} <= paths
    table = json.loads(open(client.download_artifacts(parent.info.run_id, "comparison.json", str(tmp_path))).read())
    assert table["columns"][:2] == ["configuration", "runs"]
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}
    assert set(rows) == {"backend=torch", "backend=compile"} and rows["backend=torch"]["runs"] == 2
    assert rows["backend=torch"]["samples_per_sec_low"] <= rows["backend=torch"]["samples_per_sec_mean"]
    assert rows["backend=compile"]["max_train_loss_gap"] < 1e-4  # the same batches, the same model
    assert "verdict, samples/s:" in done.stdout and "what differs between the configurations" in done.stdout
