"""Sweeps end to end: `python -m orchestrate ... -m` (or `+sweep`) as a subprocess, tracked by the
sweep callbacks (orchestrate.sweeps) through the MLflow server they start in front of the SQLite
store; on orchestrate's Ray launcher (the default), Hydra's basic launcher and submitit's local
launcher. Results are read back with MlflowClient. The same small sweep on each launcher is in the
default tier; failures, resume and concurrency are `slow`."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, long, metric_steps
from tests.conftest import sweep_runs as runs_of
from tests.helpers import prints_no_cuda_notice

QUICK = ["data=synthetic", "trainer=quick", "trainer.max_steps=20", "model.hidden=[32]"]
SMALL = ["-m", "backend=torch", "optimizer.lr=0.001,0.01", *QUICK]
LAUNCHERS = ["orchestrate_ray", "basic", "submitit_local"]
# The default tier runs the sweep on Hydra's basic launcher (one command, its trials in its own
# process); the launchers that start a process per trial, or Ray, are the full suite's; submitit's
# local launcher is the long tier's (CI runs submitit's Slurm launcher, a process per trial too).
SUBMITIT_IN_CI = "tests/launch/test_slurm.py::test_the_readme_sweep_runs_every_trial_as_a_slurm_job"
LAUNCHER_CASES = [pytest.param(name, marks={"basic": [], "orchestrate_ray": [pytest.mark.slow],
                                            "submitit_local": [pytest.mark.slow, long(SUBMITIT_IN_CI)]}[name])
                  for name in LAUNCHERS]
# Run as `python -c IN_PROCESS args...`: the sweep as `python -m orchestrate args...` runs it, then
# the names of the environment variables it left changed, on stderr. With Hydra's basic launcher
# every trial runs in this process. (Importing mlflow sets its telemetry session id: not a sweep's.)
IN_PROCESS = """
import json, os, sys
import mlflow
from orchestrate.__main__ import main
before = dict(os.environ)
main()
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print("environment changed: " + json.dumps(changed), file=sys.stderr)
"""


def sweep(*args: str, cwd, in_process: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    command = ["-c", IN_PROCESS] if in_process else ["-m", "orchestrate"]
    return subprocess.run([sys.executable, *command, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


# ---- the same small sweep on every launcher ----------------------------------------------------

@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    """SMALL on a launcher, each in its own folder, run once when a test first asks for it."""
    done = {}

    def on(launcher: str):
        if launcher not in done:
            cwd = tmp_path_factory.mktemp(launcher)
            done[launcher] = cwd, sweep(*SMALL, f"hydra/launcher={launcher}", cwd=cwd, in_process=launcher == "basic")
        return done[launcher]

    return on


def structure(cwd) -> dict:
    """What a sweep left in MLflow, less what differs from run to run (ids, times)."""
    client, (parent,), children = runs_of(cwd)
    return {
        "parent": (parent.info.run_name, parent.info.status,
                   sorted(a.path for a in client.list_artifacts(parent.info.run_id))),
        "children": {c.info.run_name: (c.info.status, c.data.tags["mlflow.parentRunId"] == parent.info.run_id,
                                       c.data.tags["orchestrate.trial_index"]) for c in children},
        "params": {c.info.run_name: c.data.params for c in children},
        "final train loss": {c.info.run_name: c.data.metrics["final/train_loss"] for c in children},
    }


@pytest.mark.parametrize("launcher", LAUNCHER_CASES)
def test_the_same_sweep_leaves_the_same_runs_on_every_launcher(launcher, small_sweep):
    cwd, done = small_sweep(launcher)
    assert done.returncode == 0, done.stderr[-3000:]
    got = structure(cwd)
    # No sweep file named: the parent is named after what the sweep varies (SMALL: optimizer.lr).
    assert got["parent"] == ("sweep-optimizer.lr", "FINISHED", ["summary.md", "sweep.json", "trials_loss_curves.png"])
    assert got["children"] == {"optimizer.lr=0.001": ("FINISHED", True, "0"),
                               "optimizer.lr=0.01": ("FINISHED", True, "1")}
    assert got["params"]["optimizer.lr=0.01"]["optimizer.lr"] == "0.01"
    reference = structure(small_sweep("basic")[0])
    # The same config; the CPU budget is the launcher's (orchestrate.cpu): a Ray trial's is its one
    # CPU (hydra.launcher.cpus_per_trial), a trial in the sweep's own process has the machine's cores.
    budget = {name: {k: params.pop(k) for k in list(params) if k.startswith("cpu.")}
              for name, params in got["params"].items()}
    for params in reference["params"].values():
        for key in [k for k in params if k.startswith("cpu.")]:
            del params[key]
    assert got["params"] == reference["params"]
    cores = "1" if launcher == "orchestrate_ray" else str(len(os.sched_getaffinity(0)))
    assert {b["cpu.cores"] for b in budget.values()} == {cores}, budget
    assert got["final train loss"] == pytest.approx(reference["final train loss"], rel=1e-5)  # same seed


@pytest.mark.parametrize("launcher", LAUNCHER_CASES)
def test_the_summary_is_the_last_thing_printed(launcher, small_sweep):
    folder, done = small_sweep(launcher)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    summary = out.index("\nsweep summary (MLflow parent run ")
    trial_lines = [m.start() for m in re.finditer(r"backend torch: 20 steps", out)]
    # submitit writes each trial's output to its own log file; the other launchers to this console.
    assert len(trial_lines) == (0 if launcher == "submitit_local" else 2)
    assert all(at < summary for at in trial_lines)
    assert "| optimizer.lr=0.01 | FINISHED |" in out[summary:]
    ui, page = out.rstrip().splitlines()[-2:]
    assert ui.startswith("open the UI with   ")
    assert ui.endswith(" ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000")
    assert shutil.which(shlex.split(ui[len("open the UI with   "):])[0])  # runnable as printed
    _, (parent,), _ = runs_of(folder)
    assert page == f"then open          http://127.0.0.1:5000/#/experiments/{parent.info.experiment_id}/runs"
    # Only the summary says where to look, and never at the sweep's own server (gone by then).
    assert out.count("open the UI with") == 1 and "View run" not in out


@pytest.mark.parametrize("launcher", LAUNCHER_CASES)
def test_what_a_trials_import_of_ort_prints_goes_to_its_log_not_the_console(launcher, small_sweep):
    """torch's "No CUDA runtime is found" (a CUDA toolkit and no GPU), printed while a trial's
    process imports ORT: not on the sweep's console, nor in what submitit keeps of a trial's
    console; in the trial's own log (Hydra's job log) where the trial imported ORT itself."""
    cwd, done = small_sweep(launcher)
    assert done.returncode == 0, done.stderr[-3000:]
    consoles = [done.stdout, done.stderr, *(p.read_text() for p in cwd.glob("multirun/*/*/.submitit/*/*_log.*"))]
    assert not [c for c in consoles if "No CUDA runtime" in c], consoles
    if prints_no_cuda_notice() and launcher != "basic":  # basic: the command's process imported ORT for the checks
        logs = [p.read_text() for p in cwd.glob("multirun/*/*/*/app.log")]
        # submitit: a process per trial; Ray: a worker per concurrent trial (one may run both).
        assert (all if launcher == "submitit_local" else any)("No CUDA runtime is found" in log for log in logs)


def test_an_in_process_sweep_leaves_the_environment_as_it_was(small_sweep):
    _, done = small_sweep("basic")
    assert done.returncode == 0, done.stderr[-3000:]
    changed = json.loads(re.search(r"environment changed: (.*)", done.stderr).group(1))
    assert changed == []  # MLFLOW_RUN_ID, MLFLOW_TRACKING_URI, ... were the trials' only


# ---- sweeps on orchestrate's Ray launcher (the default) -----------------------------------------

FAILING = ["-m", "backend=torch", "model._target_=tests.helpers.FailingMLP", "+model.fail_at_call=5,1000000000"]


@pytest.fixture(scope="module")
def failed_sweep(tmp_path_factory):
    """A two-trial sweep whose first trial fails while a marker file exists."""
    cwd = tmp_path_factory.mktemp("failing")
    marker = cwd / "fail.marker"
    marker.touch()
    args = [*FAILING, f"+model.marker={marker}", *QUICK]
    return cwd, marker, args, sweep(*args, cwd=cwd)


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert "finished in an earlier attempt: skipped" in done.stdout


@pytest.mark.slow
def test_resume_false_starts_a_new_parent(failed_sweep):
    cwd, marker, args, _ = failed_sweep
    marker.unlink(missing_ok=True)  # every trial finishes
    _, parents_before, children_before = runs_of(cwd)
    done = sweep(*args, "hydra.callbacks.sweep_tracking.resume=false", "hydra/launcher=basic", cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    _, parents, children = runs_of(cwd)
    (new,) = [p for p in parents if p.info.run_id not in {p.info.run_id for p in parents_before}]
    mine = [c for c in children if c.data.tags["mlflow.parentRunId"] == new.info.run_id]
    assert sorted(c.info.status for c in mine) == ["FINISHED", "FINISHED"] and "SKIPPED" not in done.stdout


@pytest.mark.slow
def test_fail_fast_stops_the_sweep_at_the_first_failure(tmp_path):
    # One trial at a time (2 CPUs each), the failing one first: the rest are cancelled.
    done = sweep("-m", "backend=torch", "model._target_=tests.helpers.FailingMLP",
                 "+model.fail_at_call=5,1000000000,1000000001", "hydra.launcher.fail_fast=true",
                 "hydra.launcher.cpus_per_trial=2", "hydra.launcher.num_cpus=2", *QUICK, cwd=tmp_path)
    assert done.returncode != 0
    assert "| CANCELLED |" in done.stdout
    _, (parent,), children = runs_of(tmp_path)
    assert sum(c.info.status == "FINISHED" for c in children) < 2
    assert parent.info.status == "FAILED"
    assert "RUNNING" not in {c.info.status for c in children}  # the sweep closed what it stopped


# Trials at once, each in its own Ray worker process: more than the machine's cores (CI has 2), so
# that their writes interleave. scripts/concurrency.py runs the same check with 16
# (docs/concurrency.md); tests/commands/test_server.py writes from 8 at once into PostgreSQL.
CONCURRENT = 4


@pytest.mark.slow
def test_concurrent_trials_lose_no_metric(tmp_path):
    """Trials at once write through the sweep's MLflow server into one SQLite store: every
    metric step of every trial arrives exactly once."""
    lrs = ",".join(f"{0.001 * (i + 1):.3f}" for i in range(CONCURRENT))
    done = sweep("-m", "backend=torch", f"optimizer.lr={lrs}", f"hydra.launcher.cpus_per_trial={2 / CONCURRENT}",
                 "hydra.launcher.num_cpus=2", "trainer.display_loss_steps=1", "trainer.evaluation_period=10",
                 *QUICK[:2], "trainer.max_steps=30", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, _, children = runs_of(tmp_path)
    assert len(children) == CONCURRENT
    assert len({c.data.tags["pid"] for c in children}) == CONCURRENT  # one worker process each, all at once
    for child in children:
        assert [s for s, _ in metric_steps(client, child.info.run_id, "train/loss")] == list(range(1, 31))
        assert [s for s, _ in metric_steps(client, child.info.run_id, "perf/samples_per_sec")] == list(range(1, 31))
        assert [s for s, _ in metric_steps(client, child.info.run_id, "eval/loss")] == [10, 20, 30]


@pytest.mark.slow
def test_a_local_sweep_keeps_ray_on_loopback(small_sweep):
    _, done = small_sweep("orchestrate_ray")
    assert done.returncode == 0, done.stderr[-3000:]
    ready = next(line for line in (done.stdout + done.stderr).splitlines() if "Ray ready" in line)
    assert "'node:127.0.0.1'" in ready
