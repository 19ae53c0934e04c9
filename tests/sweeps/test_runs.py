"""A sweep's parent run held by the command that runs it (orchestrate.sweeps._runs): a second command
on the same sweep is refused while the first lives, and a command that continues a sweep whose
earlier attempts were killed (SIGKILL of the whole process group, at any moment) closes the runs
they left RUNNING before it opens its own, then runs the study to its end: every trial once, no
run RUNNING. The cluster's Ray head killed under a sweep ends the command in one line within
seconds, and the same command continues the sweep on the head started again."""

import contextlib
import os
import platform
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest

from orchestrate.cluster.ports import free_port
from orchestrate.sweeps import _runs
from orchestrate.tracking.owner import STALE_S, Owner
from tests.conftest import ROOT, sweep_runs
from tests.helpers import RAY_CLI_ON_LOOPBACK, alive_nodes
from tests.sweeps.test_optuna_sweeper import study_of
from tests.sweeps.test_sweeps import QUICK
from tests.test_signals import HeldData


def parent(status: str = "RUNNING", owner: Owner | None = None, beat: float | None = None):
    """A parent run as MlflowClient returns it (the fields refuse_if_running reads)."""
    tags = {_runs.ATTEMPT_KEY: "2"}
    if owner is not None:
        tags[_runs.OWNER_KEY] = owner.tag()
    if beat is not None:
        tags[_runs.BEAT_KEY] = f"{beat:.0f}"
    return SimpleNamespace(info=SimpleNamespace(status=status, run_id="abc"), data=SimpleNamespace(tags=tags))


def test_a_sweep_whose_command_still_runs_is_refused_naming_it():
    me = Owner.this_process()
    with pytest.raises(_runs.SweepRunning, match=rf"this sweep is running already: attempt 2, pid {os.getpid()} on "):
        _runs.refuse_if_running(parent(owner=me), "orchestrate")
    elsewhere, now = Owner("another-host", 4242, time.time() - 100), time.time()
    with pytest.raises(_runs.SweepRunning, match=r"its last heartbeat \d+ s ago.*kill 4242 on another-host"):
        _runs.refuse_if_running(parent(owner=elsewhere, beat=now - 5), "orchestrate")


def test_a_sweep_whose_command_is_gone_goes_on():
    me = Owner.this_process()
    _runs.refuse_if_running(parent(status="FINISHED", owner=me), "orchestrate")  # ended: nothing holds it
    _runs.refuse_if_running(parent(owner=None), "orchestrate")  # opened by a version that kept no owner
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = Owner(platform.node(), int(gone.stdout), me.started)
    _runs.refuse_if_running(parent(owner=dead), "orchestrate")  # its process ended (killed)
    reused = Owner(platform.node(), os.getpid(), me.started - 3600)  # the pid, now another process's
    _runs.refuse_if_running(parent(owner=reused), "orchestrate")
    silent = Owner("another-host", 4242, time.time() - 1000)
    _runs.refuse_if_running(parent(owner=silent, beat=time.time() - STALE_S - 1), "orchestrate")
    _runs.refuse_if_running(parent(owner=silent), "orchestrate")  # no heartbeat at all


# A pruned Optuna sweep on Ray. While the marker file exists every trial holds at its step 30 (the
# data set waits: tests.test_signals.HeldData), so that the kills find trials running, and the
# command beside the third finds it running; the last command runs without it.
def killed_sweep(marker) -> list[str]:
    return ["+sweep=lr_optuna", "backend=torch", *QUICK, "trainer.max_steps=60", "trainer.evaluation_period=20",
            "hydra/sweeper/pruner=successive_halving", "hydra.sweeper.n_trials=6", "hydra.launcher.num_cpus=2",
            "trainer.progress=false", f"data._target_={HeldData.__module__}.HeldData", "+data.hold_at=30",
            f"+data.marker={marker}"]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def start(cwd, words: list[str]) -> subprocess.Popen:
    """The command in a process group of its own (as a terminal's job is), killed whole below."""
    return subprocess.Popen([sys.executable, "-m", "orchestrate", *words], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # Ctrl-C as a terminal's


def wait_until(proc: subprocess.Popen, what: str, test, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        assert proc.poll() is None, f"ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def held(marker) -> bool:
    return marker.with_name(marker.name + ".held").exists()


@pytest.mark.slow
def test_three_kills_then_the_same_command_leave_every_trial_once_and_no_run_running(tmp_path):
    """The case the issue measured: the driver's whole process group killed with SIGKILL three times
    (while it starts, inside its trials, and after a Ctrl-C), then the same command to the end. A
    Ctrl-C between them ends its command within seconds, with its summary last and its running
    trials KILLED; a second command beside the running one is refused in one line naming it.
    Afterwards: exit 0, every trial of the study in the summary once, no run RUNNING, every run a
    killed attempt left closed KILLED by the next, saying so."""
    marker = tmp_path / "hold"
    marker.touch()
    words = killed_sweep(marker)
    first = start(tmp_path, words)  # killed while it starts: its check, Ray, the parent run
    time.sleep(random.Random(55).uniform(1.0, 3.0))
    assert first.poll() is None
    kill_group(first)
    for how in ("SIGKILL", "Ctrl-C", "SIGKILL"):  # each with its trials held (RUNNING)
        marker.with_name("hold.held").unlink(missing_ok=True)
        proc = start(tmp_path, words)
        wait_until(proc, "a trial held", lambda: held(marker))
        if how == "SIGKILL":
            kill_group(proc)
            continue
        began = time.monotonic()
        beside = subprocess.run([sys.executable, "-m", "orchestrate", *words], cwd=tmp_path, env=ENV,
                                capture_output=True, text=True, timeout=120)
        assert beside.returncode == 2 and time.monotonic() - began < 60, beside.stdout[-2000:] + beside.stderr
        line = re.search(rf"^error: this sweep is running already: attempt \d, pid {proc.pid} on .*$", beside.stderr,
                         re.M)
        assert line and "Traceback" not in beside.stderr + beside.stdout, beside.stderr[-2000:]
        time.sleep(1)  # both slots' trials held
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        stopped = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130 and time.monotonic() - stopped < 60, out[-3000:]
        assert "stopped by Ctrl-C" in out and out.rstrip().splitlines()[-1].startswith("then open"), out[-3000:]
    marker.unlink()

    last = subprocess.run([sys.executable, "-m", "orchestrate", *words], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    client, parents, children = sweep_runs(tmp_path)
    (sweep,) = parents
    # 4 or 5: the first command may be killed before it opened the parent run
    assert sweep.info.status == "FINISHED" and sweep.data.tags[_runs.ATTEMPT_KEY] in ("4", "5")
    runs = client.search_runs([sweep.info.experiment_id], max_results=1000)
    assert [r.info.run_id for r in runs if r.info.status == "RUNNING"] == []
    killed = [c.data.tags["error"] for c in children if c.info.status == "KILLED"]
    left = [e for e in killed if re.fullmatch(r"its sweep's attempt [1-4] \(pid \d+ on .*\) ended before the trial "
                                              r"did \(killed\); closed by attempt [2-5]", e)]
    by_ctrl_c = [e for e in killed if e.startswith("interrupted") or e == "stopped before it finished"]  # in the Ctrl-C
    assert len(left) >= 2 and by_ctrl_c and len(left) + len(by_ctrl_c) == len(killed), killed
    study = study_of(tmp_path)
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 6 and not [t for t in study.trials if t.state.name == "RUNNING"]
    assert len({tuple(sorted(t.params.items())) for t in finished}) == 6  # no point finished twice
    # The summary: the study's six trials once each (those this command ran and those it found done).
    rows = [line.split(" | ") for line in last.stdout.splitlines() if re.match(r"\| \d+ \| ", line)]
    assert len(rows) == 6 and all(row[2].startswith(("FINISHED", "PRUNED", "SKIPPED")) for row in rows), \
        last.stdout[-3000:]


def test_the_sweeps_server_killed_is_started_again_on_its_port(tmp_path):
    """A trial holds the server's address: the heartbeat finds it gone (kill -9) and starts another
    in front of the same store on the same port, where the runs logged before are."""
    from mlflow.tracking import MlflowClient

    from orchestrate.sweeps import _server

    store = f"sqlite:///{tmp_path}/mlflow.db"
    sweep = _runs.Sweep.__new__(_runs.Sweep)  # what keep_server reads of a running sweep
    sweep.settings, sweep.host, sweep.restarted = SimpleNamespace(tracking_uri=store), "127.0.0.1", False
    _server.prepare_store(store, "orchestrate")
    sweep.server = _server.TrackingServer(store, tmp_path / "artifacts")
    try:
        client = MlflowClient(tracking_uri=sweep.server.uri)
        run = client.create_run(client.get_experiment_by_name("orchestrate").experiment_id)
        sweep.keep_server()  # it answers: nothing to do
        assert not sweep.restarted
        before = sweep.server
        os.killpg(before.proc.pid, signal.SIGKILL)  # `mlflow server` and its uvicorn (a session of their own)
        before.proc.wait(timeout=30)
        time.sleep(0.5)  # the kernel closes the port's socket
        sweep.keep_server()
        assert sweep.restarted and sweep.server is not before and sweep.server.uri == before.uri
        assert client.get_run(run.info.run_id).info.status == "RUNNING"  # the same store, through the same address
    finally:
        sweep.server.stop()


def start_head(port: int, env: dict) -> subprocess.Popen:
    """A Ray head of 2 CPUs on 127.0.0.1:`port`, its processes in a group of their own (killed whole below)."""
    head = subprocess.Popen([sys.executable, "-c", RAY_CLI_ON_LOOPBACK, "start", "--head", f"--port={port}", "--block",
                             "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
                             f"--temp-dir={tempfile.mkdtemp(prefix='rh', dir='/tmp')}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not alive_nodes(f"127.0.0.1:{port}", env):
        assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start within 120 s"
        time.sleep(1)
    return head


@pytest.mark.slow
@pytest.mark.cluster
def test_a_ray_head_killed_under_a_sweep_ends_it_in_one_line_and_the_same_command_continues(tmp_path):
    """The cluster's head killed (SIGKILL of its processes) while trials are held running: the
    command does not wait for Ray's own 60 s give-up (which ends the process on the spot, the
    sweep's runs left RUNNING): it ends within seconds with one line naming the head and the trials
    it lost, and its summary; started again on the same port, the same command runs the sweep to
    its end with no run RUNNING."""
    port = free_port()
    env = {**ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    marker = tmp_path / "hold"
    marker.touch()
    words = [*(w for w in killed_sweep(marker) if not w.startswith("hydra.launcher.num_cpus")),
             f"hydra.launcher.address=127.0.0.1:{port}"]
    head = start_head(port, env)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrate", *words], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        wait_until(proc, "a trial held", lambda: held(marker))
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and time.monotonic() - killed < 40, err[-3000:]
        (line,) = [e for e in err.splitlines() if e.startswith("error: ")]
        assert re.match(rf"error: the Ray head at 127\.0\.0\.1:{port} has not answered for \d+ s .*: the sweep stops; "
                        r"trial\(s\) #\d", line), line
        assert "sweep summary" in out and out.rstrip().splitlines()[-1].startswith("then open"), out[-2000:]
        marker.unlink()
        head = start_head(port, env)
        last = subprocess.run([sys.executable, "-m", "orchestrate", *words], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)
    client, (sweep,), children = sweep_runs(tmp_path)
    runs = client.search_runs([sweep.info.experiment_id], max_results=1000)
    assert sweep.info.status == "FINISHED" and [r for r in runs if r.info.status == "RUNNING"] == []
    study = study_of(tmp_path)
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 6 and not [t for t in study.trials if t.state.name == "RUNNING"]
