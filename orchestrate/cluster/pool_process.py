"""The warm pool's own processes (orchestrate.cluster.pool says what the pool is and holds its
client): the pool, which imports what a run needs and forks for each program dispatched to it; what a
fork does before it runs the program (`become`) and after (`leave`); and the supervisor that starts
the pool again when it ends. Run as `python -m orchestrate.cluster.pool_process supervise|serve
SOCKET WORKERS [GENERATION] PRELOAD` (PRELOAD: JSON, what `up` tells it to import), by `up` and
the supervisor, not typed.
"""

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from orchestrate.cluster import pool

READ_TIMEOUT_S = 2.0  # the pool's wait for a connected client's request
KILL_GRACE_S = 10.0  # a fork whose client went away: SIGTERM (its run ends KILLED), then SIGKILL after this
WARM_UP_TIMEOUT_S = 300.0  # the one-step run the pool learns its imports from
MAX_QUICK_RESTARTS = 3  # the supervisor gives up when the pool ends this often within QUICK_S
QUICK_S = 60.0
# Read once, when a library is imported (or by the dynamic loader): a fork of a pool started under
# other values would not behave as a fresh process does, so such a request runs cold. The thread
# counts (OMP_NUM_THREADS, MKL_NUM_THREADS; Ray sets them per worker) are not here: the fork sets
# torch's thread count from them, as a fresh process starts with.
IMPORT_TIME = ("PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONWARNINGS",
               "PYTHONDEVMODE", "PYTHONMALLOC",
               "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_",
               "PYTORCH_", "KMP_", "GOMP_", "OPENBLAS_", "MKL_CBWR", "MPLBACKEND", "CUDA_MODULE_LOADING")
NOT_IMPORTED = ("ray", "__main__")  # Ray reads its settings when imported: each fork imports it as set up
# Where Python looks for modules (sys.path) is set when it starts (PYTHONPATH, made absolute against
# the folder it starts in, and the IMPORT_TIME variables above): a fork keeps the pool's, and a
# request whose PYTHONPATH names other folders runs cold. The pool runs as `python -c` (SERVE), whose
# first entry ("") is the folder the process is in when it imports: a fork's is the client's (it
# changes to it), as a `python -m` program's is.
SERVE = "import sys; from orchestrate.cluster import pool_process; raise SystemExit(pool_process.main(sys.argv[1:]))"


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
    request: dict
    fds: list[int]
    until: float


class Pool:
    """The pool's process: `serve` returns only in a fork, with what the fork is to run."""

    def __init__(self, socket_path: str, workers: int, generation: int = 0, preload: dict | None = None) -> None:
        self.path, self.workers, self.generation = socket_path, workers, generation
        # What `up` told it to import (orchestrate.commands.up.warm_imports): {"modules": [...],
        # "learn": [module, *argv] of a one-step run whose imports it takes too}.
        self.preload = preload or {"modules": [], "learn": []}
        self.running: dict[int, Fork] = {}
        self.waiting: deque[Waiting] = deque()
        self.served = {"command": 0, "worker": 0}
        self.started = time.time()
        self.stopping = self.restart = False
        self.env, self.cwd = dict(os.environ), os.getcwd()
        self.stamp = ""
        self.cuda = False

    def serve(self) -> dict:
        import selectors

        self.warm_up()
        self.stamp = pool.code_stamp()
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
                    request = self._accept(listener)
                    if request is not None:
                        return request  # this is a fork
                elif key.data == "wake":
                    _drain(wake_r)
                    self._reap()
                else:
                    self._client_event(key.fileobj)
            request = self._tick()
            if request is not None:
                return request
        raise SystemExit(pool.RESTART if self.restart and not self.stopping else 0)

    def _stop(self, *_) -> None:
        """SIGTERM: take nothing more, and end once the forks have. `down` signals the pool's whole
        process group, so each command's fork has its own SIGTERM (its run ends KILLED); Ray's
        workers lead groups of their own and get it from here (else the pool would wait for them,
        and they for the head `down` stops after the pool)."""
        self.stopping = True
        for fork in self.running.values():
            if fork.kind == "worker":
                pool.send_signal(fork.pid, signal.SIGTERM)

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
            request, fds = pool.receive(conn, 3)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            return None
        if request.get("kind") == "status":
            _reply(conn, self.state())
            conn.close()
            return None
        why = self.refuses(request)
        if why:
            _reply(conn, {"cold": why})
            _close(conn, fds)
            return None
        if request["kind"] == "command" and self._busy() >= self.workers:
            self.waiting.append(Waiting(conn, request, fds, time.monotonic() + request["wait_s"]))
            _reply(conn, {"wait": self._wait_line(request)})
            self.selector.register(conn, 1, "client")
            return None
        return self._fork(conn, request, fds)

    def _busy(self) -> int:
        return sum(f.kind == "command" for f in self.running.values())

    def _wait_line(self, request: dict) -> str:
        busy = ", ".join(f"pid {f.pid}: {f.what}" for f in self.running.values() if f.kind == "command")
        return (f"waiting for a warm worker: all {self.workers} are running commands ({busy}); this command starts "
                f"when one is free, or gives up after {request['wait_s']:g} s (`orchestrate up --workers N` keeps more)")

    def refuses(self, request: dict) -> str | None:
        """Why this request must run in a process of its own (a line), or None."""
        if self.stopping:
            return "the warm pool is stopping (`orchestrate down`): this command runs in its own process"
        if self.cuda:
            return ("the warm pool's imports started CUDA, which a fork cannot use: this command runs in its own "
                    "process (the pool's log names what it imported)")
        if request.get("prefix") != sys.prefix:
            return (f"the warm pool runs the Python of {sys.prefix}, this command {request.get('prefix')}: it runs in its "
                    "own process")
        if request.get("stamp") != self.stamp:
            self.restart = True
            return ("orchestrate's code changed since the warm pool imported it: this command runs in its own "
                    "process, and the pool starts again with the new code")
        if import_path(request["env"], request["cwd"]) != import_path(self.env, self.cwd):
            return (f"PYTHONPATH={request['env'].get('PYTHONPATH', '(unset)')}: where Python looks for modules, set "
                    f"when it starts, and the warm pool started with {self.env.get('PYTHONPATH', '(unset)')} in "
                    f"{self.cwd}: this command runs in its own process")
        for key in sorted({*request["env"], *self.env}):
            if key.startswith(IMPORT_TIME) and request["env"].get(key) != self.env.get(key):
                return (f"{key}={request['env'].get(key, '(unset)')}: read when libraries are imported, and the warm "
                        f"pool imported them with {self.env.get(key, '(unset)')}: this command runs in its own process")
        return None

    def _fork(self, conn: socket.socket, request: dict, fds: list[int]) -> dict | None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_fork(conn, fds)
            if request["kind"] == "worker":
                # A process group of its own, as Ray starts a worker in: the raylet ends a worker's
                # group with it (its per-worker cleanup), and the pool's group is not the worker's.
                os.setpgid(0, 0)
            return request
        for fd in fds:
            os.close(fd)
        self.served[request["kind"]] += 1
        what = " ".join(request["program"][-1:] + request["argv"])[:200] if request["kind"] == "command" else \
            "a Ray worker"
        self.running[pid] = Fork(pid, conn, request["kind"], what)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.selector.unregister(conn)
        self.selector.register(conn, 1, "client")
        _reply(conn, {"pid": pid})
        return None

    def _become_fork(self, conn: socket.socket, fds: list[int]) -> None:
        pool.mark_forked()
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
                pool.send_signal(fork.pid, signal.SIGTERM)  # its run ends KILLED, as a stopped command's does
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
                pool.send_signal(fork.pid, signal.SIGKILL)
                fork.kill_at = now + KILL_GRACE_S
        for waiting in [w for w in self.waiting if now >= w.until]:
            self.waiting.remove(waiting)
            self.selector.unregister(waiting.conn)
            _reply(waiting.conn, {"timeout": f"error: no warm worker was free within {waiting.request['wait_s']:g} s "
                                             f"(all {self.workers} ran commands): `orchestrate up --workers N` keeps "
                                             "more, ORCHESTRATE_WARM=0 runs a command in its own process"})
            _close(waiting.conn, waiting.fds)
        if self.waiting and self._busy() < self.workers and not (self.stopping or self.restart):
            waiting = self.waiting.popleft()
            return self._fork(waiting.conn, waiting.request, waiting.fds)
        return None

    def state(self) -> dict:
        return {"pid": os.getpid(), "started": self.started, "generation": self.generation, "workers": self.workers,
                "served": self.served, "waiting": len(self.waiting),
                "running": [{"pid": f.pid, "kind": f.kind, "what": f.what, "since": f.since}
                            for f in self.running.values()]}

    def warm_up(self) -> None:
        """Import what `up` named (`preload`), then what a one-step run imported besides (learned
        in a fork that runs one, on a store of its own, deleted after). The pool names no module
        of the program it serves: it is below it."""
        import importlib

        began = time.perf_counter()
        for name in self.preload["modules"]:
            _import(importlib, name)
        learned = [name for name in _learn_imports(self.preload["learn"])
                   if not name.startswith(NOT_IMPORTED) and name not in sys.modules]
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


def _learn_imports(learn: list[str]) -> list[str]:
    """The modules a one-step run imports (`learn`: the module to run as __main__ and its
    arguments, `{folder}` in them the run's temporary folder), from a fork that runs one there."""
    import tempfile

    if not learn:
        return []
    folder = tempfile.mkdtemp(prefix="orchestrate-warm-up-")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the run's output goes to the pool's log
        os.close(read)
        os.chdir(folder)
        os.environ.update(ORCHESTRATE_STATE_DIR=folder, ORCHESTRATE_WARM="0")
        module, *argv = [word.replace("{folder}", folder) for word in learn]
        sys.argv = [module, *argv]
        try:
            import runpy

            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except BaseException:  # noqa: BLE001 - whatever it imported before it stopped still counts
            pass
        os.write(write, json.dumps(sorted(sys.modules)).encode())
        sys.stdout.flush()
        os._exit(0)
    os.close(write)
    chunks, deadline = [], time.monotonic() + WARM_UP_TIMEOUT_S
    import select

    while select.select([read], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    else:  # past its time: the pool goes on with what it imported itself
        print(f"the warm-up run did not end within {WARM_UP_TIMEOUT_S:g} s: stopped", flush=True)
        pool.send_signal(pid, signal.SIGKILL)
        chunks = []
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

def become(request: dict, pool_env: dict) -> None:
    """In the fork: take the client's streams, folder, environment and arguments as a fresh
    process would have them, then run the program as __main__ (its SystemExit is this process's)."""
    import runpy

    _fresh_streams(request["env"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _thread_count(request["env"], pool_env)
    program = request["program"]  # sys.path as the pool's: its first entry, "", is now the client's folder (SERVE)
    if program[0] == "-m":
        sys.argv = [program[1], *request["argv"]]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [program[0], *request["argv"]]
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


def import_path(env: dict, cwd: str) -> list[str]:
    """The folders PYTHONPATH names, absolute, as Python puts them on sys.path when it starts in `cwd`."""
    return [os.path.normpath(os.path.join(cwd, p)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


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

def supervise(socket_path: str, workers: int, preload: str) -> int:
    """Start the pool's process, and again when it ends, until SIGTERM (`orchestrate down`) or
    until it ends MAX_QUICK_RESTARTS times within QUICK_S (then commands run cold)."""
    import subprocess

    stopping: list[int] = []
    child: list[subprocess.Popen] = []

    def stop(signum, frame) -> None:
        stopping.append(signum)
        for proc in child:
            pool.send_signal(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    quick: deque[float] = deque(maxlen=MAX_QUICK_RESTARTS)
    generation = 0
    while not stopping:
        began = time.monotonic()
        child[:] = [subprocess.Popen([sys.executable, "-c", SERVE, "serve", socket_path, str(workers), str(generation),
                                      preload], stdin=subprocess.DEVNULL)]
        code = child[0].wait()
        if stopping:
            break
        said = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        print(f"the pool's process {child[0].pid} ended ({said}); starting another", flush=True)
        generation += 1
        if code != pool.RESTART:
            quick.append(began)
            if len(quick) == MAX_QUICK_RESTARTS and time.monotonic() - quick[0] < QUICK_S:
                print(f"it ended {MAX_QUICK_RESTARTS} times within {QUICK_S:g} s: the pool stays down (commands run "
                      "cold); `orchestrate down` then `orchestrate up` starts it again", flush=True)
                return 1
    return 0


def main(argv: list[str]) -> int:
    what, rest = argv[0], argv[1:]
    if what == "supervise":
        return supervise(rest[0], int(rest[1]), rest[2])
    server = Pool(rest[0], int(rest[1]), int(rest[2]), json.loads(rest[3]))
    request = server.serve()  # returns only in a fork
    code = 0
    try:
        become(request, server.env)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else _said(e.code))
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    leave(code)
    return code


if __name__ == "__main__":
    # The module as imported, not this __main__ copy of it (what a fork's program imports is the same).
    from orchestrate.cluster import pool_process

    raise SystemExit(pool_process.main(sys.argv[1:]))
