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

from tests.conftest import long, metric_steps

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


def test_data_the_other_hosts_do_not_have_is_refused_before_any_run_opens(hosts, s3_on_hosts, project, tmp_path):
    """Token shards in a folder of the driver's host only (its /tmp, which the other hosts do not
    see): refused in one line naming the key, the path and the hosts that lack it, exit 2, no run."""
    from orchestrate.tasks.shards import write_shards

    folder = tmp_path / "shards"
    write_shards(folder, 1, shard_megabytes=1)
    done, took = runner(hosts, project, "model=char_transformer", "data=token_shards", f"data.folder={folder}",
                        "trainer.max_steps=20", "backend.storage_path=s3://checkpoints/data",
                        env=s3_on_hosts)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    others = ", ".join(h.address for h in hosts.hosts[1:])
    assert len(lines) == 1 and lines[0].startswith(f"error: data.folder={folder}: not on host(s) {others}"), done.stderr
    assert "inside the working folder" in lines[0]
    assert took < 60
    assert runs_in(project) == 0


def test_an_elastic_runner_on_other_hosts_shrinks_when_one_is_lost_and_grows_when_it_is_back(hosts, s3_on_hosts,
                                                                                            project):
    """The user's model on the two other hosts (an elastic group of 1 to 2 workers), checkpoints on
    S3. One host's Ray node killed mid-run (the host lost: its worker with it): the group goes on
    with the one worker that fits, from the latest checkpoint in the bucket; the host's node
    started again: the group grows back to 2. The same MLflow run, every display step once.
    Before the ortmodule test: an elastic start waits out the resource request a killed driver's
    run left with Ray Train's AutoscalingCoordinator (up to 180 s; docs/runner.md)."""
    client = MlflowClient(f"sqlite:///{project}/mlflow.db")
    lost = hosts.hosts[2]
    # Steps of about 1.5 ms: long enough on 1 worker for the lost host to come back. A restart
    # waits backend.placement_timeout_s for its workers (Ray notices the node's loss after it
    # tried 2), then starts with the 1 that fits.
    command = runner_command(hosts, "trainer.max_steps=20000", "trainer.min_workers=1", "backend.resize_interval_s=2",
                             "backend.placement_timeout_s=20", "trainer.checkpoint_period=1000",
                             "trainer.evaluation_period=1000", "trainer.display_loss_steps=100",
                             "backend.storage_path=s3://checkpoints/lost", "tracking.experiment=lost")
    running = hosts.head.popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **hosts.env, **s3_on_hosts})

    def sizes_logged() -> list[tuple[int, float]]:
        """The run's world_size points so far ([] before the run opens)."""
        experiment = client.get_experiment_by_name("lost") if (project / "mlflow.db").exists() else None
        found = client.search_runs([experiment.experiment_id]) if experiment else []
        return metric_steps(client, found[0].info.run_id, "world_size") if found else []

    def wait_for(what: str, done) -> None:
        deadline = time.monotonic() + 180
        while not done():
            assert running.poll() is None, f"the run ended before {what}: " + running.stdout.read()[-3000:]
            assert time.monotonic() < deadline, f"no {what} within 180 s"
            time.sleep(0.5)

    try:
        wait_for("its first checkpoints", lambda: any(s >= 2500 for s, _ in sizes_logged()))
        lost.signal_all(signal.SIGKILL)  # the host's Ray node and its worker killed, mid-run
        wait_for("a step on 1 worker", lambda: any(size == 1 for _, size in sizes_logged()))
        hosts.restart_node(lost)
        wait_for("a step on 2 workers again", lambda: [int(v) for _, v in sizes_logged()][-1:] == [2]
                 and any(size == 1 for _, size in sizes_logged()))
        out, _ = running.communicate(timeout=300)
    finally:
        if running.poll() is None:
            running.kill()
        hosts.wait_nodes(len(hosts.hosts))
    assert running.returncode == 0, out
    assert "Found multiple active Ray instances" not in out  # the suite's other Rays, seen from every host
    # Neither the surviving worker's traceback nor Ray Train's controller's on the console: one
    # line from rank 0 at each restart (the shrink and the grow).
    assert "Traceback" not in out and "Error in training function" not in out, out[-5000:]
    assert out.count("the worker group (1 worker(s)) goes on from Ray Train's checkpoint at step") == 1, out[-5000:]
    assert out.count("the worker group (2 worker(s)) goes on from Ray Train's checkpoint at step") == 1, out[-5000:]
    (run,) = client.search_runs([client.get_experiment_by_name("lost").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_sizes"] == "2 -> 1 -> 2", run.data.tags
    resized = sorted((int(k.split("_")[-1]), v) for k, v in run.data.tags.items() if k.startswith("resized_at_"))
    assert [v for _, v in resized] == ["2 -> 1", "1 -> 2"]
    # The group shrank and went on from a checkpoint (one every 1000 steps).
    assert (resized[0][0] - 1) % 1000 == 0, resized
    # Ranks ran on the other hosts only (the head has no CPUs), not on the driver's.
    where = {run.data.tags[f"worker.{r}"].split()[1] for r in (0, 1)}
    assert where == {h.address for h in hosts.hosts[1:]}
    # Every display step once, in MLflow, across both restarts, though rank 0 could not reach the
    # driver's SQLite file.
    history = metric_steps(client, run.info.run_id, "train/loss")
    assert [s for s, _ in history] == list(range(100, 20001, 100))
    assert history[-1][1] < history[0][1] * 0.8
    assert client.get_run(run.info.run_id).data.metrics["eval/accuracy"] > 0.5
    # Each checkpoint rank 0 wrote on its host is in the run, sent through the driver's relay.
    names = [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert sorted(int(n.split("_")[1].split(".")[0]) for n in names) == list(range(1000, 20001, 1000)), names
    assert client.search_logged_models([run.info.experiment_id], filter_string="name = 'model'")
    # Ray Train's copies of the checkpoints are in the bucket, read back from the driver's host.
    listing = hosts.head.run([sys.executable, "-c", "import boto3; print(*[o['Key'] for o in boto3.client('s3')"
                              ".list_objects_v2(Bucket='checkpoints', Prefix='lost/')['Contents']], sep='\\n')"],
                             timeout=60, capture_output=True, text=True, env={**os.environ, **s3_on_hosts}, check=True)
    assert f"runner-{run.info.run_id}" in listing.stdout and "/checkpoint" in listing.stdout


@long("tests/backends/test_runner_hosts.py::test_an_elastic_runner_on_other_hosts_shrinks_when_one_is_lost_and_grows_"
      "when_it_is_back (its run goes on from the bucket's checkpoint on the same hosts)")
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


def test_pipeline_stages_on_two_hosts_train_as_one_process_does(hosts, s3_on_hosts, project):
    """The user's model cut in 2 stages, one on each of the other hosts: activations go forward and
    their gradients back over the hosts' network, checkpoints (every stage's part, one step) to S3.
    The loss at every step equals a one-process run's of the same global batch on the driver's host;
    the run's checkpoints and model are the whole model's."""
    client = MlflowClient(f"sqlite:///{project}/mlflow.db")
    steps = ["trainer.max_steps=30", "trainer.display_loss_steps=1", "trainer.checkpoint_period=15",
             "trainer.evaluation_period=15"]
    done, _ = runner(hosts, project, *steps, "trainer.pipeline_parallel_size=2", "trainer.gradient_accumulation_steps=2",
                     "trainer.batch_size=32", "backend.storage_path=s3://checkpoints/stages", "tracking.experiment=stages",
                     env=s3_on_hosts)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = hosts.head.run([sys.executable, "-m", "orchestrate", "--config-dir", "conf", "model=usernet",
                                "backend=torch", "trainer.batch_size=64", "trainer.progress=false", *steps,
                                "tracking.experiment=reference"], timeout=300, cwd=project, capture_output=True,
                               text=True, env={**os.environ, **hosts.env})
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    (run,) = client.search_runs([client.get_experiment_by_name("stages").experiment_id])
    (one,) = client.search_runs([client.get_experiment_by_name("reference").experiment_id])
    assert run.info.status == "FINISHED"
    assert {run.data.tags[f"worker.{r}"].split()[1] for r in (0, 1)} == {h.address for h in hosts.hosts[1:]}
    got, expected = metric_steps(client, run.info.run_id, "train/loss"), metric_steps(client, one.info.run_id, "train/loss")
    assert [s for s, _ in got] == list(range(1, 31))
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-5)
    assert got[-1][1] < got[0][1]
    names = sorted(Path(a.path).name for a in client.list_artifacts(run.info.run_id, "checkpoints"))
    assert names == ["step_0000015.pt", "step_0000030.pt"]
    assert client.search_logged_models([run.info.experiment_id], filter_string="name = 'model'")
