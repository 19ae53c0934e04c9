"""The warm local stack (`orchestrate up` / `down`: orchestrate.commands.up): Ray's and MLflow's
own answer to start-up costs (start a cluster once, run one server), made the fast path on one
machine: its record, whether it still answers, its head and server started and stopped.

Without it every sweep starts an MLflow server and a local Ray, and every runner command a local
Ray, then stops them again: seconds of start-up per command. With it the same commands, typed the
same way, find the stack by themselves:
- Ray: a command with no address of its own (no `backend.ray_address` or `hydra.launcher.address`,
  no RAY_ADDRESS) joins the head recorded here instead of starting a local instance;
- MLflow: a sweep whose SQLite store the server fronts writes through it instead of starting a
  server of its own (single runs write to the file directly, as before).
The entry reads the record once (`runtime`: orchestrate.cluster.runtime's value, handed down);
each command's summary says which way it ran (`warm` or `cold`).

The record is `stack.json` in the user's state folder ($ORCHESTRATE_STATE_DIR, else
$XDG_STATE_HOME/orchestrate, else ~/.local/state/orchestrate; private to the user). A record
whose head or server no longer answers is noticed with a socket connect (well under a second) and
ignored with one line, never waited on. Both listen on 127.0.0.1 only; Ray's token
authentication is on, its token file (Ray's default, ~/.ray/auth_token) readable by the user only;
the head keeps its files in a temp folder of its own, so a user's own `ray start` (Ray's /tmp/ray
and the address file there) and this head never meet, and `orchestrate down` stops this head's
processes only (`ray stop` would stop every Ray on the machine).

This module imports nothing else of orchestrate but `ports`, `errors` and `pool` (the warm pool's
client, which imports nothing of orchestrate): `ray_cluster` (which the Hydra launcher plugin uses
alone) asks it for the head.
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrate import errors
from orchestrate.cluster import pool
from orchestrate.cluster.ports import answers

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120  # the head's `ray start`, the server's /health (a new store: its migrations)
STOP_TIMEOUT_S = 30  # each process, after SIGTERM (then SIGKILL)
ANSWER_TIMEOUT_S = 0.5  # a recorded head or server that does not accept a connection by then is gone
# What Ray's processes read from the environment they start in; the head's processes are the
# workers' parents, so a warm head needs what a local instance started by a command gets.
HEAD_ENVIRONMENT = {
    "RAY_AUTH_MODE": "token",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every port on 127.0.0.1 (orchestrate.cluster.ray_cluster)
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # `down` need not wait for Ray Train's detached actors
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",  # as orchestrate.backends.runner.driver.ray_environment
}


def state_dir() -> Path:
    if os.environ.get("ORCHESTRATE_STATE_DIR"):
        return Path(os.environ["ORCHESTRATE_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "orchestrate"


def record_path() -> Path:
    return state_dir() / "stack.json"


@dataclass
class Stack:
    """What `orchestrate up` started: the Ray head (its `ray start --block` process, which stops
    the node's processes when it ends) and the MLflow server, each by process id."""

    ray_address: str  # 127.0.0.1:PORT, the head's GCS
    ray_pid: int
    ray_temp_dir: str
    ray_version: str
    num_cpus: int
    store: str  # sqlite:////abs/path/mlflow.db, the store the server fronts
    server_uri: str  # http://127.0.0.1:PORT
    server_pid: int
    artifacts: str
    pool_socket: str = ""  # the warm pool's Unix socket (orchestrate.cluster.pool); "" without one
    pool_pid: int = 0  # its supervisor, which leads the pool's process group
    pool_workers: int = 0  # commands at once

    def ray_answers(self) -> bool:
        return _answers(self.ray_address) and pool.alive(self.ray_pid)

    def server_answers(self) -> bool:
        return _answers(self.server_uri.removeprefix("http://")) and pool.alive(self.server_pid)

    def pool_answers(self) -> bool:
        sock = pool.connect(self.pool_socket) if self.pool_socket else None
        if sock is not None:
            sock.close()
        return sock is not None

    def describe(self) -> str:
        workers = f", {self.pool_workers} warm worker(s)" if self.pool_socket else ""
        return (f"Ray {self.ray_version} at {self.ray_address} ({self.num_cpus} CPUs, token auth{workers}) and the "
                f"MLflow server {self.server_uri} in front of {self.store}")


def _answers(hostport: str) -> bool:
    host, _, port = hostport.rpartition(":")
    return port.isdigit() and answers(host, int(port), ANSWER_TIMEOUT_S)


def recorded() -> Stack | None:
    """The stack's record as `up` wrote it, whether or not it still answers."""
    try:
        return Stack(**json.loads(record_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


# Module state: stale records already reported by this process (one line each per process, not
# per call); it changes nothing a run does.
_SAID: set[str] = set()


def found() -> Stack | None:
    """The stack `orchestrate up` left running, if its head answers; a record whose head is gone
    is reported once (one warning line) and ignored."""
    stack = recorded()
    if stack is None:
        return None
    if stack.ray_answers():
        return stack
    path = str(record_path())
    if path not in _SAID:
        _SAID.add(path)
        log.warning(f"the warm stack recorded in {path} is gone (nothing answers at {stack.ray_address}); "
                    "ignoring it: this command starts what it needs itself (`orchestrate up` starts the stack again)")
    return None


def runtime():
    """The runtime of a command starting now (orchestrate.cluster.runtime), for the entry to hand
    down: the stack `orchestrate up` left running, as far as it answers now (its head, its pool,
    its MLflow server: a line for a server that does not), and whether this process is a fork of
    its pool; cold where there is no stack. Whether the server answers is only noted: a sweep
    that would use it says so (Runtime.server_for), not every command."""
    from orchestrate.cluster.runtime import Runtime

    early = os.environ.get("ORCHESTRATE_EARLY_START") != "0"
    stack = found()
    if stack is None:
        return Runtime(forked=pool.forked(), early_start=early)
    return Runtime(head=stack.ray_address, head_cpus=stack.num_cpus,
                   worker_python=pool.worker_python(stack.pool_socket) if stack.pool_answers() else None,
                   server_uri=stack.server_uri, server_store=stack.store, server_artifacts=stack.artifacts,
                   server_answers=stack.server_answers(), forked=pool.forked(), early_start=early)


def dispatch(argv: list[str]) -> int | None:
    """`python -m orchestrate ARGS` on the warm stack: the command runs as a fork of the warm pool,
    this process standing in for it; its exit code, or None to run here (no pool, ORCHESTRATE_WARM=0,
    already a fork, or the pool cannot take it: a line says why)."""
    if os.environ.get("ORCHESTRATE_WARM") == "0" or pool.forked():
        return None
    stack = recorded()
    if stack is None or not stack.pool_socket:
        return None
    sock = pool.connect(stack.pool_socket)
    if sock is None:
        why = ("is starting again (its process ended)" if pool.alive(stack.pool_pid) else
               "is gone (`orchestrate down` then `orchestrate up` starts it again)")
        print(f"the warm pool of {record_path()} {why}: this command runs in its own process", file=sys.stderr,
              flush=True)
        return None
    return pool.dispatch(pool.Request("command", ["-m", "orchestrate"], argv, wait_s=pool.wait_s_of(argv)), sock)


# ---- up and down ---------------------------------------------------------------------------------

TOKEN = Path.home() / ".ray" / "auth_token"  # Ray's default token file (Ray's token-auth guide)


def _private_token() -> None:
    """Ray's default token file, made if missing (Ray's own CLI, which prints the token: kept
    off the console), readable by the user only. A token given by RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH is the user's to keep."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if not TOKEN.exists():
        made = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                              capture_output=True, text=True, umask=0o077, timeout=START_TIMEOUT_S)
        if made.returncode != 0 or not TOKEN.exists():
            raise errors.Failed(f"`ray get-auth-token --generate` made no token in {TOKEN} (exit code "
                               f"{made.returncode})")
    TOKEN.chmod(0o600)


# The servers of a Ray head whose ports Ray fixes unless told (`ray start --help`: the client server
# 10001, the dashboard's agent 52365, ...): each gets a free port of its own, so that a second
# user's head (or the user's own `ray start`) holding Ray's default takes nothing from this one. Ray
# binds its client server with SO_REUSEPORT, which lets one user's two heads share a port and
# refuses another user's: that head then stopped a second after it said it had started.
HEAD_PORT_FLAGS = ("--port", "--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                   "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port", "--object-manager-port")
SETTLE_S = 1.0  # a head that said it started and still answers after this long has all its servers up


def _start_head(num_cpus: int, folder: Path) -> tuple[subprocess.Popen, str, str]:
    from orchestrate.cluster.ports import free_port

    ports = {flag: free_port() for flag in HEAD_PORT_FLAGS}
    temp_dir = tempfile.mkdtemp(prefix="orchestrate-ray-", dir="/tmp")  # short: Ray's socket paths are limited
    env = {**os.environ, **HEAD_ENVIRONMENT}
    with open(folder / "ray-head.log", "w") as head_log:  # the head writes it; this process need not hold it
        proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
             *(f"{flag}={port}" for flag, port in ports.items()),
             "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={temp_dir}"],
            env=env, stdout=head_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # its own process group: Ctrl-C in this terminal later does not reach it
    address = f"127.0.0.1:{ports['--port']}"
    try:
        _wait_for_head(proc, folder / "ray-head.log", [address, f"127.0.0.1:{ports['--ray-client-server-port']}"])
    except BaseException:
        _stop_pid(proc.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return proc, address, temp_dir


def _wait_for_head(proc: subprocess.Popen, head_log: Path, servers: list[str]) -> None:
    """Until the head said it started, its GCS and client server answer, and it still runs
    SETTLE_S later (`ray start --block` stops the whole head when one of its processes exits)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    settled = None
    while settled is None or time.monotonic() < settled:
        if proc.poll() is not None:
            raise errors.Failed(f"`ray start --head` exited with code {proc.returncode}; its output: {head_log}")
        if time.monotonic() > deadline:
            raise errors.Failed(f"the Ray head did not start within {START_TIMEOUT_S} s (waited for its GCS and client "
                                f"server at {', '.join(servers)}); its output: {head_log}")
        if settled is None and "Ray runtime started" in head_log.read_text(errors="replace") and \
                all(_answers(server) for server in servers):
            settled = time.monotonic() + SETTLE_S
        time.sleep(0.2)


def _start_pool(workers: int, folder: Path, preload: dict) -> tuple[subprocess.Popen, str]:
    """The warm pool's supervisor (orchestrate.cluster.pool), in a session of its own, its socket in
    a private temp folder (a Unix socket's path is limited to 107 bytes)."""
    socket_dir = tempfile.mkdtemp(prefix="orchestrate-pool-", dir="/tmp")  # 0700
    path = os.path.join(socket_dir, "pool.sock")
    with open(folder / "pool.log", "w") as pool_log:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrate.cluster.pool_process", "supervise", path, str(workers),
                                 json.dumps(preload)],
                                cwd=folder, stdout=pool_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc, path


def _wait_for_pool(proc: subprocess.Popen, path: str, folder: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while pool.status(path, timeout_s=1.0) is None:
        if proc.poll() is not None:
            raise errors.Failed(f"the warm pool exited with code {proc.returncode}; its output: {folder / 'pool.log'}")
        if time.monotonic() > deadline:
            raise errors.Failed(f"the warm pool did not answer within {START_TIMEOUT_S} s; its output: "
                                f"{folder / 'pool.log'}")
        time.sleep(0.2)


def up(num_cpus: int | None, store: str, workers: int | None = None, preload: dict | None = None) -> Stack:
    """Start the stack, record it, and return it (`main` first looks for one that is up).
    `workers`: the warm pool's commands at once (default: the head's CPUs; 0: no pool); `preload`:
    what the pool imports before its first fork (orchestrate.commands.up.warm_imports)."""
    import ray

    from orchestrate.cluster.mlflow_server import MlflowServer
    from orchestrate.tracking.stores import absolute_uri, new_sqlite_store, write_ahead

    store = absolute_uri(store)
    if not store.startswith("sqlite:///"):
        raise errors.Refused(f"--store={store}: allowed: a SQLite store (sqlite:///PATH); a team's server on "
                         "PostgreSQL is `orchestrate server`")
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.chmod(0o700)
    _private_token()
    num_cpus = num_cpus or os.cpu_count() or 1
    workers = num_cpus if workers is None else workers
    # The pool imports while the head and the server start.
    supervisor, pool_socket = _start_pool(workers, folder, preload or {}) if workers else (None, "")
    started, temp_dir = [supervisor.pid] if supervisor else [], None
    try:  # up only once everything answers; whatever did start is stopped again otherwise
        proc, address, temp_dir = _start_head(num_cpus, folder)
        started.append(proc.pid)
        new_sqlite_store(store)
        write_ahead(store)
        with open(folder / "mlflow-server.log", "w") as server_log:
            artifacts = Path(store.removeprefix("sqlite:///")).parent / "mlartifacts"
            server = MlflowServer(store, artifacts.resolve(), log=server_log, detached=True, outlive=True)
        started.append(server.proc.pid)
        if supervisor:
            _wait_for_pool(supervisor, pool_socket, folder)
        stack = Stack(ray_address=address, ray_pid=proc.pid, ray_temp_dir=temp_dir, ray_version=ray.__version__,
                      num_cpus=num_cpus, store=store, server_uri=server.uri, server_pid=server.proc.pid,
                      artifacts=str(server.artifacts), pool_socket=pool_socket,
                      pool_pid=supervisor.pid if supervisor else 0, pool_workers=workers)
        gone = [what for what, answers in (("the Ray head", stack.ray_answers()),
                                           ("the MLflow server", stack.server_answers()),
                                           ("the warm pool", not pool_socket or stack.pool_answers())) if not answers]
        if gone:
            raise errors.Failed(f"{' and '.join(gone)} stopped right after starting; their output: {folder}/*.log")
    except BaseException:
        _stop_pid(*started)
        if pool_socket:
            shutil.rmtree(os.path.dirname(pool_socket), ignore_errors=True)
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    written = record_path().with_suffix(".tmp")
    written.write_text(json.dumps(asdict(stack), indent=1))
    written.chmod(0o600)
    written.replace(record_path())  # whole or not at all
    return stack


def _stop_pid(*pids: int) -> None:
    """SIGTERM to the process groups the `pids` lead (each was started in a session of its own),
    together, then SIGKILL to what is left of them after STOP_TIMEOUT_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in pids if _group_alive(pid)]
        for pid in alive:
            os.killpg(pid, sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_group_alive(pid) for pid in alive) and time.monotonic() < deadline:
            time.sleep(0.1)


def _group_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):  # this process's own child (a failed `up`): reaped, not a zombie
        os.waitpid(pid, os.WNOHANG)
    try:
        os.killpg(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def down() -> Stack | None:
    """Stop the recorded stack (first the pool: its runs end KILLED while the server still takes
    that; then the server and the head together) and remove its record: every process group the
    record names, whether or not its head still answers."""
    stack = recorded()
    if stack is None:
        return None
    if stack.pool_pid:
        _stop_pid(stack.pool_pid)
        shutil.rmtree(os.path.dirname(stack.pool_socket), ignore_errors=True)
    _stop_pid(stack.server_pid, stack.ray_pid)
    shutil.rmtree(stack.ray_temp_dir, ignore_errors=True)
    record_path().unlink(missing_ok=True)
    return stack
