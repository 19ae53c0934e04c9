"""Sweeps end to end: `python -m orchestrate ... +sweep` as a subprocess, on a real local Ray
instance, tracked by the real MLflow server the sweep starts in front of its SQLite store. Results
are read back with MlflowClient."""

import os
import re
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, metric_steps

pytestmark = pytest.mark.slow
QUICK = ["data=synthetic", "trainer=quick", "trainer.max_steps=20", "model.hidden=[32]"]


def sweep(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "orchestrate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def runs_of(cwd, experiment: str = "orchestrate"):
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("orchestrate.role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def test_bare_sweep_command_runs_the_default_grid_with_nested_runs(tmp_path):
    done = sweep("backend=ortmodule", "+sweep", *QUICK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, (parent,), children = runs_of(tmp_path)
    assert parent.info.status == "FINISHED"
    assert sorted(c.info.run_name for c in children) == ["optimizer.lr=0.001", "optimizer.lr=0.003", "optimizer.lr=0.01"]
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["backend"] == "ortmodule"
        assert child.data.params["optimizer.lr"] == child.info.run_name.split("=")[1]
        assert child.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"summary.md", "sweep.json", "trials_loss_curves.png"} <= artifacts
    table = client.download_artifacts(parent.info.run_id, "summary.md")
    assert open(table).read().count("| FINISHED |") == 3
    assert "| optimizer.lr=0.01 | FINISHED |" in done.stdout  # the same table, printed


def test_backend_shootout_grid_over_three_backends(tmp_path):
    done = sweep("+experiment=backend_shootout", "+sweep", *QUICK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, (parent,), children = runs_of(tmp_path, "backend_shootout")
    assert sorted(c.data.tags["backend"] for c in children) == ["ondevice", "ortmodule", "torch"]
    # Same model, data and seed: the backends agree on the final loss.
    finals = [c.data.metrics["final/train_loss"] for c in children]
    assert max(finals) - min(finals) < 1e-3 * max(finals)


def test_optuna_sweep(tmp_path):
    done = sweep("+experiment=lr_search", "+sweep", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2", *QUICK,
                 cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, (parent,), children = runs_of(tmp_path, "lr_search")
    assert len(children) == 4
    lrs = {c.data.params["optimizer.lr"] for c in children}
    assert len(lrs) == 4 and all(1e-4 <= float(v) <= 3e-2 for v in lrs)
    assert {c.data.params["trainer.batch_size"] for c in children} <= {"32", "64", "128"}
    assert "best: trial" in done.stdout


FAILING = ["-m", "backend=torch", "model._target_=tests.helpers.FailingMLP", "+model.fail_at_call=5,1000000000"]


@pytest.fixture(scope="module")
def failed_sweep(tmp_path_factory):
    """A two-trial sweep whose first trial fails while a marker file exists."""
    cwd = tmp_path_factory.mktemp("failing")
    marker = cwd / "fail.marker"
    marker.touch()
    args = [*FAILING, f"+model.marker={marker}", *QUICK]
    return cwd, marker, args, sweep(*args, cwd=cwd)


def test_a_failing_trial_does_not_stop_the_others(failed_sweep):
    cwd, _, _, done = failed_sweep
    assert done.returncode != 0
    client, (parent,), children = runs_of(cwd)
    status = {c.info.run_name: c.info.status for c in children}
    assert status == {"+model.fail_at_call=5": "FAILED", "+model.fail_at_call=1000000000": "FINISHED"}
    failed = next(c for c in children if c.info.status == "FAILED")
    assert "deliberate failure at call 5" in failed.data.tags["error"]
    assert parent.info.status == "FAILED"
    assert re.search(r"\| \+model.fail_at_call=5 \| FAILED \|.*deliberate failure at call 5", done.stdout)


def test_rerunning_the_same_sweep_skips_finished_trials(failed_sweep):
    cwd, marker, args, first = failed_sweep
    _, (parent_before,), children_before = runs_of(cwd)
    finished_before = {c.info.run_id for c in children_before if c.info.status == "FINISHED"}
    marker.unlink()  # the cause of the failure is fixed; the command stays the same
    done = sweep(*args, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    client, (parent,), children = runs_of(cwd)
    assert parent.info.run_id == parent_before.info.run_id and parent.info.status == "FINISHED"
    assert len(children) == 3  # the failed attempt, the finished trial (not re-run), the retried trial
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert finished_before <= {c.info.run_id for c in finished}
    assert sorted(c.info.run_name for c in finished) == ["+model.fail_at_call=1000000000", "+model.fail_at_call=5"]
    assert "| +model.fail_at_call=1000000000 | SKIPPED |" in done.stdout


def test_fail_fast_stops_the_sweep_at_the_first_failure(tmp_path):
    # One trial at a time (2 CPUs each), the failing one first: the rest are cancelled.
    done = sweep("-m", "backend=torch", "model._target_=tests.helpers.FailingMLP",
                 "+model.fail_at_call=5,1000000000,1000000001", "hydra.launcher.fail_fast=true",
                 "hydra.launcher.cpus_per_trial=2", "hydra.launcher.num_cpus=2", *QUICK, cwd=tmp_path)
    assert done.returncode != 0
    assert "CANCELLED" in done.stdout
    _, _, children = runs_of(tmp_path)
    assert sum(c.info.status == "FINISHED" for c in children) < 2


def test_eight_concurrent_trials_lose_no_metric(tmp_path):
    lrs = ",".join(f"{0.001 * (i + 1):.3f}" for i in range(8))
    done = sweep("-m", "backend=torch", f"optimizer.lr={lrs}", "hydra.launcher.cpus_per_trial=0.25",
                 "hydra.launcher.num_cpus=2", "trainer.display_loss_steps=1", "trainer.evaluation_period=10",
                 *QUICK[:2], "trainer.max_steps=60", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, _, children = runs_of(tmp_path)
    assert len(children) == 8
    assert len({c.data.tags["pid"] for c in children}) == 8  # eight worker processes, all at once
    for child in children:
        assert [s for s, _ in metric_steps(client, child.info.run_id, "train/loss")] == list(range(1, 61))
        assert [s for s, _ in metric_steps(client, child.info.run_id, "perf/samples_per_sec")] == list(range(1, 61))
        assert [s for s, _ in metric_steps(client, child.info.run_id, "eval/loss")] == [10, 20, 30, 40, 50, 60]


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    done = sweep("+experiment=backend_shootout", "+sweep", "+dry_run", *QUICK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan: 3 trial(s)" in done.stdout
    for backend in ("torch", "ortmodule", "ondevice"):
        assert f"backend={backend}" in done.stdout
    assert not (tmp_path / "mlflow.db").exists()


def test_a_bad_trial_stops_the_sweep_before_anything_runs(tmp_path):
    done = sweep("-m", "trainer.max_steps=0,10", *QUICK[:2], cwd=tmp_path)
    assert done.returncode == 2
    assert "error: trial 0 (trainer.max_steps=0" in done.stderr and "must be at least 1" in done.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_a_local_sweep_keeps_ray_on_loopback(tmp_path):
    done = sweep("-m", "optimizer.lr=0.001", *QUICK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ready = next(line for line in (done.stdout + done.stderr).splitlines() if "Ray ready" in line)
    assert "'node:127.0.0.1'" in ready
