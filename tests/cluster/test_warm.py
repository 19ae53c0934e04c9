"""`orchestrate up` / `orchestrate down` (orchestrate.cluster.warm): the session's warm stack (started
once, as a user starts it, by tests/conftest.py's `warm_stack`), joined by a sweep typed as usual,
clusters refused up front, then stopped (a cold runner beside it: tests/backends/test_runner.py's
console test). A record whose stack is gone is
ignored in well under a second, with one line."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrate.cluster import pool, warm
from orchestrate.cluster.runtime import Runtime
from tests.commands.test_server import LOOPBACK, listening
from tests.conftest import sweep_runs


def orchestrate(*words: str, cwd: Path, state: Path, timeout: int = 300, merged: bool = False,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """The command on the stack of `state`; `merged`: stderr into stdout, in the order printed."""
    env = {**os.environ, **(env or {}), "ORCHESTRATE_STATE_DIR": str(state)}
    return subprocess.run([sys.executable, "-m", "orchestrate", *words], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True, timeout=timeout)


def after(printed: str, line_start: str) -> list[str]:
    """The lines printed after the first line that starts with `line_start`."""
    lines = printed.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith(line_start)) + 1:]


@pytest.fixture(scope="module")
def warm_up(warm_stack):
    """The session's warm stack (tests/conftest.py): (its folder, its state folder, what `up`
    printed). The last test here stops it."""
    return warm_stack.folder, warm_stack.state, warm_stack.printed


def record(state: Path) -> warm.Stack:
    return warm.Stack(**json.loads((state / "stack.json").read_text()))


@pytest.mark.slow
def test_up_starts_ray_and_the_server_on_loopback_with_a_private_record(warm_up):
    folder, state, printed = warm_up
    up = record(state)
    assert printed.startswith(f"up: Ray {up.ray_version} at {up.ray_address} (2 CPUs, token auth, 2 warm worker(s)) "
                              f"and the MLflow server {up.server_uri} in front of sqlite:///{folder}/mlflow.db")
    for address in (up.ray_address, up.server_uri.removeprefix("http://")):
        found = listening(int(address.rsplit(":", 1)[1]))  # 127.0.0.1, or as IPv6 writes it (::ffff:127.0.0.1)
        assert found and found <= {LOOPBACK, "0000000000000000FFFF00000100007F"}, found
    assert (state / "stack.json").stat().st_mode & 0o777 == 0o600 and state.stat().st_mode & 0o777 == 0o700
    token = Path.home() / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600
    # Asked again: the same stack, nothing new started.
    again = orchestrate("up", cwd=folder, state=state)
    assert again.returncode == 0 and again.stdout.startswith(f"already up: Ray {up.ray_version} at {up.ray_address}")
    status = orchestrate("up", "--status", cwd=folder, state=state)
    assert (status.returncode, status.stdout.split(" (")[0]) == (0, f"warm: Ray {up.ray_version} at {up.ray_address}")
    assert status.stdout.splitlines()[1].startswith(f"warm pool: pid {pool.status(up.pool_socket)['pid']} (started ")


@pytest.mark.slow
def test_a_sweep_joins_the_warm_ray_and_writes_through_the_warm_server(warm_up):
    """(A runner's worker group joining the warm head: the guide's runner commands, which
    tests/test_readme.py runs warm.)"""
    folder, state, _ = warm_up
    served = pool.status(record(state).pool_socket)["served"]
    short = ["trainer.max_steps=20", "trainer.display_loss_steps=5"]
    swept = orchestrate("+sweep=lr_grid", "backend=torch", *short, "trainer.progress=true", cwd=folder, state=state,
                        merged=True)
    assert swept.returncode == 0, swept.stdout[-3000:]
    # The summary is the last thing printed: the trials' progress bars (their worker's stderr, which
    # Ray's deduplicator held back) came after it.
    assert not [line for line in after(swept.stdout, "sweep summary") if "pid=" in line], swept.stdout[-3000:]
    assert ("start: warm: joined the Ray head and the MLflow server that `orchestrate up` keeps running, in a fork of "
            "the warm pool (imports done)") in swept.stdout
    # The sweep's driver and the Ray workers its trials ran in were forks of the pool.
    now = pool.status(record(state).pool_socket)["served"]
    assert now["command"] == served["command"] + 1 and now["worker"] > served["worker"]
    # Written through the warm server into the folder's store, read back from the file.
    _, (parent,), children = sweep_runs(folder)
    assert len(children) == 3 and all(c.info.status == "FINISHED" for c in children)
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"summary.md", "trials_loss_curves.png"}
    # The trials ran in the command's folder (their outputs are here), not where the head started.
    assert len(list((folder / "multirun").glob("*/*/[0-9]"))) == 3 and not (state / "multirun").exists()


def test_a_record_whose_stack_is_gone_is_ignored_with_one_line(tmp_path, monkeypatch, caplog):
    from tests.helpers import free_port

    monkeypatch.setenv("ORCHESTRATE_STATE_DIR", str(tmp_path))
    gone = warm.Stack(ray_address=f"127.0.0.1:{free_port()}", ray_pid=2**22 + 1, ray_temp_dir=str(tmp_path / "t"),
                       ray_version="2.60.0", num_cpus=2, store=f"sqlite:///{tmp_path}/mlflow.db",
                       server_uri=f"http://127.0.0.1:{free_port()}", server_pid=2**22 + 2,
                       artifacts=str(tmp_path / "a"))
    (tmp_path / "stack.json").write_text(json.dumps(gone.__dict__))
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="orchestrate.cluster.warm"):
        assert warm.found() is None and warm.runtime() == Runtime()
    assert time.monotonic() - began < 5  # a socket connect, not Ray's minutes of retries
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"the warm stack recorded in {tmp_path / 'stack.json'} is gone (nothing answers at "
                           f"{gone.ray_address}); ignoring it")
    assert Runtime().start_line(None, None) == "one process: no Ray and no server to keep warm"


def test_no_record_means_cold(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATE_STATE_DIR", str(tmp_path))
    assert warm.found() is None and warm.runtime().server_for(f"sqlite:///{tmp_path}/mlflow.db") is None
    assert Runtime().start_line("cold", False).startswith("cold: started a local Ray and an MLflow server for this "
                                                          "command")


def test_a_warm_server_that_did_not_answer_is_named_only_where_a_sweep_would_use_it(caplog):
    """The entry notes whether the warm MLflow server answered; the line saying a sweep starts its
    own comes when a sweep asks for it for that store, not on every command."""
    store = "sqlite:////work/mlflow.db"
    down = Runtime(head="127.0.0.1:1", server_uri="http://127.0.0.1:2", server_store=store, server_artifacts="/a")
    with caplog.at_level(logging.WARNING, logger="orchestrate.cluster.runtime"):
        assert down.server_for("sqlite:////elsewhere/mlflow.db") is None and not caplog.records
        assert down.server_for(store) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("the warm stack's MLflow server http://127.0.0.1:2 does not answer; this sweep starts its own")
    up = Runtime(server_uri="http://127.0.0.1:2", server_store=store, server_artifacts="/a", server_answers=True)
    assert up.server_for(store) == ("http://127.0.0.1:2", "/a")


@pytest.mark.slow
@pytest.mark.parametrize("words", [["backend=runner"], ["+sweep=lr_grid", "backend=torch"],
                                   ["backend=runner", "backend.ray_address=auto"]], ids=["runner", "sweep", "auto"])
def test_a_wrong_ray_token_is_refused_in_one_line_before_anything_opens(warm_up, tmp_path, words):
    """As fast and as plainly for `backend.ray_address=auto` (the cluster Ray would find: here
    RAY_ADDRESS's) as for an address."""
    _, state, _ = warm_up
    named = "backend.ray_address=auto" if "backend.ray_address=auto" in words else f"RAY_ADDRESS={record(state).ray_address}"
    env = {**os.environ, "ORCHESTRATE_STATE_DIR": str(state), "RAY_ADDRESS": record(state).ray_address,
           "RAY_AUTH_TOKEN": "0" * 32}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrate", *words], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: {named}: the cluster refused this process's Ray token"), done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "gcs_client" not in done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []  # no MLflow store, no output folder
    assert time.monotonic() - began < 60  # the command's own imports; Ray's retries took minutes


@pytest.mark.slow
def test_ray_address_auto_joins_a_head_on_loopback(warm_up, tmp_path):
    """`backend.ray_address=auto` with RAY_ADDRESS naming a head on 127.0.0.1 (as runner.md's
    elastic command is typed): the runner joins that head. Ray's own `auto` dialled the machine's
    network address instead, where nothing listens, without end."""
    _, state, _ = warm_up
    env = {"RAY_ADDRESS": record(state).ray_address, "RAY_AUTH_MODE": "token"}  # the token: Ray's file, as `up` made it
    done = orchestrate("backend=runner", "trainer.num_workers=2", "backend.ray_address=auto", "trainer.max_steps=20",
                       "trainer.display_loss_steps=10", "trainer.progress=true", cwd=tmp_path, state=state, env=env,
                       timeout=180, merged=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "start              warm: joined the Ray cluster it was given" in done.stdout, done.stdout[-2000:]
    # The run's summary is the last thing printed, the workers' lines before it.
    assert not [line for line in after(done.stdout, "backend runner:") if "pid=" in line], done.stdout[-3000:]


@pytest.mark.slow
def test_a_head_of_another_ray_version_is_refused_by_name(warm_up):
    """In a process of its own, as a user's command is: Ray reads RAY_AUTH_MODE when it is
    imported, so in the suite's process the check's token depended on which test imported Ray
    first (alone, this test was refused the token instead)."""
    _, state, _ = warm_up
    code = ("import ray; ray.__version__ = '2.0.0'\n"  # a client of another Ray version
            "from orchestrate.cluster import ray_cluster\n"
            "try:\n"
            f"    ray_cluster.check_access({record(state).ray_address!r}, 'backend.ray_address')\n"
            "except ray_cluster.RayUnavailable as e:\n"
            "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAY_AUTH_MODE": "token"},
                          capture_output=True, text=True, timeout=120)
    refused = done.stdout.strip()
    assert refused.startswith(f"backend.ray_address={record(state).ray_address}: the cluster runs Ray 2.60.0 "
                              "on Python 3.11"), done.stdout + done.stderr[-2000:]
    assert "this process Ray 2.0.0" in refused


# ---- two users on one machine -------------------------------------------------------------------

UNPRIVILEGED = "nobody"


@pytest.fixture
def other_user():
    """Run commands as another, unprivileged user (`nobody`), with a home and a work folder of its
    own: (run(*words) -> CompletedProcess, the work folder, the state folder). It may read (not
    write) what only root may read: this interpreter lives under root's home (pyenv), which nobody
    else may enter; that one capability (CAP_DAC_READ_SEARCH) is all it keeps."""
    import pwd
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.fail("this test starts a second user's processes (setpriv): run it as root, as CI does", pytrace=False)
    user = pwd.getpwnam(UNPRIVILEGED)
    home = Path(tempfile.mkdtemp(prefix="orchestrate-user-", dir="/tmp"))
    (home / "work").mkdir()
    (home / "state").mkdir(mode=0o700)
    for path in (home, home / "work", home / "state"):
        os.chown(path, user.pw_uid, user.pw_gid)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ORCHESTRATE_STATE_DIR": str(home / "state"), "LANG": "C.UTF-8"}
    as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]

    def run(*words: str, timeout: int = 240) -> subprocess.CompletedProcess:
        return subprocess.run([*as_user, sys.executable, "-m", "orchestrate", *words], cwd=home / "work", env=env,
                              capture_output=True, text=True, timeout=timeout)

    yield run, home / "work", home / "state"
    run("down")
    shutil.rmtree(home, ignore_errors=True)


def group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return False
    except ProcessLookupError:
        return True


@pytest.mark.slow
def test_a_second_user_gets_a_warm_stack_of_its_own_beside_others(warm_up, other_user):
    """A shared machine: this user's warm stack (the session's) and a plain `ray start` head of this
    user's holding Ray's fixed ports (its client server on 10001) run; an unprivileged user's `up`
    takes free ports of its own and stays up (its head died a second after `up` said so, Ray's
    client server refused the port the other user's head held), its sweep runs warm, a stack whose
    head died is stopped whole by the next `up`, and `down` leaves none of its processes."""
    from tests.helpers import loopback_cluster

    run, work, state = other_user
    with loopback_cluster(nodes=1):
        up = run("up", "--num-cpus", "1", "--workers", "1")
        assert up.returncode == 0, up.stdout + up.stderr
        time.sleep(3)  # the old failure: up, then the head gone a second later
        assert run("up", "--status").returncode == 0
        first = record(state)
        assert os.stat(state / "stack.json").st_uid != 0
        swept = run("+sweep=lr_grid", "backend=torch", "trainer.max_steps=20", "trainer.progress=false")
        assert swept.returncode == 0, swept.stderr[-3000:]
        assert "start: warm: joined the Ray head and the MLflow server that `orchestrate up` keeps running" in swept.stdout
        # Its head dies (killed): the next `up` stops what is left of that stack before it starts another.
        os.killpg(first.ray_pid, signal.SIGKILL)
        again = run("up", "--num-cpus", "1", "--workers", "1")
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"the warm stack recorded before ({first.ray_address}) no longer answered: stopped what was left of it" \
            in again.stderr
        assert all(group_gone(pid) for pid in (first.ray_pid, first.server_pid, first.pool_pid))
        second = record(state)
        assert run("down").returncode == 0
        assert all(group_gone(pid) for pid in (second.ray_pid, second.server_pid, second.pool_pid))
    assert record(warm_up[1]).ray_answers()  # this user's stack is still up


@pytest.mark.slow
def test_down_stops_every_process_of_the_stack(warm_up):
    folder, state, _ = warm_up
    up = record(state)
    done = orchestrate("down", cwd=folder, state=state)
    assert done.returncode == 0 and done.stdout.startswith(f"stopped: Ray {up.ray_version} at {up.ray_address}")
    for pid in (up.ray_pid, up.server_pid, up.pool_pid):
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # the whole process group: the head's GCS, raylet and workers; the pool's forks
    assert not (state / "stack.json").exists() and not Path(up.ray_temp_dir).exists()
    assert not Path(up.pool_socket).parent.exists()
    status = orchestrate("up", "--status", cwd=folder, state=state)
    assert (status.returncode, status.stdout.strip()) == (1, "cold: no warm stack is up (`orchestrate up` starts one)")
