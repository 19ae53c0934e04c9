"""Stopping a run from outside: SIGINT (Ctrl-C), SIGTERM (`docker stop`, Slurm, `ray job stop`) and
SIGHUP (a closed terminal) end a real `python -m orchestrate` run on every backend with its MLflow run KILLED, its processes
gone and its last checkpoint loadable; `trainer.resume=auto` then finishes the same run, the old
`error` tag gone. A full disk under the checkpoints fails the run with one line and keeps the last
finished checkpoint.

The runs are subprocesses (a signal goes to a process), held at a known step by their data set
(HeldData) while the test signals them: no sleeping for a guessed time. Independent cases run two
at a time (`stopped_runs`)."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrate import checkpoints, schema
from orchestrate.config import load_config
from orchestrate.tasks.data import Synthetic
from tests.conftest import ROOT, client_for, long, metric_steps

HOLD_S = 120.0  # a held run waits at most this long for the test


class HeldData(Synthetic):
    """The synthetic data set, which holds its run at global batch `hold_at` (step hold_at + 1)
    while `marker` exists: it writes `<marker>.held` and waits. Batches are served in Python on
    every backend (the on-device one too) and on the runner's rank 0 worker."""

    def __init__(self, hold_at: int = 10**9, marker: str = "", **kwargs):
        super().__init__(**kwargs)
        self.hold_at, self.marker = hold_at, marker

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if position == self.hold_at and rank == 0 and self.marker and Path(self.marker).exists():
            Path(f"{self.marker}.held").write_text(str(os.getpid()))
            until = time.monotonic() + HOLD_S
            while Path(self.marker).exists() and time.monotonic() < until:
                time.sleep(0.05)
        return super().train_batch(position, batch_size, seed, rank, world_size)


# Checkpoints at steps 10 and 20, held in step 25, 30 steps in all.
def overrides(backend: str, marker: Path) -> list[str]:
    found = [f"backend={backend}", "trainer.max_steps=30", "trainer.checkpoint_period=10",
             "trainer.evaluation_period=0", "trainer.display_loss_steps=5",
             f"data._target_={HeldData.__module__}.HeldData", "+data.hold_at=24", f"+data.marker={marker}"]
    if backend == "runner":
        found += ["backend.engine=torch", "backend.max_failures=0", "trainer.num_workers=1"]
    elif backend == "runner-workers":  # the runner's worker group: stopped through Ray Train's controller
        found[0] = "backend=runner"
        found += ["backend.engine=torch", "backend.max_failures=0", "trainer.num_workers=2"]
    return found


def command(uri: str, words: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "orchestrate", "data=synthetic", "trainer=quick", f"tracking.uri={uri}",
            *words, f"hydra.run.dir={run_dir}"]


def descendants(pid: int) -> set[int]:
    """The processes below `pid` (Ray's local instance: GCS, raylet, workers), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    until = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {path.name}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < until, f"no {path} after {timeout_s:g} s"
        time.sleep(0.1)


@dataclass
class Stopped:
    """What a case saw: the stopped attempt and the resumed one."""

    backend: str
    signum: int
    uri: str
    run_dir: Path
    marker: Path
    stopped: subprocess.CompletedProcess
    left_running: set[int]  # the stopped run's processes still there after it exited
    status: str  # the stopped attempt's MLflow run: status, `error` tag, steps of train/loss logged
    error: str | None
    logged: list[int]
    resumed: subprocess.CompletedProcess


# One local Ray instance at a time: two starting at once on a loaded 2-core machine time out
# ("The current node timed out during startup").
ONE_RAY = threading.Lock()


def stop_and_resume(backend: str, signum: int, folder: Path) -> Stopped:
    if backend == "runner-workers":
        with ONE_RAY:
            return _stop_and_resume(backend, signum, folder)
    return _stop_and_resume(backend, signum, folder)


def _stop_and_resume(backend: str, signum: int, folder: Path) -> Stopped:
    folder.mkdir(parents=True)
    uri, marker = f"sqlite:///{folder}/mlflow.db", folder / "hold_while_this_exists"
    marker.touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # HeldData importable, Ray's workers too
    words = overrides(backend, marker)
    proc = subprocess.Popen(command(uri, words, folder / "first"), cwd=folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(Path(f"{marker}.held"), proc)
        below = descendants(proc.pid)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    until = time.monotonic() + 20  # Ray's processes end within seconds of its shutdown
    while alive(below) and time.monotonic() < until:
        time.sleep(0.2)
    stopped = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    client = client_for(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    logged = [s for s, _ in metric_steps(client, run.info.run_id, "train/loss")]
    marker.unlink()
    resumed = subprocess.run(command(uri, [*words, "trainer.resume=auto"], folder / "second"), cwd=folder,
                             env=env, capture_output=True, text=True, timeout=300)
    return Stopped(backend, signum, uri, folder / "first", marker, stopped, alive(below), run.info.status,
                   run.data.tags.get("error"), logged, resumed)


# The runner: one worker runs in the driver's process (SIGTERM), two as Ray Train's worker group
# (SIGINT: Ray Train's own handler would take it). The longest cases first. CI runs one case per
# loop and handler; ORTModule trains in torch's loop, and a worker group's stop is shown by
# tests/launch/test_slurm.py (scancel of the runner's job).
WORKER_GROUP = long("runner-SIGTERM; tests/launch/test_slurm.py::test_scancel_of_the_runner_job_kills_its_run_and_stops_ray")
CASES = [pytest.param(("runner-workers", signal.SIGINT), marks=WORKER_GROUP, id="runner-workers-SIGINT"),
         pytest.param(("torch", signal.SIGTERM), id="torch-SIGTERM"),
         pytest.param(("ortmodule", signal.SIGTERM), marks=long("torch-SIGTERM"), id="ortmodule-SIGTERM"),
         pytest.param(("runner", signal.SIGTERM), id="runner-SIGTERM"),
         pytest.param(("ondevice", signal.SIGTERM), id="ondevice-SIGTERM"),
         pytest.param(("torch", signal.SIGINT), id="torch-SIGINT"),
         # A closed terminal, a dropped SSH session: the handler SIGTERM's is (tests/test_process.py shows it raised).
         pytest.param(("torch", signal.SIGHUP), marks=long("torch-SIGTERM"), id="torch-SIGHUP")]


@pytest.fixture(scope="module")
def stopped_runs(request, tmp_path_factory):
    """Every selected case, two at a time (each is mostly waiting: process start, Ray's start)."""
    wanted = [item.callspec.params["case"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_a_signal_kills_the_run_and_resume_finishes_it"]
    folder = tmp_path_factory.mktemp("signals")
    pool = concurrent.futures.ThreadPoolExecutor(2)
    futures = {case: pool.submit(stop_and_resume, case[0], case[1], folder / f"{case[0]}-{case[1].name}")
               for case in wanted}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_signal_kills_the_run_and_resume_finishes_it(case, stopped_runs):
    seen: Stopped = stopped_runs[case].result(timeout=600)
    name = seen.signum.name
    assert seen.stopped.returncode == 128 + seen.signum, seen.stopped.stderr[-3000:]
    assert f"stopped by {name}: the MLflow run is marked KILLED" in seen.stopped.stderr
    # None of the driver's own (Ray's actors' forwarded lines begin with their names).
    assert not [line for line in seen.stopped.stderr.splitlines() if line.startswith("Traceback")], \
        seen.stopped.stderr[-3000:]
    assert not seen.left_running, f"processes left running: {seen.left_running}"
    assert (seen.status, seen.error) == ("KILLED", f"interrupted ({name})")
    assert seen.logged[-1] == 20  # the steps up to the checkpoint reached MLflow; step 25 never ended
    client = client_for(seen.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert f"resuming MLflow run {run.info.run_id} after step 20" in seen.resumed.stdout, seen.resumed.stderr[-3000:]
    assert seen.resumed.returncode == 0, seen.resumed.stderr[-3000:]
    assert run.info.status == "FINISHED"
    assert "error" not in run.data.tags
    assert [s for s, _ in metric_steps(client, run.info.run_id, "train/loss")] == [5, 10, 15, 20, 25, 30]
    # The stopped attempt's last checkpoint, step 20, loads as a resume loads it.
    cfg = load_config(["data=synthetic", "trainer=quick", *overrides(seen.backend, seen.marker)])
    (last,) = [p for p in sorted((seen.run_dir / "checkpoints").iterdir())][-1:]
    assert last.name.startswith("step_0000020")
    state = checkpoints.load_checked(schema.build(cfg.backend, "backend"), schema.build(cfg.model, "model"), last)
    assert state["step"] == 20


def mount_small(folder: Path, size: str) -> bool:
    """A size-limited tmpfs at `folder` (needs root, as here and on CI); False where it cannot be."""
    folder.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


@pytest.mark.slow
def test_a_full_disk_fails_the_run_and_keeps_the_last_checkpoint(tmp_path):
    """The run's checkpoints folder is a small file system, filled up while the run is held in step
    25: checkpoint 30 cannot be written. The run fails with one line naming the folder and the
    cause, MLflow says FAILED with that line, and checkpoint 20 still loads."""
    run_dir, marker, uri = tmp_path / "run", tmp_path / "hold", f"sqlite:///{tmp_path}/mlflow.db"
    folder = run_dir / "checkpoints"
    assert mount_small(folder, "2m"), "cannot mount a tmpfs here (the test needs root, as CI runs)"
    try:
        marker.touch()
        proc = subprocess.Popen(command(uri, overrides("torch", marker), run_dir), cwd=tmp_path, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            wait_for(Path(f"{marker}.held"), proc)
            with open(folder / "filler", "wb") as f:  # every block the file system has left
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            marker.unlink()  # the run goes on, to checkpoint 30
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 1, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert errors == [f"error: checkpoint step 30 not written to {folder}: No space left on device "
                          f"(0 KiB free on its file system); the last finished one, step_0000020.pt, is kept; "
                          "the MLflow run is marked FAILED"], err[-3000:]
        assert not [line for line in err.splitlines() if line.startswith("Traceback")], err[-3000:]
        assert sorted(p.name for p in folder.iterdir()) == ["filler", "step_0000010.pt", "step_0000020.pt"]
        cfg = load_config(["data=synthetic", "trainer=quick", *overrides("torch", marker)])
        state = checkpoints.load_checked(schema.build(cfg.backend, "backend"), schema.build(cfg.model, "model"),
                                         folder / "step_0000020.pt")
        assert state["step"] == 20
        client = client_for(uri)
        (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
        assert run.info.status == "FAILED"
        assert run.data.tags["error"].startswith(f"CheckpointError: checkpoint step 30 not written to {folder}: "
                                                 "No space left on device")
    finally:
        subprocess.run(["umount", str(folder)], check=True)
