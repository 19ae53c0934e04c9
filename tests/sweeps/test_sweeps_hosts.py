"""Sweeps on a Ray cluster whose hosts share nothing (the `hosts` fixture, tests/hosts.py): a
pruned Optuna sweep of the user's own `--config-dir` model, launched from the driver's host, runs
its trials on the two other hosts; every trial's run, metrics and artifacts, the parent run and
the study end up on the driver (the sweep serves its SQLite store and its study on the driver's
address toward the head: orchestrate.sweeps.remote), and each trial trains as it does on one
machine. What the trials could not report to is refused before anything starts."""

import os
import sqlite3
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import metric_steps

pytestmark = [pytest.mark.slow, pytest.mark.hosts]

SWEEP = ["--config-dir", "conf", "model=usernet", "backend=torch", "trainer.progress=false", "+sweep=lr_optuna",
         "hydra/sweeper/pruner=successive_halving", "hydra.sweeper.n_trials=4", "trainer.max_steps=120",
         "trainer.evaluation_period=20", "trainer.checkpoint_period=60"]


def orchestrate(hosts, project, *overrides, timeout=300):
    began = time.monotonic()
    done = hosts.head.run([sys.executable, "-m", "orchestrate", *overrides], timeout=timeout, cwd=project,
                          capture_output=True, text=True, env={**os.environ, **hosts.env})
    return done, time.monotonic() - began


def trials(project, experiment: str) -> dict[str, object]:
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], "tags.`orchestrate.role` = 'trial'")
    return {run.data.tags["orchestrate.trial"]: run for run in runs}


def test_a_pruned_optuna_sweep_on_other_hosts_reports_everything_to_the_driver(hosts, project):
    done, _ = orchestrate(hosts, project, *SWEEP, f"hydra.launcher.address={hosts.ray_address}",
                          "tracking.experiment=on_hosts")
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-5000:]
    assert "Traceback" not in printed and "GrpcStorageProxy is experimental" not in printed
    ran_on = {h.address for h in hosts.hosts[1:] if f"ip={h.address})" in printed}
    assert ran_on == {h.address for h in hosts.hosts[1:]}, "the trials ran on both other hosts"
    assert "pruned: " in printed  # successive halving stopped at least one trial, through the served study

    on_hosts = trials(project, "on_hosts")
    assert len(on_hosts) == 4
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    [parent] = client.search_runs([client.get_experiment_by_name("on_hosts").experiment_id],
                                  "tags.`orchestrate.role` = 'sweep'")
    assert parent.info.status == "FINISHED"
    for name, run in on_hosts.items():
        assert run.info.status == "FINISHED", (name, run.data.tags.get("error"))
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        steps = [s for s, _ in metric_steps(client, run.info.run_id, "eval/loss")]
        assert steps == sorted(set(steps)), f"every evaluation once: {steps}"
        # Artifacts written by the trial on its host, kept by the sweep's server on the driver's disk.
        kept = project / "mlartifacts" / run.info.experiment_id / run.info.run_id / "artifacts"
        assert (kept / "config.yaml").is_file(), name
        if "pruned" not in run.data.tags:
            assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["step_0000060.pt", "step_0000120.pt"]
    with sqlite3.connect(project / "mlflow-optuna.db") as db:  # the study, on the driver only
        states = dict(db.execute("select state, count(*) from trials group by state").fetchall())
    assert sum(states.values()) == 4 and "PRUNED" in states, states

    # The same sweep on one machine (Hydra's basic launcher, in one process): the same trials,
    # and each trial's evaluations equal at every step both ran.
    done, _ = orchestrate(hosts, project, *SWEEP, "hydra/launcher=basic", "tracking.experiment=one_machine")
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    here = trials(project, "one_machine")
    assert set(here) == set(on_hosts)
    for name, run in on_hosts.items():
        there = dict(metric_steps(client, run.info.run_id, "eval/loss"))
        alone = dict(metric_steps(client, here[name].info.run_id, "eval/loss"))
        common = sorted(set(there) & set(alone))
        assert common and all(abs(there[s] - alone[s]) < 1e-5 for s in common), (name, there, alone)


def test_a_sweep_whose_trials_could_not_report_back_is_refused_before_anything_starts(hosts, project):
    done, took = orchestrate(hosts, project, *SWEEP, f"hydra.launcher.address={hosts.ray_address}",
                             "tracking.uri=http://127.0.0.1:5000", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: tracking.uri=http://127.0.0.1:5000: hydra.launcher.address=") and took < 30
    assert not any((project / name).exists() for name in ("multirun", "mlflow.db", "mlflow-optuna.db", "mlartifacts"))
