"""Slurm, tried for real: the session's one-node Slurm 22.05 cluster on 127.0.0.1 (`slurm_cluster`,
tests/slurm.py; accounting off, as on most small clusters) and the session's MLflow server.

- The guide's `submitit_slurm` sweep (docs/sweeps.md), as written but for what this cluster has
  (partition, sizes, no GPU, the server's address), run from a folder that holds `.venv` as its
  setup line expects: every trial a Slurm job, the runs on the server, the summary last and readable.
- `scancel` of a running trial: its run KILLED, the other trial FINISHED, the sweep's summary.
- The guide's sbatch script for the runner (docs/runner.md, `orchestrate slurm-ray`) on a 2-task allocation: Ray
  across the allocation, one worker per task, the run FINISHED; cancelled with `scancel` while it
  trains: the run KILLED, Ray stopped. Outside an allocation: one line, exit code 2.

Commands run as a user types them (the checkout's .venv python), results are read back through
MlflowClient and Slurm's own commands. Each test's experiment is its own on the shared server.
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrate.cluster import allocation, ports
from tests.conftest import ROOT, client_for, long, metric_steps
from tests.test_readme import blocks

SWEEP_TIMEOUT_S = 600
JOB_TIMEOUT_S = 400
# The guide's sweep, on this cluster: its one partition, one CPU and 1 GB a trial, no GPU.
ON_THIS_CLUSTER = {
    "hydra.launcher.partition=P": "hydra.launcher.partition={partition}",
    "hydra.launcher.timeout_min=120": "hydra.launcher.timeout_min=10",
    "hydra.launcher.cpus_per_task=4": "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.gpus_per_node=1": "hydra.launcher.gpus_per_node=null",
    "hydra.launcher.mem_gb=16": "hydra.launcher.mem_gb=1",
    "tracking.uri=http://MLFLOW_HOST:5000": "tracking.uri={uri}",
}
QUICK = ("backend=torch", "data=synthetic", "trainer=quick", "trainer.max_steps=20")


def readme_sweep(partition: str, uri: str) -> list[str]:
    """The guide's submitit_slurm command (docs/sweeps.md) with ON_THIS_CLUSTER's replacements (each
    must find its word: the guide's command keeps its shape), `python` being this checkout's."""
    (block,) = [b for b in blocks("bash") if "hydra/launcher=submitit_slurm" in b]
    words = shlex.split(block.replace("\\\n", " "), comments=True)  # as the shell reads it: quotes kept together
    assert set(ON_THIS_CLUSTER) <= set(words), words
    words = [ON_THIS_CLUSTER.get(w, w).format(partition=partition, uri=uri) for w in words]
    assert words[0] == "python"
    return [sys.executable, *words[1:]]


def user_folder(tmp_path: Path) -> Path:
    """A folder as the guide's commands expect one: `.venv` in it (here, this checkout's)."""
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    return tmp_path


def slurm_env(cluster) -> dict:
    """The cluster's environment, tests.helpers importable by the jobs (they inherit it)."""
    return {**cluster.env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def runs_of(uri: str, experiment: str):
    """(client, parent runs, child runs) of `experiment` on the server."""
    client = client_for(uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], max_results=100) if found else []
    parents = [r for r in runs if r.data.tags.get("orchestrate.role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


@pytest.mark.slow
@pytest.mark.slurm
def test_the_readme_sweep_runs_every_trial_as_a_slurm_job(slurm_cluster, mlflow_server, tmp_path):
    folder = user_folder(tmp_path)
    command = [*readme_sweep(slurm_cluster.partition, mlflow_server), *QUICK, "tracking.experiment=slurm_sweep"]
    done = subprocess.run(command, cwd=folder, env=slurm_env(slurm_cluster), capture_output=True, text=True,
                          timeout=SWEEP_TIMEOUT_S)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]

    client, (parent,), children = runs_of(mlflow_server, "slurm_sweep")
    # No sweep file named: the parent is named after what the sweep varies.
    assert (parent.info.run_name, parent.info.status) == ("sweep-optimizer.lr", "FINISHED")
    assert sorted((c.info.run_name, c.info.status) for c in children) == [
        ("optimizer.lr=0.001", "FINISHED"), ("optimizer.lr=0.01", "FINISHED")]
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)
    # Each trial ran as a Slurm job: submitit's folder holds one result per job, and its output.
    (sweep_dir,) = (folder / "multirun").glob("*/*")
    results = sorted(p.parent.name for p in sweep_dir.glob(".submitit/*/*_result.pkl"))
    assert len(results) == 2 and all(re.fullmatch(r"\d+_[01]", r) for r in results), results
    # A job whose result is written may still be RUNNING for Slurm for a moment: wait for its end.
    assert {wait_for_the_end(slurm_cluster, r) for r in results} == {"COMPLETED"}

    # The summary is readable and last: no sacct or submitit notes on the console (they are in the
    # sweep's submitit.log), and the closing hint is the server's own URL.
    summary = printed.index(f"sweep summary (MLflow parent run {parent.info.run_id}")
    assert "| optimizer.lr=0.01 | FINISHED |" in printed[summary:]
    for noise in ("sacct", "accounting", "Bypassing", "submitit WARNING"):
        assert noise not in printed, printed
    assert "Slurm accounting storage is disabled" in (sweep_dir / "submitit.log").read_text()
    assert done.stdout.rstrip().splitlines()[-1] == \
        f"open the UI at     {mlflow_server}/#/experiments/{parent.info.experiment_id}/runs"
    assert "--backend-store-uri http" not in printed


# A trial is still training ~40 s after it started (400 batches, each 100 ms slower): the launcher
# notices the cancelled one (a poll, then submitit's 15 s wait for its result) while it runs.
SLOW = ("backend=torch", "data._target_=tests.helpers.SlowData", "+data.delay_ms=100", "trainer=quick",
        "trainer.max_steps=400", "trainer.evaluation_period=100", "trainer.checkpoint_period=100")


@pytest.mark.slow
@pytest.mark.slurm
@long("test_scancel_of_the_runner_job_kills_its_run_and_stops_ray (scancel's signal, handled the same); "
      "tests/sweeps/test_sweeps.py::test_a_failing_trial_does_not_stop_the_others")
def test_scancel_of_a_running_trial_kills_its_run_and_the_sweep_goes_on(slurm_cluster, mlflow_server, tmp_path):
    folder = user_folder(tmp_path)
    command = [*readme_sweep(slurm_cluster.partition, mlflow_server), *SLOW, "tracking.experiment=slurm_scancel"]
    sweep = subprocess.Popen(command, cwd=folder, env=slurm_env(slurm_cluster), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        # Trial 0 (array task 0) is cancelled once it has logged a loss, while trial 1 runs too.
        trial_0 = wait_until_training(slurm_cluster, mlflow_server, "slurm_scancel", "optimizer.lr=0.001")
        array = trial_0.split("_")[0]
        assert {slurm_cluster.job_state(f"{array}_{i}") for i in (0, 1)} == {"RUNNING"}
        slurm_cluster.run("scancel", trial_0)
        printed, _ = sweep.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        sweep.kill()
    # Decided: a trial that did not finish makes the sweep exit 1, as a failed trial does.
    assert sweep.returncode == 1, printed[-4000:]

    client, (parent,), children = runs_of(mlflow_server, "slurm_scancel")
    status = {c.info.run_name: c for c in children}
    killed, finished = status["optimizer.lr=0.001"], status["optimizer.lr=0.01"]
    assert (killed.info.status, killed.data.tags["error"]) == ("KILLED", "interrupted (SIGTERM)")
    assert metric_steps(client, killed.info.run_id, "train/loss")  # it was training when cancelled
    assert finished.info.status == "FINISHED" and finished.data.metrics["final/train_loss"] > 0
    assert [s for s, _ in metric_steps(client, finished.info.run_id, "train/loss")][-1] == 400
    assert parent.info.status == "FAILED"
    assert (wait_for_the_end(slurm_cluster, trial_0), wait_for_the_end(slurm_cluster, f"{array}_1")) == (
        "CANCELLED", "COMPLETED")

    # One line for the cancelled job, a wait for the job still running, then both summarized, last.
    assert re.search(rf"error: the sweep: Slurm job {trial_0} ended CANCELLED without its result \(scancel, .*\); "
                     rf"its output: \S+/\.submitit/{trial_0}; full traceback in ", printed), printed[-4000:]
    assert f"waiting for the sweep's 1 Slurm job(s) still on the cluster ({array}_1)" in printed
    summary = printed[printed.index("sweep summary (MLflow parent run"):]
    assert re.search(r"\| optimizer\.lr=0\.001 \| KILLED \|.*interrupted \(SIGTERM\)", summary), summary
    assert "| optimizer.lr=0.01 | FINISHED |" in summary
    assert summary.rstrip().splitlines()[-1].startswith(f"open the UI at     {mlflow_server}/#/experiments/")


def training_run(uri: str, experiment: str, name: str | None = None):
    """The run of `experiment` (named `name`, if given) once it has logged a training loss; else None."""
    client = client_for(uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return next((r for r in runs if name in (None, r.info.run_name)
                 and metric_steps(client, r.info.run_id, "train/loss")), None)


def wait_until_training(cluster, uri: str, experiment: str, trial: str) -> str:
    """The Slurm job id of the sweep's array task running `trial` (trial index = array index), once
    its MLflow run has logged a training loss."""
    cluster.wait_for(f"trial {trial} to log a training loss", lambda: training_run(uri, experiment, trial),
                     JOB_TIMEOUT_S)
    index = training_run(uri, experiment, trial).data.tags["orchestrate.trial_index"]
    (job,) = [j for j in cluster.run("squeue", "--noheader", "--array", "--format=%i").split() if j.endswith(f"_{index}")]
    return job


# ---- the runner on a Slurm allocation --------------------------------------------------------------

def submit_readme_script(cluster, uri: str, folder: Path, experiment: str, *overrides: str) -> str:
    """The guide's runner.sbatch (docs/runner.md), its placeholders filled in and `overrides` appended
    (they win), submitted as its `sbatch runner.sbatch` says, sized for this one node: two tasks of
    one CPU. Returns the job id."""
    (script,) = [b for b in blocks("bash") if "# runner.sbatch" in b]
    assert script.rstrip().splitlines()[-1].strip().startswith("trainer.checkpoint_period=100")
    script = (script.replace("MLFLOW_HOST:5000", uri.removeprefix("http://")).replace("/shared", str(folder / "shared"))
              .rstrip() + f" tracking.experiment={experiment} data=synthetic trainer=quick {' '.join(overrides)}\n")
    (folder / "runner.sbatch").write_text(script)
    return cluster.run("sbatch", "--parsable", f"--partition={cluster.partition}", "--nodes=1", "--ntasks-per-node=2",
                       "--cpus-per-task=1", "--time=10", "runner.sbatch", cwd=folder).strip()


def wait_for_the_end(cluster, job: str) -> str:
    """The job's final state, once nothing of it is left on the node; its output then is whole."""
    cluster.wait_for(f"job {job} to end and leave the node", lambda: cluster.job_state(job) not in
                     ("PENDING", "RUNNING", "COMPLETING") and cluster.node_state() == "idle", JOB_TIMEOUT_S)
    return cluster.job_state(job)


def ray_head(cluster, job: str, output: str) -> tuple[str, int]:
    """The head's address slurm-ray announced for the job (one node: the CPUs of its two tasks)."""
    found = re.search(rf"slurm-ray: job {job}: Ray head on {cluster.node} \(([\d.]+):(\d+)\), 1 node\(s\): "
                      rf"{cluster.node} 2 CPU\(s\)", output)
    assert found, output[:3000]
    return found.group(1), int(found.group(2))


@pytest.mark.slow
@pytest.mark.slurm
def test_the_runner_on_a_slurm_allocation(slurm_cluster, mlflow_server, tmp_path):
    folder = user_folder(tmp_path)
    # Ray's machine-wide address file: a user's own `ray start` may have left one (as may another
    # Ray of this session); what matters is that the job did not write it.
    shared = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    before = shared.stat().st_mtime_ns if shared.exists() else None
    job = submit_readme_script(slurm_cluster, mlflow_server, folder, "slurm_runner", "trainer.max_steps=60")
    state = wait_for_the_end(slurm_cluster, job)
    output = (folder / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", output[-4000:]

    head = ray_head(slurm_cluster, job, output)
    assert "slurm-ray: python -m orchestrate backend=runner trainer.num_workers=2 backend.cpus_per_worker=1 " in output
    assert "slurm-ray: Ray stopped on 1 node(s) in " in output
    assert not ports.answers(*head, 2)  # the job's Ray is gone with it
    # and leaves no address behind for a later plain ray.init() on the node to wait for
    assert (shared.stat().st_mtime_ns if shared.exists() else None) == before
    assert not allocation.head_folder(job).exists()

    client, _, _ = runs_of(mlflow_server, "slurm_runner")
    (run,) = client.search_runs([client.get_experiment_by_name("slurm_runner").experiment_id])
    assert run.info.status == "FINISHED"
    assert (run.data.tags["backend"], run.data.metrics["world_size"]) == ("runner", 2)
    assert {"worker.0", "worker.1"} <= set(run.data.tags)
    losses = [v for _, v in metric_steps(client, run.info.run_id, "train/loss")]
    assert len(losses) >= 10 and losses[-1] < losses[0], losses
    assert f"MLflow run         {run.info.run_id}" in output
    assert (folder / "shared" / "outputs" / f"runner-{job}").is_dir()  # hydra.run.dir, $SLURM_JOB_ID expanded


@pytest.mark.slow
@pytest.mark.slurm
def test_scancel_of_the_runner_job_kills_its_run_and_stops_ray(slurm_cluster, mlflow_server, tmp_path):
    folder = user_folder(tmp_path)
    job = submit_readme_script(slurm_cluster, mlflow_server, folder, "slurm_runner_scancel",
                               "trainer.max_steps=100000", "trainer.evaluation_period=1000")
    slurm_cluster.wait_for(f"job {job}'s run to log a training loss",
                           lambda: training_run(mlflow_server, "slurm_runner_scancel"), JOB_TIMEOUT_S)
    slurm_cluster.run("scancel", job)
    assert wait_for_the_end(slurm_cluster, job) == "CANCELLED"

    output = (folder / f"slurm-{job}.out").read_text()
    assert "slurm-ray: stopped by a signal: stopping Ray" in output and "slurm-ray: Ray stopped on 1 node(s)" in output
    assert not ports.answers(*ray_head(slurm_cluster, job, output), 2)
    client, _, _ = runs_of(mlflow_server, "slurm_runner_scancel")
    (run,) = client.search_runs([client.get_experiment_by_name("slurm_runner_scancel").experiment_id])
    assert (run.info.status, run.data.tags.get("error")) == ("KILLED", "interrupted (SIGTERM)"), output[-4000:]
    assert "slurm-ray: the training command ended " in output
    assert not (folder / f"slurm-ray-{job}.run").exists()


# ---- bad input: no cluster needed ----------------------------------------------------------------

def test_slurm_ray_outside_an_allocation_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrate", "slurm-ray", "--", "trainer.max_steps=5"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - began < 10
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: orchestrate slurm-ray: not inside a Slurm allocation")
    assert len(done.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_slurm_per_node_counts_are_expanded():
    assert allocation.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert allocation.expand_counts("4") == [4]

