"""The runner on a Ray cluster whose hosts share nothing (the `hosts` fixture: the driver's host
with the Ray head, two others with a worker each, in network and mount namespaces of their own):
the user's own model reaches the workers, what rank 0 logs reaches the driver's MLflow run,
checkpoints go to an S3 API server, and storage the other hosts cannot see is refused up front.
Commands run on the driver's host as a user types them, from the user's project folder."""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import metric_steps

pytestmark = [pytest.mark.slow, pytest.mark.hosts]

def runner_command(hosts, *overrides, engine="torch") -> list[str]:
    """The runner on the hosts' cluster, the user's model, as typed from the project's folder."""
    return [sys.executable, "-m", "orchestrate", "--config-dir", "conf", "model=usernet", "backend=runner",
            f"backend.engine={engine}", f"backend.ray_address={hosts.ray_address}", "trainer.num_workers=2",
            "trainer.progress=false", *overrides]


def runner(hosts, project, *overrides, env=None, timeout=300, engine="torch"):
    began = time.monotonic()
    done = hosts.head.run(runner_command(hosts, *overrides, engine=engine), timeout=timeout, cwd=project, capture_output=True,
                          text=True, env={**os.environ, **hosts.env, **(env or {})})
    return done, time.monotonic() - began


def runs_in(project) -> int:
    store = project / "mlflow.db"
    if not store.exists():
        return 0
    with sqlite3.connect(store) as db:
        return db.execute("select count(*) from runs").fetchone()[0]


@pytest.mark.parametrize("storage", ["unset", "a-folder-of-this-host"])
def test_storage_the_other_hosts_cannot_see_is_refused_before_any_run_opens(hosts, project, storage, tmp_path):
    folder = None if storage == "unset" else str(tmp_path / "checkpoints")
    overrides = ["trainer.max_steps=20", *([f"backend.storage_path={folder}"] if folder else [])]
    done, took = runner(hosts, project, *overrides)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: backend.storage_path"), done.stderr
    others = ", ".join(h.address for h in hosts.hosts[1:])
    assert (f"not the same folder on host(s) {others}" if folder else f"the cluster has other hosts ({others})") \
        in lines[0]
    assert "s3://bucket/prefix" in lines[0]
    assert took < 60
    assert runs_in(project) == 0


def test_the_ortmodule_engine_goes_on_from_the_bucket_after_the_drivers_command_is_killed(hosts, s3_on_hosts,
                                                                                          project):
    """ORTModule's engine on the two other hosts, checkpoints on S3. The driver's command killed
    (SIGKILL: nothing of it can tidy up) once a checkpoint is in; the same command with
    `trainer.resume=auto` goes on in the same MLflow run (Ray Train finds the run's checkpoints in
    the bucket by its name; else the driver's, read from the run), and finishes with every display
    step once."""
    client = MlflowClient(f"sqlite:///{project}/mlflow.db")
    env = {**os.environ, **hosts.env, **s3_on_hosts}
    overrides = ["trainer.max_steps=300", "trainer.checkpoint_period=100", "trainer.display_loss_steps=10",
                 "backend.storage_path=s3://checkpoints/killed", "tracking.experiment=killed"]
    running = hosts.head.popen(runner_command(hosts, *overrides, engine="ortmodule"), cwd=project,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        run_id = None
        while time.monotonic() < deadline and running.poll() is None:  # its first checkpoint in the run
            experiment = client.get_experiment_by_name("killed") if (project / "mlflow.db").exists() else None
            found = client.search_runs([experiment.experiment_id]) if experiment else []
            if found and client.list_artifacts(found[0].info.run_id, "checkpoints"):
                run_id = found[0].info.run_id
                break
            time.sleep(0.5)
        assert running.poll() is None and run_id, running.stdout.read() if running.poll() is not None else "no run"
    finally:
        running.kill()  # ip netns exec execs the command: this is the driver's own process
        first = running.communicate(timeout=60)[0]
    assert client.get_run(run_id).info.status == "RUNNING"  # nothing could close it
    done, _ = runner(hosts, project, *overrides, "trainer.resume=auto", env=s3_on_hosts, timeout=300,
                     engine="ortmodule")
    assert done.returncode == 0, first[-3000:] + done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resuming MLflow run {run_id}" in done.stdout
    (run,) = client.search_runs([client.get_experiment_by_name("killed").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.params["backend.engine"] == "ortmodule"
    history = metric_steps(client, run_id, "train/loss")
    assert [s for s, _ in history] == list(range(10, 301, 10))  # every display step once, across the kill
    assert history[-1][1] < history[0][1] * 0.8
    assert {run.data.tags[f"worker.{r}"].split()[1] for r in (0, 1)} == {h.address for h in hosts.hosts[1:]}


def test_the_runner_trains_the_users_model_on_other_hosts_and_survives_losing_one(hosts, s3_on_hosts, project):
    """The user's model on the two other hosts, checkpoints on S3; one host's Ray node killed
    mid-run and started again: the run goes on from the latest checkpoint in the bucket. Last in
    this file: it kills a node."""
    client = MlflowClient(f"sqlite:///{project}/mlflow.db")
    lost = hosts.hosts[2]
    command = runner_command(hosts, "trainer.max_steps=1000", "trainer.checkpoint_period=100",
                             "trainer.display_loss_steps=10", "backend.storage_path=s3://checkpoints/lost")
    running = hosts.head.popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **hosts.env, **s3_on_hosts})
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and running.poll() is None:  # past the first checkpoints
            found = client.search_runs([e.experiment_id for e in client.search_experiments()]) \
                if (project / "mlflow.db").exists() else []
            if found and len(client.get_metric_history(found[0].info.run_id, "train/loss")) >= 30:
                break
            time.sleep(0.5)
        assert running.poll() is None, running.stdout.read()
        lost.signal_all(signal.SIGKILL)  # the host's Ray node and its worker killed, mid-run
        time.sleep(3)
        hosts.restart_node(lost)
        out, _ = running.communicate(timeout=300)
    finally:
        if running.poll() is None:
            running.kill()
        hosts.wait_nodes(len(hosts.hosts))
    assert running.returncode == 0, out
    assert "resumed" in out  # (Ray Train's controller prints the lost worker's traceback: see docs/runner.md)
    assert "Found multiple active Ray instances" not in out  # the suite's other Rays, seen from every host
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "FINISHED"
    # Both ranks ran on the other hosts (the head has no CPUs), not on the driver's.
    where = {run.data.tags[f"worker.{r}"].split()[1] for r in (0, 1)}
    assert where == {h.address for h in hosts.hosts[1:]}
    # Every display step once, in MLflow, across the restart, though rank 0 could not reach the
    # driver's SQLite file.
    history = metric_steps(client, run.info.run_id, "train/loss")
    assert [s for s, _ in history] == list(range(10, 1001, 10))
    assert history[-1][1] < history[0][1] * 0.8
    assert client.get_run(run.info.run_id).data.metrics["eval/accuracy"] > 0.5
    # Each checkpoint rank 0 wrote on its host is in the run, sent through the driver's relay.
    names = [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert sorted(int(n.split("_")[1].split(".")[0]) for n in names) == list(range(100, 1001, 100)), names
    assert client.search_logged_models([run.info.experiment_id], filter_string="name = 'model'")
    # Ray Train's copies of the checkpoints are in the bucket, read back from the driver's host.
    listing = hosts.head.run([sys.executable, "-c", "import boto3; print(*[o['Key'] for o in boto3.client('s3')"
                              ".list_objects_v2(Bucket='checkpoints', Prefix='lost/')['Contents']], sep='\\n')"],
                             timeout=60, capture_output=True, text=True, env={**os.environ, **s3_on_hosts}, check=True)
    assert f"runner-{run.info.run_id}" in listing.stdout and "/checkpoint" in listing.stdout
