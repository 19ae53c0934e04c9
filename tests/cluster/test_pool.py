"""The warm pool of `orchestrate up` (orchestrate.cluster.pool), on the session's warm stack
(tests/conftest.py's `warm_stack`, 2 workers; slow: the stack's start and stop alone take half a
minute, so the default tier has the pool's checks only): a command typed as usual runs as a fork of it and
behaves as a process of its own (output, exit code, Ctrl-C, the same losses as a fresh process),
the command's own process imports no torch, two commands at once share its workers or wait,
kill -9 of a run's fork or of the pool itself is survived by the next command. The sweep's and the
runner's workers as forks: tests/cluster/test_warm.py. `down` stopping it: test_warm's last test."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.cluster import pool, pool_process, warm
from tests.conftest import BACKENDS, backend_params, client_for, here, long, metric_steps

QUICK = ["data=synthetic", "trainer=quick", "trainer.progress=false"]
FORK_LINE = "in a fork of the warm pool"


def command(words: list[str], cwd: Path, state: Path | None, **env: str) -> subprocess.Popen:
    environ = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    if state is None:
        environ["ORCHESTRATE_WARM"] = "0"  # a process of its own, beside the warm stack
    else:
        environ["ORCHESTRATE_STATE_DIR"] = str(state)
    return subprocess.Popen([sys.executable, "-m", "orchestrate", *words], cwd=cwd, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def record(state: Path) -> warm.Stack:
    return warm.Stack(**json.loads((state / "stack.json").read_text()))


def pool_state(state: Path) -> dict:
    found = pool.status(record(state).pool_socket)
    assert found is not None, "the warm pool does not answer"
    return found


def wait_for(what: str, test, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = test()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def running_fork(state: Path) -> int:
    """The pid of the command running on the pool now."""
    return wait_for("a command running on the pool",
                    lambda: next((f["pid"] for f in pool_state(state)["running"] if f["kind"] == "command"), None))


@pytest.mark.slow
def test_a_command_runs_as_a_fork_and_its_own_process_imports_no_torch(warm_stack, tmp_path):
    served = pool_state(warm_stack.state)["served"]["command"]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # -X importtime lists what the command's own interpreter imports (the fork imports nothing at start).
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "orchestrate", *here(QUICK), f"tracking.uri={uri}"],
                          cwd=tmp_path, env={**os.environ, "ORCHESTRATE_STATE_DIR": str(warm_stack.state)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"start              warm: {FORK_LINE} that `orchestrate up` keeps" in done.stdout
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "orchestrate.cluster.pool" in imported and not {"torch", "mlflow", "onnxruntime", "ray"} & imported
    (run,) = client_for(uri).search_runs([client_for(uri).get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "FINISHED" and "train/loss" in run.data.metrics
    assert pool_state(warm_stack.state)["served"]["command"] == served + 1
    # Refused input: the same line and exit code as in a process of its own, nothing written.
    refused = tmp_path / "refused"
    refused.mkdir()
    bad = finished(command(["trainer.max_steps=-1"], refused, warm_stack.state))
    cold = finished(command(["trainer.max_steps=-1"], refused, None))
    assert bad[0] == cold[0] == 2 and bad[2] == cold[2] and bad[2].startswith("error: trainer.max_steps=-1")
    assert list(refused.iterdir()) == []


@pytest.mark.slow
def test_a_fork_imports_the_users_modules_from_its_folder_and_another_pythonpath_runs_cold(warm_stack, tmp_path):
    """sys.path as a fresh `python -m orchestrate` has it, without the fork editing it: the model a
    user keeps in the command's folder imports; a PYTHONPATH the pool did not start with runs the
    command in its own process, with one line saying why."""
    (tmp_path / "mine.py").write_text("from orchestrate.tasks.models import MLP\n\n\nclass Mine(MLP):\n    pass\n")
    words = [*here(QUICK), "trainer.max_steps=2", "model._target_=mine.Mine", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    code, out, err = finished(command(words, tmp_path, warm_stack.state))
    assert code == 0 and FORK_LINE in out, err[-3000:]
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mine.py").write_text((tmp_path / "mine.py").read_text())
    code, out, err = finished(command(words, tmp_path / "lib", warm_stack.state, PYTHONPATH=str(lib)))
    assert code == 0 and FORK_LINE not in out, err[-3000:]
    assert f"PYTHONPATH={lib}: where Python looks for modules" in out + err


# Every backend but auto, whose choice among them depends on timing (what it chooses is one of these).
# CI runs torch and ondevice (a fork's losses do not depend on the backend that trains in it); the
# others, slower to start in a fork (the runner's Ray workers, compile's Inductor, ORTModule's
# export), are the long tier's.
FORK_IN_CI = "tests/cluster/test_pool.py::test_a_reused_worker_gives_the_losses_of_a_fresh_process[torch]"
REUSED = [p if p.values[0] in ("torch", "ondevice") else pytest.param(*p.values, marks=[*p.marks, long(FORK_IN_CI)])
          for p in backend_params([b for b in BACKENDS if b != "auto"])]


@pytest.mark.slow
@pytest.mark.parametrize("backend", REUSED)
def test_a_reused_worker_gives_the_losses_of_a_fresh_process(backend, warm_stack, tmp_path):
    """Two runs on the pool (the second forked from the same pool process as the first, after it)
    and one in a process of its own: the same loss at every step, to 1e-6."""
    words = here([f"backend={backend}", *QUICK, "trainer.max_steps=12", "trainer.display_loss_steps=1",
                  "trainer.num_workers=2" if backend == "runner" else "trainer.seed=3"])
    histories = []
    for name, state in (("warm-1", warm_stack.state), ("warm-2", warm_stack.state), ("cold", None)):
        folder = tmp_path / name
        folder.mkdir()
        code, out, err = finished(command([*words, f"tracking.uri=sqlite:///{folder}/mlflow.db"], folder, state))
        assert code == 0, err[-3000:]
        assert (FORK_LINE in out) == (state is not None), out[-2000:]
        client = client_for(f"sqlite:///{folder}/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
        histories.append(metric_steps(client, run.info.run_id, "train/loss"))
    assert len(histories[0]) >= 12
    for other in histories[1:]:
        assert [s for s, _ in other] == [s for s, _ in histories[0]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(other, histories[0])) <= 1e-6, (histories[0], other)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_the_run_killed_and_the_next_command_runs_warm(sig, warm_stack, tmp_path):
    """Ctrl-C (SIGINT, what a terminal sends its foreground process) or SIGTERM (`kill`, systemd)
    to the command the user typed reaches the fork: the run ends KILLED, exit 128 + N."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = command([*here(QUICK), "trainer.max_steps=100000", "trainer.checkpoint_period=0", f"tracking.uri={uri}"],
                   tmp_path, warm_stack.state)
    fork = running_fork(warm_stack.state)
    wait_for("the run's first steps", lambda: list(tmp_path.glob("outputs/*/*/app.log")))
    time.sleep(2)
    proc.send_signal(sig)
    code, out, err = finished(proc, timeout=120)
    assert code == 128 + sig, err[-3000:]
    with pytest.raises(ProcessLookupError):
        os.kill(fork, 0)
    client = client_for(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == "KILLED"
    again = finished(command([*here(QUICK), f"tracking.uri={uri}"], tmp_path, warm_stack.state))
    assert again[0] == 0 and FORK_LINE in again[1], again[2][-3000:]


@pytest.mark.slow
def test_kill_9_of_a_runs_fork_is_said_and_survived_by_the_next_command(warm_stack, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = command([*here(QUICK), "trainer.max_steps=100000", f"tracking.uri={uri}"], tmp_path, warm_stack.state)
    fork = running_fork(warm_stack.state)
    os.kill(fork, signal.SIGKILL)
    code, _, err = finished(proc, timeout=60)
    assert code == -signal.SIGKILL, err  # the command ends as its run's process did
    assert f"the run's process (pid {fork}, a fork of the warm pool) was killed by SIGKILL" in err
    again = finished(command([*here(QUICK), f"tracking.uri={uri}"], tmp_path, warm_stack.state))
    assert again[0] == 0 and FORK_LINE in again[1], again[2][-3000:]


@pytest.mark.slow
def test_more_commands_than_workers_wait_with_a_line_then_give_up_at_their_timeout(warm_stack, tmp_path):
    workers = record(warm_stack.state).pool_workers
    long_runs = [command([*here(QUICK), "trainer.max_steps=100000", f"tracking.uri=sqlite:///{tmp_path}/{i}.db"],
                         tmp_path, warm_stack.state) for i in range(workers)]
    try:
        wait_for(f"{workers} commands running",
                 lambda: sum(f["kind"] == "command" for f in pool_state(warm_stack.state)["running"]) == workers)
        began = time.monotonic()
        code, _, err = finished(command([*here(QUICK), "backend.placement_timeout_s=3"], tmp_path, warm_stack.state),
                                timeout=60)
        assert code == 1 and time.monotonic() - began < 30, err
        lines = err.strip().splitlines()
        assert lines[0].startswith(f"waiting for a warm worker: all {workers} are running commands (pid "), err
        assert lines[-1].startswith("error: no warm worker was free within 3 s"), err
    finally:
        for proc in long_runs:
            proc.send_signal(signal.SIGINT)
        for proc in long_runs:
            finished(proc, timeout=120)


@pytest.mark.slow
def test_the_pool_answers_its_user_only(warm_stack, tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    path = record(warm_stack.state).pool_socket
    child = os.fork()
    if child == 0:  # another user (nobody) asks
        try:
            os.setuid(65534)
            os._exit(0 if pool.connect(path) is None else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the pool's folder is private: nobody else gets to its socket
    assert Path(path).parent.stat().st_mode & 0o777 == 0o700


def refusal(pythonpath: str | None = None, **request) -> str | None:
    """The pool's answer to a request (its environment and folder this process's unless given);
    `pythonpath`: the PYTHONPATH the pool started with."""
    state = pool_process.Pool("/nonexistent", 1)
    state.stamp = "stamp"
    if pythonpath is not None:
        state.env = {**state.env, "PYTHONPATH": pythonpath}
    return state.refuses({"prefix": sys.prefix, "stamp": "stamp", "env": dict(os.environ), "cwd": os.getcwd(),
                          **request})


def test_what_a_fork_could_not_be_as_a_fresh_process_runs_cold_with_one_line():
    assert refusal() is None
    assert refusal(prefix="/other/venv").startswith("the warm pool runs the Python of")
    assert refusal(stamp="new").startswith("orchestrate's code changed since the warm pool imported it")
    assert refusal(env={**os.environ, "PYTHONHASHSEED": "7"}).startswith("PYTHONHASHSEED=7: read when libraries are "
                                                                        "imported")
    assert refusal(env={**os.environ, "OMP_NUM_THREADS": "1"}) is None  # the fork sets torch's threads from it
    # sys.path is the pool's: a PYTHONPATH naming other folders runs cold; the same folders, written
    # relative to another folder, do not
    here = os.getcwd()
    assert refusal(env={**os.environ, "PYTHONPATH": "/elsewhere"}, cwd=here).startswith(
        "PYTHONPATH=/elsewhere: where Python looks for modules")
    assert refusal(env={**os.environ, "PYTHONPATH": os.path.basename(here)}, cwd=os.path.dirname(here),
                   pythonpath=here) is None


def test_a_commands_wait_is_its_placement_timeout():
    assert pool.wait_s_of(["backend=runner", "backend.placement_timeout_s=5"]) == 5
    assert pool.wait_s_of(["-m", "hydra.launcher.placement_timeout_s=7.5"]) == 7.5
    assert pool.wait_s_of(["backend=torch"]) == pool.DEFAULT_WAIT_S


@pytest.mark.slow
def test_kill_9_of_the_pools_process_is_survived_the_supervisor_starts_another(warm_stack, tmp_path):
    before = pool_state(warm_stack.state)
    os.kill(before["pid"], signal.SIGKILL)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # Gone, its socket with it (a command that connects while the kernel still tears the process
    # down is answered by no one, and runs cold without the line)
    wait_for("the pool's process gone", lambda: not pool.alive(before["pid"]))
    code, out, err = finished(command([*here(QUICK), f"tracking.uri={uri}"], tmp_path, warm_stack.state))
    assert code == 0, err[-3000:]  # cold while the new pool imports, with a line saying so
    # (or, met while the kernel tore the process down: "... ended before it took this command: ...")
    assert re.search(r"(is starting again \(its process ended\)|ended before it took this command): this command "
                     r"runs in its own process", err), out[-3000:]
    after = wait_for("the pool started again", lambda: pool.status(record(warm_stack.state).pool_socket))
    assert after["pid"] != before["pid"] and after["generation"] == before["generation"] + 1
    again = finished(command([*here(QUICK), f"tracking.uri={uri}"], tmp_path, warm_stack.state))
    assert again[0] == 0 and FORK_LINE in again[1], again[2][-3000:]
