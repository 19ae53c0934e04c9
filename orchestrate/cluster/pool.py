"""The warm pool of `orchestrate up`: one process that has imported what a run needs (torch, ORT
where installed, MLflow, Hydra, orchestrate's backends: what a one-step run imports, learned by
running one at its start) and forks a copy of itself for every program dispatched to it:
- each command typed on the warm stack (`python -m orchestrate ...`: orchestrate.__main__
  dispatches it, `dispatch`), and
- each worker process Ray starts on the warm head (the Ray launcher's trials, the runner's
  data-parallel workers, Ray Train's own actors): a job that joins the head names this module as
  its workers' Python (Ray's `py_executable`, `worker_python`), so Ray starts them as it always
  does, and each is a fork.
What costs seconds in a new process (importing) is paid once, at `up`; a fork takes milliseconds.

Why a fork per program, not one process reused: every run starts from the same imported and
untouched process, so nothing a run changes (threads, the environment, RNG, torch.onnx's
registrations, Inductor's in-memory caches, Hydra's and MLflow's globals) reaches the next one,
its losses are those of a fresh process, and a run that dies (kill -9) takes only its own fork.
The pool never trains, composes or opens anything itself: no thread pool of torch's, no Ray, no
MLflow client in it (a fork of a process whose OpenMP pool or gRPC channels were used can hang).

The fork is the program, not a helper of the client: it gets the client's argv, folder,
environment and stdin/stdout/stderr (passed over the socket: SCM_RIGHTS), so it prints to the
terminal itself (progress bar, colours) and Ray's log files get a worker's output as before. The
client forwards Ctrl-C, SIGTERM and SIGHUP to it and exits as it exited. Whatever the pool imported
at its start that a fresh process would set up differently is checked per request: the Python
(sys.prefix), orchestrate's code on disk (changed since: the command runs cold with one line, and
the pool starts again once idle), the variables read at import (IMPORT_TIME) and the folders
PYTHONPATH names (sys.path is the pool's: a fork never edits it).

Three processes (`up` starts them, `down` stops their process group):
- the supervisor: starts the pool's process, and again when it ends (kill -9, a crash,
  orchestrate's code changed);
- the pool: answers on a Unix socket in a private folder (0700), to the user who started it only
  (the peer's uid, from the kernel: SO_PEERCRED), and forks; at most `workers` commands run at
  once (more wait, with a line saying so, up to their placement timeout); Ray's workers are Ray's
  to count. Both are orchestrate.cluster.pool_process;
- the client, here (`dispatch`; `python -m orchestrate.cluster.pool worker SOCKET PROGRAM ARGS`
  for Ray).

Imports nothing heavy: the client side runs in every command before it knows it will train.
"""

import json
import os
import shlex
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RESTART = 75  # the pool's exit code when its code changed on disk: the supervisor starts it again at once
CONNECT_TIMEOUT_S = 0.5  # a recorded pool that does not accept by then is not there
REPLY_TIMEOUT_S = 10.0  # the pool's answer to a request (it forks in milliseconds; it may be busy starting one)
DEFAULT_WAIT_S = 60.0  # a command's wait for a free worker: the placement timeouts' default


# ---- the client ----------------------------------------------------------------------------------

@dataclass
class Request:
    """What the client sends: one program to run as a fork."""

    kind: str  # "command" (counted against the pool's workers) or "worker" (Ray's)
    program: list[str]  # ["-m", "orchestrate"] or [script]
    argv: list[str]  # the program's arguments
    wait_s: float = DEFAULT_WAIT_S
    cwd: str = field(default_factory=os.getcwd)
    env: dict = field(default_factory=lambda: dict(os.environ))
    prefix: str = sys.prefix
    stamp: str = ""


def forked() -> bool:
    """Whether this process is a fork of the pool (a command dispatched to it)."""
    return _FORKED


# Module state: set once in a fork of the pool, before the program it runs starts, and true for the
# rest of that process's life (it is that fork); never set in the pool or a client.
_FORKED = False


def mark_forked() -> None:
    """Said by a fork of the pool, before the program it runs starts (orchestrate.cluster.pool_process)."""
    global _FORKED
    _FORKED = True


def connect(path: str, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], list(fds))


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """One message (and the descriptors sent with it)."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    if len(data) < 4:
        raise ConnectionError("the peer closed the connection")
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise ConnectionError("the peer closed the connection")
        data += more
    return json.loads(data), list(fds)


def replies(sock: socket.socket):
    """The pool's replies to a dispatched program, one JSON object per line, until it closes."""
    with sock.makefile("r", encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)


def code_stamp() -> str:
    """orchestrate's code and configs as they are on disk (paths, sizes, modification times):
    the pool compares it with its own, taken when it imported them."""
    import hashlib

    package = Path(__file__).resolve().parents[1]
    roots = [package, *sorted((package.parent / "hydra_plugins").glob("orchestrate_*"))]
    digest = hashlib.sha1()
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".yaml")):
                    path = os.path.join(folder, name)
                    st = os.stat(path)
                    digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def wait_s_of(argv: list[str]) -> float:
    """How long a command waits for a free worker: its placement timeout, as it was typed."""
    for word in reversed(argv):
        key, _, value = word.partition("=")
        if key.lstrip("+") in ("backend.placement_timeout_s", "hydra.launcher.placement_timeout_s"):
            try:
                return float(value)
            except ValueError:
                break  # the check says what is wrong with it
    return DEFAULT_WAIT_S


def dispatch(request: Request, sock: socket.socket) -> int | None:
    """Run `request` as a fork of the pool connected on `sock` (`connect`), this process standing in
    for it (its signals forwarded); its exit code, or None when the pool cannot take it (a line says
    why): the caller runs it itself."""
    request.stamp = request.stamp or code_stamp()
    forward = _Forward()
    try:
        with sock:
            sock.settimeout(REPLY_TIMEOUT_S)
            send(sock, request.__dict__, [0, 1, 2])
            sock.settimeout(None)  # from here on the pool answers when the fork ends: the run's own time
            for reply in replies(sock):
                said = reply.get("cold") or reply.get("wait") or reply.get("timeout")
                if said:
                    print(said, file=sys.stderr, flush=True)
                if "cold" in reply:
                    return None
                if "timeout" in reply:
                    return 1
                if "pid" in reply:
                    forward.to(reply["pid"])
                if "exit" in reply:
                    return forward.exit_code(reply["exit"], request.kind)
    except (OSError, ValueError):  # the pool went away mid-answer
        pass
    finally:
        forward.restore()
    return forward.orphaned()


class _Forward:
    """Ctrl-C, SIGTERM and SIGHUP, received by the client, sent on to the fork (one that comes
    before the fork's pid is known is sent when it is)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        self.before = {s: signal.signal(s, self._received) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def _received(self, signum, frame) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            send_signal(self.pid, signum)

    def to(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            send_signal(pid, signum)

    def restore(self) -> None:
        for signum, handler in self.before.items():
            signal.signal(signum, handler)

    def exit_code(self, status: int, kind: str) -> int:
        """The fork's exit status as this process's: a fork killed by a signal is said in one line
        (a command's) and this process ends by the same signal (as Ray, or a shell, would see it)."""
        if status >= 0:
            return status
        name = signal.Signals(-status).name
        if kind == "command":
            print(f"the run's process (pid {self.pid}, a fork of the warm pool) was killed by {name}; the pool "
                  "is unharmed and the next command runs warm (`trainer.resume=auto` continues this run from its "
                  "last checkpoint)", file=sys.stderr, flush=True)
        self.restore()
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status  # a signal this process survives (its default is to ignore it)

    def orphaned(self) -> int | None:
        """The pool went away without saying how the fork ended: wait for the fork itself (none
        started: the caller runs the command, and a line says why)."""
        if self.pid is None:
            print("the warm pool's process ended before it took this command: this command runs in its own process",
                  file=sys.stderr, flush=True)
            return None
        print(f"the warm pool's process ended while it ran this command; waiting for the run (pid {self.pid}) to "
              "end: its exit code is lost with the pool", file=sys.stderr, flush=True)
        while alive(self.pid):
            time.sleep(0.2)
        return 1


def send_signal(pid: int, signum: int) -> None:
    """`os.kill`, for a process that may have ended meanwhile."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """Whether `pid` is a live process of this user's (a zombie, or another user's process that
    took the number, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return state != "Z" and os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except (OSError, IndexError):
        return False


def worker_python(socket_path: str) -> str:
    """Ray's `py_executable` for the warm head's workers: this module's client, which hands the
    worker's program (Ray's default_worker.py and its arguments) to the pool, or runs it itself."""
    return f"{shlex.quote(sys.executable)} -m orchestrate.cluster.pool worker {shlex.quote(socket_path)}"


def status(socket_path: str, timeout_s: float = REPLY_TIMEOUT_S) -> dict | None:
    """The pool's own account: its pid, workers, running forks, what it served; None if it does not answer."""
    sock = connect(socket_path, timeout_s)
    if sock is None:
        return None
    with sock:
        try:
            send(sock, {"kind": "status"})
            return next(replies(sock), None)
        except (OSError, ValueError):
            return None


def describe(state: dict) -> list[str]:
    """`orchestrate up --status`'s lines on the pool."""
    running = state["running"]
    lines = [f"warm pool: pid {state['pid']} (started {time.time() - state['started']:.0f} s ago"
             f"{', restarted ' + str(state['generation']) + ' time(s)' if state['generation'] else ''}), "
             f"{state['workers']} command(s) at once; served {state['served'].get('command', 0)} command(s) and "
             f"{state['served'].get('worker', 0)} Ray worker(s)"]
    for fork in running:
        lines.append(f"  running: pid {fork['pid']} ({fork['kind']}, {time.time() - fork['since']:.0f} s) "
                     f"{fork['what']}")
    if state.get("waiting"):
        lines.append(f"  waiting for a worker: {state['waiting']} command(s)")
    return lines


def main(argv: list[str]) -> int:
    """`python -m orchestrate.cluster.pool worker SOCKET PROGRAM ARGS`: Ray's workers' Python on the
    warm head (Ray starts it; not typed): a fork of the pool when it takes the worker, else this
    process becomes the worker itself."""
    if argv[:1] != ["worker"] or len(argv) < 3:
        raise SystemExit("usage: python -m orchestrate.cluster.pool worker SOCKET PROGRAM [ARGS]")
    program, args = argv[2], argv[3:]
    sock = connect(argv[1])
    code = dispatch(Request("worker", [program], args), sock) if sock is not None else None
    if code is None:
        os.execv(sys.executable, [sys.executable, program, *args])
    return code


if __name__ == "__main__":
    # The module as imported, not this __main__ copy of it: a fork's `forked()` is asked of it.
    from orchestrate.cluster import pool

    raise SystemExit(pool.main(sys.argv[1:]))
