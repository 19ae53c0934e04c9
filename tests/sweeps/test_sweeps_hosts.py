"""Sweeps on a Ray cluster whose hosts share nothing (the `hosts` fixture, tests/hosts.py): a
pruned Optuna sweep of the user's own `--config-dir` model, launched from the driver's host, runs
its trials on the two other hosts; every trial's run, metrics and artifacts, the parent run and
the study end up on the driver (the sweep serves its SQLite store and its study on the driver's
address toward the head: orchestrate.sweeps.remote), and each trial trains as it does on one
machine. What the trials could not report to is refused before anything starts."""

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import long, metric_steps

pytestmark = [pytest.mark.slow, pytest.mark.hosts]

SWEEP = ["--config-dir", "conf", "model=usernet", "backend=torch", "trainer.progress=false", "+sweep=lr_optuna",
         "hydra/sweeper/pruner=successive_halving", "hydra.sweeper.n_trials=4", "trainer.max_steps=120",
         "trainer.evaluation_period=20", "trainer.checkpoint_period=60"]


LONG_STEPS = 3_000_000  # minutes of training: still training when its host is lost


def orchestrate(hosts, project, *overrides, timeout=300):
    began = time.monotonic()
    done = hosts.head.run([sys.executable, "-m", "orchestrate", *overrides], timeout=timeout, cwd=project,
                          capture_output=True, text=True, env={**os.environ, **hosts.env})
    return done, time.monotonic() - began


def trials(project, experiment: str) -> dict[str, object]:
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    if found is None:  # not made yet
        return {}
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
    pruned = re.search(r"pruned: (\d+) of", printed)  # every pruning sweep's summary has the line
    assert pruned and int(pruned.group(1)) > 0  # successive halving stopped a trial, through the served study

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


@long("tests/sweeps/test_sweeps_hosts.py::test_a_pruned_optuna_sweep_on_other_hosts_reports_everything_to_the_driver"
      " (the same way back from the hosts); tests/sweeps/test_pareto.py for the front")
def test_a_two_objective_sweep_on_other_hosts_prunes_and_keeps_its_front_on_the_driver(hosts, project):
    """The dominated pruner's records (each evaluation's objectives, as trial attributes) reach the
    driver's study through the served gRPC proxy, and the front lands on the driver's parent run."""
    done, _ = orchestrate(hosts, project, "--config-dir", "conf", "model=usernet", "trainer.progress=false",
                          "+sweep=tradeoff", "backend=choice(torch)", "hydra/sweeper/pruner=dominated",
                          "hydra.sweeper.pruner.beaten_by=1", "hydra.sweeper.n_trials=4", "trainer.max_steps=60",
                          "trainer.evaluation_period=10", "trainer.checkpoint_period=0",
                          f"hydra.launcher.address={hosts.ray_address}", "tracking.experiment=front_on_hosts")
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-5000:]
    assert {h.address for h in hosts.hosts[1:] if f"ip={h.address})" in printed} == {h.address for h in hosts.hosts[1:]}
    assert "Pareto front:" in printed and re.search(r"pruned: \d+ of 4 trials", printed)
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    [parent] = client.search_runs([client.get_experiment_by_name("front_on_hosts").experiment_id],
                                  "tags.`orchestrate.role` = 'sweep'")
    assert parent.data.tags["orchestrate.pareto_front"].startswith("#")
    with sqlite3.connect(project / "mlflow-optuna.db") as db:  # written from the other hosts
        recorded = db.execute("select count(*) from trial_user_attributes where key like 'values_at_%'").fetchone()[0]
    assert recorded >= 4 * 2  # every trial's evaluations before its end or its pruning


def test_a_sweep_whose_trials_could_not_report_back_is_refused_before_anything_starts(hosts, project):
    done, took = orchestrate(hosts, project, *SWEEP, f"hydra.launcher.address={hosts.ray_address}",
                             "tracking.uri=http://127.0.0.1:5000", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: tracking.uri=http://127.0.0.1:5000: hydra.launcher.address=") and took < 30
    assert not any((project / name).exists() for name in ("multirun", "mlflow.db", "mlflow-optuna.db", "mlartifacts"))


def test_a_trial_on_a_lost_host_is_marked_failed_with_the_reason_and_the_others_finish(hosts, project):
    """Two grid trials, one on each other host; the host of the one that trains for minutes loses
    its Ray node mid-trial (the host lost): the sweep ends (exit 1: a trial failed) with the other
    trial FINISHED, the lost one's run FAILED with the host and Ray's reason in its `error` tag and
    the summary, no run left RUNNING. (Both trials of the same length raced: on a fast machine both
    had finished before the kill.) Last in this file: it kills a node."""
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    lost = None
    command = [sys.executable, "-m", "orchestrate", "--config-dir", "conf", "model=usernet", "backend=torch",
               "trainer.progress=false", "+sweep=lr_grid", "optimizer.lr=0.02",
               f"trainer.max_steps=4000,{LONG_STEPS}", "trainer.evaluation_period=0", "trainer.checkpoint_period=0",
               "trainer.display_loss_steps=50", f"hydra.launcher.address={hosts.ray_address}",
               "tracking.experiment=lost_trial"]
    running = hosts.head.popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **hosts.env})
    try:
        deadline = time.monotonic() + 180
        while True:  # both trials training, each on its host
            assert running.poll() is None, running.stdout.read()[-5000:]
            assert time.monotonic() < deadline, "the two trials did not both train within 180 s"
            found = trials(project, "lost_trial") if (project / "mlflow.db").exists() else {}
            long_ = [run for run in found.values() if run.data.params.get("trainer.max_steps") == str(LONG_STEPS)]
            if len(found) == 2 and long_ and client.get_metric_history(long_[0].info.run_id, "train/loss"):
                break
            time.sleep(0.5)
        hosts_of = {name: run.data.tags.get("host") for name, run in found.items()}
        assert len(set(hosts_of.values())) == 2, hosts_of  # one trial on each other host
        lost = next(h for h in hosts.hosts[1:] if h.name == long_[0].data.tags.get("host"))
        on_lost = [long_[0].data.tags["orchestrate.trial"]]
        lost.signal_all(signal.SIGKILL)  # the host's Ray node and the trial's worker killed
        out, _ = running.communicate(timeout=300)
    finally:
        if running.poll() is None:
            running.kill()
        if lost is not None:
            hosts.restart_node(lost)
        hosts.wait_nodes(len(hosts.hosts))
    assert running.returncode == 1, out[-5000:]
    ended = trials(project, "lost_trial")
    assert not [name for name, run in ended.items() if run.info.status == "RUNNING"]
    (gone,) = on_lost
    error = ended[gone].data.tags["error"]
    assert ended[gone].info.status == "FAILED" and f"on host {lost.name}" in error, error
    assert "NodeDiedError" in error or "WorkerCrashedError" in error, error  # Ray's own reason (its node's, or its worker's)
    (other,) = set(ended) - {gone}
    assert ended[other].info.status == "FINISHED"
    summary = [line for line in out.splitlines() if gone in line and "FAILED" in line]
    assert summary and lost.name in summary[-1], out[-3000:]
