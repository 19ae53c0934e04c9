"""The runner's correctness, as ORT states it for data-parallel training: N workers with batch B equal one worker with
batch N*B, and K accumulated micro-batches equal one batch K times larger, update for update;
all ranks hold the same parameters; a killed worker costs nothing but time; a two-node cluster
on loopback trains with one worker per node. Two workers against one is in the default tier (on
the session's Ray); the other engines, accumulation, faults and the cluster are `slow`.
Tolerances on the final weights: 1e-5 absolute for the plain PyTorch and the on-device engines
(the sums are only reordered), 1e-4 for ORTModule (ORT's kernels sum differently)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

from orchestrate import app, checkpoints, schema
from orchestrate.__main__ import main
from orchestrate.backends.runner import driver
from orchestrate.cluster import ray_cluster, warm
from orchestrate.config import load_config
from tests.conftest import ROOT, client_for, here, long, metric_steps
from tests.helpers import alive_nodes, loopback_cluster, prints_no_cuda_notice, served_twice

COMMON = ["backend=runner", "backend.engine=torch", "data=synthetic", "trainer=quick", "trainer.max_steps=12",
          "trainer.evaluation_period=0", "trainer.checkpoint_period=0", "optimizer=sgd", "optimizer.lr=0.1"]


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_shared):
    """The session's local Ray (2 CPUs) for this module's runs: the runner joins it and leaves it running."""
    return ray_shared


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """The reference the equivalence tests compare with: the PyTorch engine, one worker, batch 64
    (trained once for the module)."""
    return train(tmp_path_factory.mktemp("one_worker"), "one", "trainer.num_workers=1", "trainer.batch_size=64")


def train(tmp_path, name: str, *overrides: str):
    small_mlp = [] if any(o.startswith("model=") for o in overrides) else ["model.hidden=[32]"]
    cfg = load_config([*COMMON, *small_mlp, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides])
    return app.train(cfg, tmp_path / name)


def final_weights(result) -> dict[str, torch.Tensor]:
    path = sorted((result.out_dir / "checkpoints").glob("step_*"))[-1]
    if path.suffix == ".ckpt":  # the ondevice engine's CheckpointState
        backend = schema.build(load_config(["backend=ondevice"]).backend, "backend")
        return {k: torch.from_numpy(v) for k, v in backend.read_checkpoint(path).items()}
    return {k: torch.from_numpy(v) for k, v in checkpoints.torch_parameters(path).items()}


def assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.mark.slow  # 15-17 s; the default tier has the runner in the contract suite
def test_two_workers_with_batch_b_equal_one_worker_with_batch_2b_and_stay_identical(tmp_path, one_worker):
    two = train(tmp_path, "two", "trainer.num_workers=2", "trainer.batch_size=32", "trainer.display_loss_steps=1")
    assert_same(final_weights(two), final_weights(one_worker), atol=1e-5)
    # After every update both ranks held the same parameters (all-reduced max - min of every one).
    divergence = metric_steps(client_for(f"sqlite:///{tmp_path}/mlflow.db"), two.run_id, "train/replica_divergence")
    assert [s for s, _ in divergence] == list(range(1, 13))
    assert all(v == 0.0 for _, v in divergence)


@pytest.mark.slow
def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger(tmp_path, one_worker):
    acc = train(tmp_path, "acc", "trainer.gradient_accumulation_steps=4", "trainer.batch_size=16")
    assert_same(final_weights(acc), final_weights(one_worker), atol=1e-5)


def test_one_worker_trains_in_the_drivers_own_process(one_worker):
    """trainer.num_workers=1: Ray Train's local mode, the loop in this very process (its rank 0
    tag names this pid), no worker group and so no worker log; the weights equal two workers'
    (the test above)."""
    client = client_for(f"sqlite:///{one_worker.out_dir.parent}/mlflow.db")
    tags = client.get_run(one_worker.run_id).data.tags
    assert tags["worker.0"].endswith(f" pid {os.getpid()}")  # this process: no worker process
    assert not list(one_worker.out_dir.glob("worker_*.log"))


def test_the_weights_moved(one_worker):
    """Guards the equivalence tests against comparing two untrained models."""
    trained = final_weights(one_worker)
    cfg = load_config([*COMMON, "model.hidden=[32]"])
    torch.manual_seed(cfg.trainer.seed)
    initial = schema.build(cfg.model, "model").state_dict()
    assert not torch.allclose(trained["net.0.weight"], initial["net.0.weight"])


@pytest.mark.slow
@long("test_two_workers_with_batch_b_equal_one_worker_with_batch_2b_and_stay_identical (the torch engine's "
      "loop, which ORTModule trains in)")
def test_ortmodule_engine_two_workers_equal_one(tmp_path, one_worker):
    """DDP(ORTModule(model)): the same equivalence, within 1e-4."""
    two = train(tmp_path, "two", "backend.engine=ortmodule", "trainer.num_workers=2", "trainer.batch_size=32")
    assert_same(final_weights(two), final_weights(one_worker), atol=1e-4)


@pytest.mark.slow
@long(stands_for="tests/backends/test_runner.py::test_two_workers_with_batch_b_equal_one_worker_with_batch_2b_and_stay_identical")
def test_compile_engine_two_workers_equal_one(tmp_path, one_worker):
    """DDP(torch.compile(model)) on each worker: its gradients all-reduced as the torch engine's,
    the same weights within 1e-5 (Inductor's fused kernels round a little differently), and the
    compile time logged apart from the step times."""
    two = train(tmp_path, "two", "backend.engine=compile", "trainer.num_workers=2", "trainer.batch_size=32")
    assert_same(final_weights(two), final_weights(one_worker), atol=1e-5)
    [(step, seconds)] = metric_steps(client_for(f"sqlite:///{tmp_path}/mlflow.db"), two.run_id, "perf/compile_s")
    assert step == 1 and seconds > 0


@pytest.mark.slow
def test_ondevice_engine_all_reduces_gradients(tmp_path, one_worker):
    """ORT's gradient buffers, all-reduced in place: 2 workers x B (with 2 micro-batches each)
    equal the PyTorch engine on one worker with 4B."""
    two = train(tmp_path, "two", "backend.engine=ondevice", "trainer.num_workers=2", "trainer.batch_size=16",
                "trainer.gradient_accumulation_steps=2")
    assert_same(final_weights(two), final_weights(one_worker), atol=1e-5)


@pytest.mark.slow
def test_ondevice_engine_federated_averaging(tmp_path, one_worker):
    """Averaging the parameters after every SGD update is the same as all-reducing the gradients;
    averaging every 4th update lets the ranks drift apart in between, and the divergence metric
    shows it."""
    every_step = train(tmp_path, "avg1", "backend.engine=ondevice", "backend.average_every=1",
                       "trainer.num_workers=2", "trainer.batch_size=32")
    assert_same(final_weights(every_step), final_weights(one_worker), atol=1e-5)

    every_4th = train(tmp_path, "avg4", "backend.engine=ondevice", "backend.average_every=4",
                      "trainer.num_workers=2", "trainer.batch_size=32", "trainer.display_loss_steps=1")
    divergence = dict(metric_steps(client_for(f"sqlite:///{tmp_path}/mlflow.db"), every_4th.run_id,
                                   "train/replica_divergence"))
    assert [divergence[s] for s in (4, 8, 12)] == [0.0, 0.0, 0.0]
    assert all(divergence[s] > 1e-4 for s in (1, 2, 3, 5, 6, 7, 9, 10, 11))


@pytest.mark.slow
def test_a_killed_worker_restarts_from_the_checkpoint_and_matches_an_uninterrupted_run(tmp_path):
    """SIGKILL to rank 1 in step 45 (its data set kills the worker process, once): Ray Train
    restarts both workers from the latest checkpoint (step 40), the run finishes, MLflow holds
    every step once, and losses and weights equal an uninterrupted run's, the learning rate's
    warm-up and decay included. With the on-device engine, whose checkpoint (ORT's
    CheckpointState and optimizer state) has the most to restore; the workers read any engine's
    checkpoint through the same `Backend.load_checkpoint` (the PyTorch engine's: test_app's
    runner resume and test_checkpoints)."""
    engine = "ondevice"
    marker = tmp_path / "kill_while_this_exists"
    marker.touch()
    overrides = [f"backend.engine={engine}", "backend.max_failures=1", "trainer.batch_size=16",
                 "trainer.num_workers=2", "trainer.max_steps=100", "trainer.checkpoint_period=20",
                 "trainer.display_loss_steps=1", "trainer.lr_schedule=linear", "trainer.warmup_steps=50",
                 "optimizer=adamw", "optimizer.lr=0.003", "data._target_=tests.helpers.KillingData",
                 "+data.kill_at=44", "+data.rank=1"]
    result = train(tmp_path, "killed", *overrides, f"+data.marker={marker}")
    assert not marker.exists(), "the worker was never killed"
    assert served_twice(marker) == list(range(40, 44))  # rank 1 went on after step 40, not from the start
    reference = train(tmp_path, "reference", *overrides, "+data.marker=", "tracking.experiment=reference")

    client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    steps = metric_steps(client, result.run_id, "train/loss")
    assert [s for s, _ in steps] == list(range(1, 101))  # each step logged once, none missing
    assert [v for _, v in steps] == pytest.approx([v for _, v in metric_steps(client, reference.run_id, "train/loss")],
                                                  abs=1e-6)
    killed_pid = (tmp_path / "kill_while_this_exists.killed").read_text()
    assert run.data.tags["worker.1"].split()[-1] != killed_pid  # rank 1 runs in a new process
    assert_same(final_weights(result), final_weights(reference), atol=1e-6)


def test_workers_that_cannot_be_placed_fail_with_what_was_asked_and_free(tmp_path, local_ray):
    """A cluster whose CPUs are taken: after placement_timeout_s the run stops with a plain message
    that says the cluster is busy and how to wait longer."""

    @ray.remote(num_cpus=1)
    class Busy:
        def ping(self):
            return True

    busy = Busy.remote()
    ray.get(busy.ping.remote())
    try:
        with pytest.raises(schema.ConfigError, match=r"could not be placed within backend.placement_timeout_s=2; "
                                                     r"the Ray cluster has \{'CPU': 2\.0\} in all, free now \{'CPU': 1\.0\}; "
                                                     r"its nodes could hold it, and other work holds them now: "
                                                     r"backend.placement_timeout_s=<seconds> waits longer"):
            train(tmp_path, "x", "trainer.num_workers=2", "backend.placement_timeout_s=2")
    finally:
        ray.kill(busy)
    client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []  # no run opened


# What Ray and Ray Train printed on the runner's console before they were kept off it: Ray's token
# banner, the controller's INFO lines, the preemption watcher's error line, a worker's INFO lines,
# the placement group cleaner's warning (once a second, all run long).
RAY_LINES = ("Token authentication", "Requesting resources", "Attempting to start training worker group",
             "Started training worker group", "PreemptionWatcher", "Setting up process group",
             "Checkpoint successfully created", "Failed to query Ray Train Controller actor state")


@pytest.mark.slow
def test_the_runners_console_has_orchestrates_lines_and_its_workers_log_the_rest(warm_stack, tmp_path,
                                                                                   tmp_path_factory):
    """The guide's runner command on the on-device engine (docs/runner.md), typed as a user types
    it (a local Ray of its own): the console has rank 0's lines and the summary, none of RAY_LINES and not
    torch's "No CUDA runtime is found"; the worker's log has Ray Train's checkpoint lines and the
    notice (where this machine prints it). It runs cold beside the session's warm head (two Ray
    instances on one machine, as a user's own `ray start` would make): Ray Train's cleaner asks its
    own cluster about its run, and the warm head is left alone."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": str(tmp_path_factory.mktemp("ray"))}
    done = subprocess.run([sys.executable, "-m", "orchestrate", "backend=runner", "backend.engine=ondevice",
                           "trainer=quick", "data=synthetic", "trainer.num_workers=2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    assert [line for line in RAY_LINES if line in printed] == [], printed[-4000:]
    assert "No CUDA runtime" not in printed
    assert "[runner/ondevice] step 30: eval loss" in printed and "backend runner: 30 steps" in printed
    assert "start              cold: started a local Ray for this command" in done.stdout
    assert "Found multiple active Ray instances" not in printed
    head = warm.Stack(**json.loads((warm_stack.state / "stack.json").read_text()))
    assert head.ray_answers()  # the warm head was left alone
    logged = (Path(re.search(r"^  outputs +(\S+)$", done.stdout, re.MULTILINE).group(1)) / "worker_0.log").read_text()
    assert logged.count("Checkpoint successfully created") >= 2  # steps 15 and 30 (and the summary's report)
    if prints_no_cuda_notice():
        assert "No CUDA runtime is found" in logged


def test_ray_trains_preemption_watcher_is_off_on_the_local_ray_only_while_the_run_trains(monkeypatch):
    """Nothing on a local instance is drained by an autoscaler; a joined cluster keeps the
    watcher, and a value of the user's is kept."""
    name = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
    monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray_cluster, "can_grow", lambda: False)  # the local Ray `init` started
    with driver.train_environment():
        assert os.environ[name] == "0"
    assert name not in os.environ
    monkeypatch.setattr(ray_cluster, "can_grow", lambda: True)  # a cluster that was joined
    with driver.train_environment():
        assert name not in os.environ
    monkeypatch.setenv(name, "1")
    monkeypatch.setattr(ray_cluster, "can_grow", lambda: False)
    with driver.train_environment():
        assert os.environ[name] == "1"
    assert os.environ[name] == "1"


@pytest.mark.parametrize("overrides,message", [
    (["backend=runner", "trainer.num_workers=64"], "asks for 64 CPUs; this machine has"),
    (["backend=runner", "trainer.num_workers=0"], "trainer.num_workers=0: must be at least 1"),
    (["backend=runner", "trainer.gradient_accumulation_steps=0"], "trainer.gradient_accumulation_steps=0: must be at least 1"),
    (["backend=torch", "trainer.num_workers=2"], "need backend=runner"),
    (["backend=runner", "backend.engine=jax"],
     "backend.engine=jax: no such backend; allowed: compile, ondevice, ortmodule, torch"),
    (["backend=runner", "backend.engine=runner"], "backend.engine=runner: the runner cannot run itself"),
    (["backend=runner", "backend.average_every=5"], "backend.average_every needs an engine that averages parameters"),
    (["backend=runner", "backend.placement_strategy=RANDOM"], "allowed: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    (["backend=runner", "backend.max_failures=-1"], "backend.max_failures=-1: must be 0 or more"),
    (["backend=runner", "backend.log_level=LOUD"], "backend.log_level='LOUD': allowed: VERBOSE, DEVINFO, INFO"),
    (["backend=runner", "backend.use_gpu=true"], "backend.use_gpu=true and trainer.device=cpu disagree"),
    pytest.param(["backend=runner", "backend.engine=ondevice", "optimizer._target_=torch.optim.Adam"],
                 "the on-device API offers", marks=pytest.mark.ort),
])
def test_bad_runner_input(overrides, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["orchestrate", *here(overrides)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.cluster
@long(stands_for="tests/backends/test_elastic.py::test_an_elastic_run_grows_and_shrinks_on_a_loopback_cluster")
def test_a_two_node_cluster_on_loopback_runs_one_worker_per_node(tmp_path):
    """A real cluster: a head and a second node (`ray start`, 1 CPU each, 127.0.0.1 only); the
    command line is pointed at it and both nodes host a worker."""
    with loopback_cluster(nodes=2, cpus_per_node=1) as (address, env):
        nodes = alive_nodes(address, env)
        done = subprocess.run(
            [sys.executable, "-m", "orchestrate", "backend=runner", "backend.engine=torch", f"backend.ray_address={address}",
             "backend.placement_strategy=STRICT_SPREAD", "trainer.num_workers=2", "data=synthetic", "trainer=quick",
             "trainer.max_steps=40", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"],
            cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert len(nodes) == 2
    assert done.returncode == 0, done.stderr[-3000:]
    client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "FINISHED"
    used = {run.data.tags[f"worker.{r}"].split()[3] for r in (0, 1)}  # "host ip node <id> pid <pid>"
    assert len(used) == 2 and all(any(n.startswith(u) for n in nodes) for u in used)
    losses = [v for _, v in metric_steps(client, run.info.run_id, "train/loss")]
    assert losses[-1] < losses[0]
