"""The warm pool of `orchestrate up`: one process that has imported what a run needs (torch, ORT
where installed, MLflow, Hydra, orchestrate's backends: what a one-step run imports, learned by
running one at its start) and forks a copy of itself for every program handed to it:
- each command typed on the warm stack (`python -m orchestrate ...`: orchestrate.__main__ hands it
  over, `hand_over`), and
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
the pool starts again once idle), and the variables read at import (IMPORT_TIME).

Three processes (`up` starts them, `down` stops their process group):
- the supervisor (`supervise`): starts the pool's process, and again when it ends (kill -9, a
  crash, orchestrate's code changed);
- the pool (`Pool.serve`): answers on a Unix socket in the user's state folder (0700), to the user
  who started it only (the peer's uid, from the kernel: SO_PEERCRED), and forks; at most `workers`
  commands run at once (more wait, with a line saying so, up to their placement timeout); Ray's
  workers are Ray's to count;
- the client (`hand_over`; `python -m orchestrate.cluster.pool worker SOCKET PROGRAM ARGS` for Ray).

Imports nothing heavy: the client side runs in every command before it knows it will train.
"""

import contextlib
import json
import os
import shlex
import signal
import socket
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

RESTART = 75  # the pool's exit code when its code changed on disk: the supervisor starts it again at once
CONNECT_TIMEOUT_S = 0.5  # a recorded pool that does not accept by then is not there
REPLY_TIMEOUT_S = 10.0  # the pool's answer to a request (it forks in milliseconds; it may be busy starting one)
READ_TIMEOUT_S = 2.0  # the pool's wait for a connected client's request
KILL_GRACE_S = 10.0  # a fork whose client went away: SIGTERM (its run ends KILLED), then SIGKILL after this
DEFAULT_WAIT_S = 60.0  # a command's wait for a free worker: the placement timeouts' default
WARM_UP_TIMEOUT_S = 300.0  # the one-step run the pool learns its imports from
MAX_QUICK_RESTARTS = 3  # the supervisor gives up when the pool ends this often within QUICK_S
QUICK_S = 60.0
# Read once, when a library is imported (or by the dynamic loader): a fork of a pool started under
# other values would not behave as a fresh process does, so such a request runs cold. The thread
# counts (OMP_NUM_THREADS, MKL_NUM_THREADS; Ray sets them per worker) are not here: the fork sets
# torch's thread count from them, as a fresh process starts with.
IMPORT_TIME = ("PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONMALLOC",
               "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_",
               "PYTORCH_", "KMP_", "GOMP_", "OPENBLAS_", "MKL_CBWR", "MPLBACKEND", "CUDA_MODULE_LOADING")
# Imported at the pool's start beside what the warm-up run teaches it: every backend's module.
BASE_IMPORTS = ("torch", "numpy", "mlflow", "hydra", "omegaconf", "orchestrate.cli", "orchestrate.app")
NOT_IMPORTED = ("ray", "__main__")  # Ray reads its settings when imported: each fork imports it as set up


# ---- the client ----------------------------------------------------------------------------------

@dataclass
class Handed:
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
    """Whether this process is a fork of the pool (a command already handed over)."""
    return _FORKED


# Module state: set once in a fork of the pool, before the program it runs starts, and true for the
# rest of that process's life (it is that fork); never set in the pool or a client.
_FORKED = False


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
    """The pool's replies to a handed program, one JSON object per line, until it closes."""
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


def hand_over(handed: Handed, socket_path: str) -> int | None:
    """Run `handed` as a fork of the pool at `socket_path`, this process standing in for it (its
    signals forwarded); its exit code, or None when the pool cannot take it (a line says why):
    the caller runs it itself."""
    sock = connect(socket_path)
    if sock is None:
        return None
    handed.stamp = handed.stamp or code_stamp()
    forward = _Forward()
    try:
        with sock:
            sock.settimeout(REPLY_TIMEOUT_S)
            send(sock, handed.__dict__, [0, 1, 2])
            sock.settimeout(None)  # from here on the pool answers when the fork ends: the run's own time
            for reply in replies(sock):
                if "cold" in reply:
                    print(reply["cold"], file=sys.stderr, flush=True)
                    return None
                if "wait" in reply or "timeout" in reply:
                    print(reply.get("wait") or reply["timeout"], file=sys.stderr, flush=True)
                    if "timeout" in reply:
                        return 1
                elif "pid" in reply:
                    forward.to(reply["pid"])
                elif "exit" in reply:
                    return forward.exit_code(reply["exit"], handed.kind)
    except OSError:
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
            _send_signal(self.pid, signum)

    def to(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            _send_signal(pid, signum)

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
        """The pool went away without saying how the fork ended: wait for the fork itself."""
        if self.pid is None:
            return None
        print(f"the warm pool's process ended while it ran this command; waiting for the run (pid {self.pid}) to "
              "end: its exit code is lost with the pool", file=sys.stderr, flush=True)
        while _alive(self.pid):
            time.sleep(0.2)
        return 1


def _send_signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    try:  # a zombie is gone for this purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
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


# ---- the pool ------------------------------------------------------------------------------------

@dataclass
class Fork:
    pid: int
    conn: socket.socket
    kind: str
    what: str
    since: float = field(default_factory=time.time)
    kill_at: float | None = None  # its client went away: SIGKILL then


@dataclass
class Waiting:
    conn: socket.socket
    handed: dict
    fds: list[int]
    until: float


class Pool:
    """The pool's process: `serve` returns only in a fork, with what the fork is to run."""

    def __init__(self, socket_path: str, workers: int, generation: int = 0) -> None:
        self.path, self.workers, self.generation = socket_path, workers, generation
        self.running: dict[int, Fork] = {}
        self.waiting: deque[Waiting] = deque()
        self.served = {"command": 0, "worker": 0}
        self.started = time.time()
        self.stopping = self.restart = False
        self.env = dict(os.environ)
        self.stamp = ""
        self.cuda = False

    def serve(self) -> dict:
        import selectors

        self.warm_up()
        self.stamp = code_stamp()
        with contextlib.suppress(OSError, KeyError, ValueError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        before = os.umask(0o077)
        listener.bind(self.path)
        os.umask(before)
        listener.listen(64)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd says a fork ended
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own session: no terminal's Ctrl-C reaches it
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        self.own_fds = [listener.fileno(), wake_r, wake_w, self.selector.fileno()]
        print(f"ready: pid {os.getpid()} on {self.path}, {self.workers} command(s) at once", flush=True)
        while not (self.stopping or self.restart) or self.running:
            for key, _ in self.selector.select(self._next_timeout()):
                if key.data == "accept":
                    handed = self._accept(listener)
                    if handed is not None:
                        return handed  # this is a fork
                elif key.data == "wake":
                    _drain(wake_r)
                    self._reap()
                else:
                    self._client_event(key.fileobj)
            handed = self._tick()
            if handed is not None:
                return handed
        raise SystemExit(RESTART if self.restart and not self.stopping else 0)

    def _stop(self, *_) -> None:
        """SIGTERM: take nothing more, and end once the forks have. `down` signals the pool's whole
        process group, so each command's fork has its own SIGTERM (its run ends KILLED); Ray's
        workers lead groups of their own and get it from here (else the pool would wait for them,
        and they for the head `down` stops after the pool)."""
        self.stopping = True
        for fork in self.running.values():
            if fork.kind == "worker":
                _send_signal(fork.pid, signal.SIGTERM)

    def _next_timeout(self) -> float | None:
        times = [w.until for w in self.waiting] + [f.kill_at for f in self.running.values() if f.kill_at]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _accept(self, listener: socket.socket) -> dict | None:
        conn, _ = listener.accept()
        conn.settimeout(READ_TIMEOUT_S)
        try:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
            if uid != os.getuid():
                _reply(conn, {"cold": f"the warm pool of user {os.getuid()} runs nothing for user {uid}"})
                conn.close()
                return None
            handed, fds = receive(conn, 3)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            return None
        if handed.get("kind") == "status":
            _reply(conn, self.state())
            conn.close()
            return None
        why = self.refuses(handed)
        if why:
            _reply(conn, {"cold": why})
            _close(conn, fds)
            return None
        if handed["kind"] == "command" and self._busy() >= self.workers:
            self.waiting.append(Waiting(conn, handed, fds, time.monotonic() + handed["wait_s"]))
            _reply(conn, {"wait": self._wait_line(handed)})
            self.selector.register(conn, 1, "client")
            return None
        return self._fork(conn, handed, fds)

    def _busy(self) -> int:
        return sum(f.kind == "command" for f in self.running.values())

    def _wait_line(self, handed: dict) -> str:
        busy = ", ".join(f"pid {f.pid}: {f.what}" for f in self.running.values() if f.kind == "command")
        return (f"waiting for a warm worker: all {self.workers} are running commands ({busy}); this command starts "
                f"when one is free, or gives up after {handed['wait_s']:g} s (`orchestrate up --workers N` keeps more)")

    def refuses(self, handed: dict) -> str | None:
        """Why this request must run in a process of its own (a line), or None."""
        if self.stopping:
            return "the warm pool is stopping (`orchestrate down`): this command runs in its own process"
        if self.cuda:
            return ("the warm pool's imports started CUDA, which a fork cannot use: this command runs in its own "
                    "process (the pool's log names what it imported)")
        if handed.get("prefix") != sys.prefix:
            return (f"the warm pool runs the Python of {sys.prefix}, this command {handed.get('prefix')}: it runs in its "
                    "own process")
        if handed.get("stamp") != self.stamp:
            self.restart = True
            return ("orchestrate's code changed since the warm pool imported it: this command runs in its own "
                    "process, and the pool starts again with the new code")
        for key in sorted({*handed["env"], *self.env}):
            if key.startswith(IMPORT_TIME) and handed["env"].get(key) != self.env.get(key):
                return (f"{key}={handed['env'].get(key, '(unset)')}: read when libraries are imported, and the warm "
                        f"pool imported them with {self.env.get(key, '(unset)')}: this command runs in its own process")
        return None

    def _fork(self, conn: socket.socket, handed: dict, fds: list[int]) -> dict | None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_fork(conn, fds)
            if handed["kind"] == "worker":
                # A process group of its own, as Ray starts a worker in: the raylet ends a worker's
                # group with it (its per-worker cleanup), and the pool's group is not the worker's.
                os.setpgid(0, 0)
            return handed
        for fd in fds:
            os.close(fd)
        self.served[handed["kind"]] += 1
        what = " ".join(handed["program"][-1:] + handed["argv"])[:200] if handed["kind"] == "command" else \
            "a Ray worker"
        self.running[pid] = Fork(pid, conn, handed["kind"], what)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.selector.unregister(conn)
        self.selector.register(conn, 1, "client")
        _reply(conn, {"pid": pid})
        return None

    def _become_fork(self, conn: socket.socket, fds: list[int]) -> None:
        global _FORKED
        _FORKED = True
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        for fd in self.own_fds:
            with contextlib.suppress(OSError, KeyError, ValueError):
                os.close(fd)
        for fork in self.running.values():
            fork.conn.close()
        for waiting in self.waiting:
            _close(waiting.conn, waiting.fds)
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)

    def _client_event(self, conn: socket.socket) -> None:
        """A client's connection became readable: it went away (a client sends nothing more)."""
        for waiting in list(self.waiting):
            if waiting.conn is conn:
                self.waiting.remove(waiting)
                self.selector.unregister(conn)
                _close(conn, waiting.fds)
                return
        for fork in self.running.values():
            if fork.conn is conn and fork.kill_at is None:
                self.selector.unregister(conn)
                _send_signal(fork.pid, signal.SIGTERM)  # its run ends KILLED, as a stopped command's does
                fork.kill_at = time.monotonic() + KILL_GRACE_S
                return

    def _reap(self) -> None:
        while self.running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fork = self.running.pop(pid, None)
            if fork is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.selector.unregister(fork.conn)
            _reply(fork.conn, {"exit": code})
            fork.conn.close()

    def _tick(self) -> dict | None:
        """Kill forks whose grace ran out, give up on waits past their time, start a waiting command."""
        now = time.monotonic()
        for fork in self.running.values():
            if fork.kill_at is not None and now >= fork.kill_at:
                _send_signal(fork.pid, signal.SIGKILL)
                fork.kill_at = now + KILL_GRACE_S
        for waiting in [w for w in self.waiting if now >= w.until]:
            self.waiting.remove(waiting)
            self.selector.unregister(waiting.conn)
            _reply(waiting.conn, {"timeout": f"error: no warm worker was free within {waiting.handed['wait_s']:g} s "
                                             f"(all {self.workers} ran commands): `orchestrate up --workers N` keeps "
                                             "more, ORCHESTRATE_WARM=0 runs a command in its own process"})
            _close(waiting.conn, waiting.fds)
        if self.waiting and self._busy() < self.workers and not (self.stopping or self.restart):
            waiting = self.waiting.popleft()
            self.selector.unregister(waiting.conn)
            waiting.conn.settimeout(None)
            return self._fork(waiting.conn, waiting.handed, waiting.fds)
        return None

    def state(self) -> dict:
        return {"pid": os.getpid(), "started": self.started, "generation": self.generation, "workers": self.workers,
                "served": self.served, "waiting": len(self.waiting),
                "running": [{"pid": f.pid, "kind": f.kind, "what": f.what, "since": f.since}
                            for f in self.running.values()]}

    def warm_up(self) -> None:
        """Import BASE_IMPORTS and every backend, then what a one-step run imported besides
        (learned in a fork that runs one, on a store of its own, deleted after)."""
        import importlib
        import pkgutil

        began = time.perf_counter()
        backends = importlib.import_module("orchestrate.backends")  # by name: the pool is below the app it runs
        for name in [*BASE_IMPORTS, *(f"orchestrate.backends.{m.name}" for m in pkgutil.iter_modules(backends.__path__))]:
            _import(importlib, name)
        learned = [name for name in _learn_imports() if not name.startswith(NOT_IMPORTED) and name not in sys.modules]
        missing = [name for name in learned if not _import(importlib, name)]
        # CUDA cannot be used again in a fork of a process that started it: a library that did so on
        # import makes every request run cold (`refuses`), with the line saying why.
        self.cuda = bool(sys.modules.get("torch") and sys.modules["torch"].cuda.is_initialized())
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
        print(f"imported {len(sys.modules)} modules in {time.perf_counter() - began:.1f} s, {len(learned)} of them "
              f"learned from a one-step run ({len(missing)} not importable alone: {', '.join(missing[:5])}); "
              f"{threads} thread(s) of the C libraries", flush=True)


def _import(importlib, name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - an optional library (ORT on a base install): a fork imports what it needs
        return False


def _learn_imports() -> list[str]:
    """The modules a one-step run (backend=torch) imports, from a fork that runs one in a
    temporary folder with a store of its own."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="orchestrate-warm-up-")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the run's output goes to the pool's log
        os.close(read)
        os.chdir(folder)
        os.environ.update(ORCHESTRATE_STATE_DIR=folder, ORCHESTRATE_WARM="0")
        sys.argv = ["orchestrate", "backend=torch", "trainer.max_steps=1", "trainer.progress=false",
                    "trainer.checkpoint_period=0", f"tracking.uri=sqlite:///{folder}/mlflow.db"]
        try:
            import runpy

            runpy.run_module("orchestrate", run_name="__main__", alter_sys=True)
        except BaseException:  # noqa: BLE001 - whatever it imported before it stopped still counts
            pass
        os.write(write, json.dumps(sorted(sys.modules)).encode())
        sys.stdout.flush()
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    try:
        return json.loads(b"".join(chunks) or b"[]")
    except ValueError:
        return []


def _reply(conn: socket.socket, message: dict) -> None:
    try:
        conn.settimeout(READ_TIMEOUT_S)
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass


def _close(conn: socket.socket, fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError, KeyError, ValueError):
            os.close(fd)
    conn.close()


def _drain(fd: int) -> None:
    os.set_blocking(fd, False)
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


# ---- the fork ------------------------------------------------------------------------------------

def become(handed: dict, pool_env: dict) -> None:
    """In the fork: take the client's streams, folder, environment and arguments as a fresh
    process would have them, then run the program as __main__ (its SystemExit is this process's)."""
    import runpy

    _fresh_streams(handed["env"])
    os.chdir(handed["cwd"])
    os.environ.clear()
    os.environ.update(handed["env"])
    _thread_count(handed["env"], pool_env)
    program = handed["program"]
    first = handed["cwd"] if program[0] == "-m" else os.path.dirname(os.path.abspath(program[0]))
    own = [p for p in pool_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    wanted = [os.path.abspath(p) for p in handed["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *wanted, *(p for p in sys.path[1:] if p not in own and p not in wanted)]
    if program[0] == "-m":
        sys.argv = [program[1], *handed["argv"]]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [program[0], *handed["argv"]]
        runpy.run_path(program[0], run_name="__main__")


def _said(message) -> int:
    print(message, file=sys.stderr)  # SystemExit("text"): the interpreter prints it, exit code 1
    return 1


def leave(code: int) -> None:
    """End the fork as the interpreter ends a program (threads, atexit, streams), without freeing
    the modules it inherited (orchestrate.thirdparty.exit_work)."""
    from orchestrate.thirdparty import exit_work

    try:
        exit_work()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing more can be said on it
                pass
        os._exit(code)


def _fresh_streams(env: dict) -> None:
    """sys.stdin/stdout/stderr on descriptors 0-2 (now the client's), buffered as a new
    interpreter buffers them (line by line on a terminal; PYTHONUNBUFFERED)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = env.get("PYTHONIOENCODING", "").split(":")[0] or None
    streams = []
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        tty = os.isatty(fd)
        lines = mode == "w" and (tty or fd == 2) and not unbuffered
        stream = open(fd, mode, buffering=1 if lines else -1, closefd=False,
                      encoding=encoding or sys.getfilesystemencoding(), errors="backslashreplace" if fd == 2 else None)
        if unbuffered and mode == "w":
            stream.reconfigure(write_through=True)
        streams.append(stream)
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def _thread_count(env: dict, pool_env: dict) -> None:
    """torch's threads as a fresh process would start with them (OpenMP read OMP_NUM_THREADS when
    the pool imported torch)."""
    wanted = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    had = pool_env.get("OMP_NUM_THREADS") or pool_env.get("MKL_NUM_THREADS")
    if wanted == had or "torch" not in sys.modules:
        return
    import torch

    try:
        torch.set_num_threads(int(wanted) if wanted else os.cpu_count() or 1)
    except ValueError:
        pass


# ---- the supervisor ------------------------------------------------------------------------------

def supervise(socket_path: str, workers: int) -> int:
    """Start the pool's process, and again when it ends, until SIGTERM (`orchestrate down`) or
    until it ends MAX_QUICK_RESTARTS times within QUICK_S (then commands run cold)."""
    import subprocess

    stopping: list[int] = []
    child: list[subprocess.Popen] = []

    def stop(signum, frame) -> None:
        stopping.append(signum)
        for proc in child:
            _send_signal(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    quick: deque[float] = deque(maxlen=MAX_QUICK_RESTARTS)
    generation = 0
    while not stopping:
        began = time.monotonic()
        child[:] = [subprocess.Popen([sys.executable, "-m", "orchestrate.cluster.pool", "serve", socket_path,
                                      str(workers), str(generation)], stdin=subprocess.DEVNULL)]
        code = child[0].wait()
        if stopping:
            break
        said = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        print(f"the pool's process {child[0].pid} ended ({said}); starting another", flush=True)
        generation += 1
        if code != RESTART:
            quick.append(began)
            if len(quick) == MAX_QUICK_RESTARTS and time.monotonic() - quick[0] < QUICK_S:
                print(f"it ended {MAX_QUICK_RESTARTS} times within {QUICK_S:g} s: the pool stays down (commands run "
                      "cold); `orchestrate down` then `orchestrate up` starts it again", flush=True)
                return 1
    return 0


def main(argv: list[str]) -> int:
    """`python -m orchestrate.cluster.pool supervise|serve|worker ...`: the pool's processes and Ray's
    workers' Python (started by `up` and by Ray, not typed)."""
    what, rest = argv[0], argv[1:]
    if what == "supervise":
        return supervise(rest[0], int(rest[1]))
    if what == "serve":
        pool = Pool(rest[0], int(rest[1]), int(rest[2]))
        handed = pool.serve()  # returns only in a fork
        code = 0
        try:
            become(handed, pool.env)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else _said(e.code))
        except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        leave(code)
        return code
    if what == "worker":  # Ray's worker: a fork when the pool takes it, else this process becomes it
        program, args = rest[1], rest[2:]
        code = hand_over(Handed("worker", [program], args), rest[0])
        if code is None:
            os.execv(sys.executable, [sys.executable, program, *args])
        return code
    raise SystemExit(f"unknown: {what}")


if __name__ == "__main__":
    # The module as imported, not this __main__ copy of it: a fork's `forked()` is asked of it.
    from orchestrate.cluster import pool

    raise SystemExit(pool.main(sys.argv[1:]))
