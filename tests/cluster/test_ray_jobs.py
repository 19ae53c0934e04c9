"""Ray job submission, as a user of a Ray cluster sends work to it: through the head's job API
(`ray.job_submission.JobSubmissionClient`, and the guide's `ray job submit` command, docs/runner.md).

One head on 127.0.0.1 (`tests.helpers.loopback_cluster`: token authentication on, job submission
on its dashboard port) serves the whole module, and its jobs run side by side: a sweep submitted
from Python (shipping this checkout as its working directory), and the guide's command, which
submits a two-worker runner job, run while the sweep is in flight. The same command, from the
user's project, against the head of the test hosts that share nothing (tests/hosts.py), with
checkpoints on an S3 API server.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.conftest import ROOT
from tests.helpers import free_port, loopback_cluster
from tests.test_readme import SHORT, bash_commands, run, write_project

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

# Tiny runs: the point is the path from a submission to MLflow, not the training.
TINY = "data=synthetic trainer=quick trainer.max_steps=10"
JOBS = {
    "sweep": "python -m orchestrate -m backend=torch optimizer.lr=1e-3,1e-2 {tiny} tracking.uri={uri} "
             "tracking.experiment=ray_job_sweep",
}
# CPUs the jobs take at once: the sweep's two trials (one CPU each) and the guide command's runner
# (two workers). Job drivers themselves ask for none.
CPUS = 4
JOB_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def head(installed_wheel):
    """(job API address, the token, the nodes' environment). `python` on the head is the
    installed wheel's, as on a cluster built from the package; a job that ships this checkout
    imports orchestrate from it (its working directory comes first on sys.path)."""
    port = free_port()
    with loopback_cluster(nodes=1, cpus_per_node=CPUS, dashboard_port=port, env=installed_wheel.env) as (_, env):
        yield f"http://127.0.0.1:{port}", env["RAY_AUTH_TOKEN"], env


@pytest.fixture(scope="module")
def client(head) -> JobSubmissionClient:
    """A client that sends the head's token (`Authorization: Bearer <token>`), once the job API
    answers (the dashboard starts after the node is up)."""
    address, token, _ = head
    deadline = time.monotonic() + 120
    while True:
        try:
            found = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
            found.list_jobs()
            return found
        except (ConnectionError, RuntimeError) as e:  # not listening yet; job module not loaded yet
            if time.monotonic() > deadline:
                raise AssertionError(f"the job API at {address} did not answer within 120 s: {e}") from None
            time.sleep(1)


@pytest.fixture(scope="module")
def submitted(client, mlflow_server) -> dict[str, str]:
    """The jobs submitted from Python, not waited for: name -> job id."""
    # This checkout, as `ray job submit --working-dir .` ships it: Ray leaves out .git, .venv and
    # what .gitignore names (outputs, mlruns, ...), well under its 100 MiB limit.
    runtime_env = {"working_dir": str(ROOT), "env_vars": {"PYTHONUNBUFFERED": "1"}}
    return {name: submit(client, entry.format(tiny=TINY, uri=mlflow_server), runtime_env) for name, entry in JOBS.items()}


def submit(client: JobSubmissionClient, entrypoint: str, runtime_env: dict, timeout_s: float = 120) -> str:
    """`client.submit_job`, tried again while the head has no job agent yet: the node's agent
    registers some seconds after the job API first answers (HTTP 500 "No available agent")."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.fixture(scope="module")
def finished(client, submitted) -> dict[str, tuple[JobStatus, str]]:
    """Each job's final status and logs, waited for at most JOB_TIMEOUT_S (from the first wait)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    done = {}
    for name, job_id in submitted.items():
        while not (status := client.get_job_status(job_id)).is_terminal():
            if time.monotonic() > deadline:
                client.stop_job(job_id)
                pytest.fail(f"the {name} job ({job_id}) was still {status} after {JOB_TIMEOUT_S} s; "
                            f"its logs:\n{client.get_job_logs(job_id)[-4000:]}")
            time.sleep(2)
        done[name] = status, client.get_job_logs(job_id)
    return done


def test_the_head_refuses_a_client_without_its_token(head, client, submitted, tmp_path):
    """Without a token a client is refused (HTTP 401), with a wrong one too (403); with the
    head's token it sees the jobs. The tokenless client runs as a fresh user would: its own
    process, no RAY_AUTH_* variables and no ~/.ray/auth_token."""
    address, _, env = head
    bare = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", f"from ray.job_submission import JobSubmissionClient; "
                           f"JobSubmissionClient({address!r}).list_jobs()"],
                          env=bare, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "AuthenticationError: Authentication required: Unauthorized: Missing authentication token" in done.stderr
    with pytest.raises(AuthenticationError, match="Forbidden: Invalid authentication token"):
        JobSubmissionClient(address, headers={"Authorization": "Bearer " + "0" * 32})
    assert set(submitted.values()) <= {job.submission_id for job in client.list_jobs()}


def test_ray_job_submit_runs_the_runner_on_a_cluster(head, submitted, mlflow_server, tmp_path):
    """The guide's `ray job submit` command (docs/runner.md) against the head (its placeholders
    filled in), with RAY_AUTH_MODE=token as the guide exports it; the Python-submitted jobs run
    beside it. In CI's tier: each cluster command the guide documents is run there, as typed."""
    address, _, env = head
    (command, exported), = [(c, e) for c, e in bash_commands() if c.startswith("ray job submit")]
    shared = tmp_path / "shared"
    command = (command.replace("http://HEAD:8265", address)
               .replace("http://MLFLOW_HOST:5000", mlflow_server).replace("/shared", str(shared)))
    started = int(time.time() * 1000)
    done = run(command, write_project(tmp_path), {**env, **exported}, extra=SHORT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (shared / "outputs" / "run1").is_dir()
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id],
                              filter_string=f"tags.backend = 'runner' and attributes.start_time >= {started}")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].data.tags["backend"] == "runner"
    assert runs[0].data.metrics["world_size"] == 2 and "final/eval_loss" in runs[0].data.metrics
    assert f"MLflow run         {runs[0].info.run_id}" in done.stdout  # the job's driver output reached the console


def test_a_submitted_sweep_tracks_a_parent_and_its_trials(finished, mlflow_server):
    status, logs = finished["sweep"]
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    parent_id = re.search(r"sweep summary \(MLflow parent run (\w+), experiment 'ray_job_sweep'\)", logs).group(1)
    assert logs.count("| FINISHED |") == 2
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("ray_job_sweep").experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(c.info.run_name for c in children) == ["optimizer.lr=0.001", "optimizer.lr=0.01"]
    assert client.get_run(parent_id).info.status == "FINISHED"
    assert all(c.info.status == "FINISHED" and c.data.tags["backend"] == "torch" for c in children)


@pytest.mark.hosts
def test_ray_job_submit_from_the_drivers_host_runs_the_users_runner_on_hosts_that_share_nothing(hosts, s3_on_hosts,
                                                                                                 project):
    """The guide's `ray job submit --working-dir .` against the test hosts' head (tests/hosts.py),
    from the user's project folder on the driver's host: the project reaches the job and the
    workers on the other hosts, checkpoints go to the S3 API server (its variables in the job's
    runtime environment), the run lands in the store the entrypoint names; the job API
    (`JobSubmissionClient`, with the head's token) then reports the job and its logs."""
    store = f"sqlite:///{project}/jobs.db"  # the job's driver runs on the head's host: this path is there
    env_vars = json.dumps({"env_vars": {**s3_on_hosts, "PYTHONUNBUFFERED": "1"}})
    command = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", hosts.dashboard,
               "--working-dir", ".", "--runtime-env-json", env_vars, "--", sys.executable, "-m", "orchestrate",
               "--config-dir", "conf", "model=usernet", "backend=runner", "backend.engine=torch",
               "trainer.num_workers=2", "trainer.max_steps=100", "trainer.checkpoint_period=50",
               "trainer.display_loss_steps=10", "trainer.progress=false", "backend.storage_path=s3://checkpoints/job",
               f"tracking.uri={store}", f"hydra.run.dir={project}/outputs/job"]
    done = hosts.head.run(command, timeout=JOB_TIMEOUT_S, cwd=project, capture_output=True, text=True,
                          env={**os.environ, **hosts.env})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "FINISHED"
    assert {run.data.tags[f"worker.{r}"].split()[1] for r in (0, 1)} == {h.address for h in hosts.hosts[1:]}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(10, 101, 10))
    assert (project / "outputs" / "job").is_dir()

    # The job API, asked from the driver's host (the test's own process is on none of the hosts).
    ask = ("import json, sys; from ray.job_submission import JobSubmissionClient; "
           f"jobs = JobSubmissionClient({hosts.dashboard!r}, headers={{'Authorization': 'Bearer {hosts.token}'}}); "
           "(job,) = [j for j in jobs.list_jobs() if 's3://checkpoints/job' in j.entrypoint]; "
           "print(json.dumps([str(job.status), jobs.get_job_logs(job.submission_id)]))")
    asked = hosts.head.run([sys.executable, "-c", ask], timeout=120, capture_output=True, text=True, check=True)
    status, logs = json.loads(asked.stdout.strip().splitlines()[-1])
    assert status == "SUCCEEDED"
    assert f"MLflow run         {run.info.run_id}" in logs
