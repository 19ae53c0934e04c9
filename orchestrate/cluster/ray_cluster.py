"""Joining Ray, for sweeps and for the runner: a new local instance bound to 127.0.0.1 by default,
or a running cluster; and making sure that resources asked for can be placed on it.

Two Ray behaviours shape `init` (Ray 2.60, measured here):
- with no address, `ray.init()` joins whatever `ray start` last left in /tmp/ray/ray_current_cluster,
  even a cluster that has since gone (it then retries for minutes): no address means "local" here;
- a local Ray swaps 127.0.0.1 for the machine's network address (even when told
  `_node_ip_address="127.0.0.1"`) unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set before `import ray`;
  with it every port Ray opens is bound to 127.0.0.1.
`ray job submit` runs the command with RAY_ADDRESS set: that cluster is joined. With no address at
all, the warm head the runtime names (orchestrate.cluster.runtime: `orchestrate up`'s, handed down
by the entry) is joined before a new local instance is started: the same command, warm.

Three things Ray prints say nothing to act on, and stay off the console: lines its own processes
print that `RAY_NOISE` names (one line each, skipped by Ray's log deduplicator; they stay in those
processes' log files, in the session's /tmp/ray/session_*/logs); output that calls itself harmless
(`HARMLESS`: a warning and the traceback logged with it, a whole batch of one process's lines,
which a per-line skip cannot take: to this driver's log while the runner trains,
`harmless_output_to_log`); and the warning that a new local instance turned token authentication
on (RAY_AUTH_MODE=token is named for it instead: the mode Ray would choose, chosen silently).

This module imports, and only when called, nothing of orchestrate but what imports nothing itself:
the runtime's value (orchestrate.cluster.runtime), a free port (orchestrate.cluster.ports) and set_env
(orchestrate.tracking.settings); the Hydra launcher plugin uses it. Its errors are its own:
`RayUnavailable` (a ValueError: bad input, an address that cannot be reached), `PlacementError`
(a RuntimeError: the cluster cannot hold what was asked for in time) and `HeadLost` (a
RuntimeError: the head stopped answering under a wait, `HeadWatch`).
"""

import contextlib
import importlib
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrate.cluster.runtime import Runtime

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")  # hosts that mean this machine only
EARLY_START_TIMEOUT_S = 120  # longest wait for a start begun by `init_in_background`
# Module state: Ray is process-wide (one `ray.init` per process), and so is what this module knows
# of it: the job id of the local Ray instance `init` started, while it runs; a start begun by
# `init_in_background`, not yet taken by `init`; the address of the warm head (`orchestrate up`)
# `init` joined, while joined; whether `init` started or joined the Ray this process has. `leave`
# (and `cancel_background_init`) clears them.
_LOCAL_SESSION = None
_EARLY: "_EarlyStart | None" = None
_WARM = None
_JOINED = False


class RayUnavailable(ValueError):
    """The Ray cluster at the configured address cannot be reached; the message names the key."""


class HeadLost(RuntimeError):
    """The Ray head this process joined stopped answering while it waited on its cluster (`HeadWatch`)."""


class PlacementError(RuntimeError):
    """Resources asked for could not be placed on the Ray cluster within the time allowed; the
    message says what was asked, what the cluster has in all and what is free."""


def init(address: str | None, key: str, runtime: "Runtime | None" = None, **local_options) -> bool:
    """Start or join Ray unless this process already has (then return False); `key` names the
    config key that gave `address` (for the error when it cannot be reached); with no address,
    the warm head `runtime` names is joined (cold: none). `local_options` (num_cpus, ...) apply to
    a new local instance only. Raises RayUnavailable. A start begun by `init_in_background` is
    waited for and stands for this one (its result is returned)."""
    global _EARLY
    early, _EARLY = _EARLY, None
    if early is not None:
        return early.result()
    return _start(address, key, runtime, **local_options)


def host_of(address: str) -> str:
    """The host of a Ray address (or of a URI): `10.0.0.5:6379`, `ray://head:10001`, `head`."""
    from urllib.parse import urlsplit

    return urlsplit(address if "://" in address else f"ray://{address}").hostname or address


def on_loopback(address: str) -> bool:
    """Whether a Ray address (or a URI) names this machine's loopback: its hosts cannot be others."""
    return host_of(address) in LOOPBACK


def _start(address: str | None, key: str, runtime: "Runtime | None" = None, **local_options) -> bool:
    global _WARM, _JOINED
    address = address or os.environ.get("RAY_ADDRESS")
    if address == "auto":  # resolved here, once: Ray's own `auto` dials the machine's address for a loopback head
        address = resolve_auto(key)
    warm = None
    if address is None and not _initialized() and runtime is not None and runtime.head:
        warm = address = runtime.head
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # the head's mode (its token: Ray's default file)
    local = address is None or on_loopback(address)
    if local:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if address is None and "ray" not in sys.modules:
        # A new local instance turns token authentication on when the mode is not named, and logs
        # a warning saying so on every start (Ray 2.60); named, the same mode starts silently.
        # Ray sets the variable itself when it chooses (the process keeps it either way); set
        # after `import ray` it would disagree with what Ray read at its import.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    _quiet_import()
    import ray

    if ray.is_initialized():
        return False
    if local and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        # Ray reads the variable once, when it is imported: a process that imported ray before
        # this call would otherwise still register the machine's network address.
        from orchestrate.thirdparty import ray_local_only

        ray_local_only()
    if address is not None:
        check_access(address, key)
    options = dict(include_dashboard=False, configure_logging=False, log_to_driver=True)
    try:
        if address is None:
            from orchestrate.cluster.ports import free_port
            from orchestrate.tracking.settings import set_env

            port = free_port()
            before = set_env({"RAY_GCS_SERVER_PORT": str(port)})  # Ray's own variable: the new head's port
            try:
                ray.init(address="local", runtime_env=runtime_env(f"127.0.0.1:{port}", local), **options,
                         **local_options)
            finally:
                set_env(before)
            _WARM = None
            global _LOCAL_SESSION
            _LOCAL_SESSION = ray.get_runtime_context().get_job_id()
        else:
            python = runtime.worker_python if warm is not None else None  # workers: forks of the warm pool
            ray.init(address=address, runtime_env=runtime_env(address, local, python), **options)
            _WARM = warm
    except ConnectionError as e:
        raise RayUnavailable(f"{key}={address}: {str(e).splitlines()[0]}; allowed: null (a new local Ray), "
                             "auto, or the address of a running cluster") from None
    except ValueError as e:  # the working folder shipped to the cluster (runtime_env) is past Ray's size limit
        refused = too_large(e, key, address)
        if refused is None:
            raise
        raise refused from None
    _JOINED = True
    return True


def leave() -> None:
    """Let go of the Ray that `init` started or joined in this process (a local instance ends with
    it), if this process still has it; nothing when Ray was the caller's own. A command ends with
    this: Ray's own exit hook would do the same after sleeping half a second for worker output,
    which a sweep has printed already (orchestrate.launch waits for each trial's last line)."""
    global _JOINED, _WARM, _LOCAL_SESSION
    if not _JOINED:
        return
    _JOINED = False
    if _initialized():
        import ray

        ray.shutdown()
    _WARM = _LOCAL_SESSION = None


def too_large(error: ValueError, key: str, address: str) -> RayUnavailable | None:
    """Ray's refusal of a working folder past its size limit as one line; None for other errors."""
    if not str(error).startswith("Package size"):
        return None
    return RayUnavailable(f"{key}={address}: this folder ({os.getcwd()}) is shipped to the cluster's workers, and Ray "
                          f"refused it ({str(error).split('. ')[0]}): run from your project's folder, or name what to "
                          "leave out in its .gitignore or .rayignore")


# What a command's working folder sends to the cluster's workers leaves out (gitignore patterns,
# beside what the folder's own .gitignore and .rayignore name, which Ray reads itself): virtual
# environments, version control, orchestrate's and MLflow's outputs and stores.
NOT_SHIPPED = (".venv", "venv", ".git", "__pycache__", "outputs", "multirun", "mlruns", "mlartifacts", "mlflow-server",
               "*.db", "*.db-journal", ".mlflow_outbox*", "mlflow_unsent.jsonl", "lightning_logs")


def runtime_env(address: str, local: bool, python: str | None = None) -> dict | None:
    """The job's runtime environment.
    - On the warm head with its pool: `python` (Ray's py_executable), the pool's client, so that
      every worker of the job is a fork of the warm pool (orchestrate.cluster.pool).
    - Wherever it is (but a Ray Client address; `auto` is resolved before this): RAY_ADDRESS set
      in its workers to the cluster they run on. Ray Train's PlacementGroupCleaner (an actor of every run) asks Ray's
      State API about the run's controller with no address; with two Ray instances on the machine
      (a user's own `ray start` beside this one) that lookup finds both, warns "Found multiple
      active Ray instances" every second, and asks the other one, where the controller is
      unknown: the cleaner could then remove the running workers' placement group. (Seen on
      the test hosts too: a host whose processes see another Ray's.)
    - A cluster elsewhere, whose other hosts share no disk with this one: the working folder (the
      user's own modules: the model a `--config-dir` config names) goes to every worker, as `ray
      job submit --working-dir` sends it, without NOT_SHIPPED; not inside a Ray job that was
      submitted with a working folder of its own (the job's is the one)."""
    own = {} if "://" in address else {"env_vars": {"RAY_ADDRESS": address}}
    if python:
        own["py_executable"] = python
    if local:
        return own or None
    submitted = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("runtime_env") or {}
    if submitted.get("working_dir"):
        return None
    return {"working_dir": os.getcwd(), "excludes": list(NOT_SHIPPED), **own}


# Lines Ray relays from its own processes to this driver's console that say nothing to act on;
# they stay in Ray's log files of those processes (worker-*.err in the session's logs folder).
RAY_NOISE = (
    # Ray Train's PlacementGroupCleaner asks Ray's State API every second whether the run's
    # controller still lives; the State API is served by the dashboard, which `init` does not
    # start (include_dashboard=False), so every ask fails and says so: once a second, all run long.
    r"Failed to query Ray Train Controller actor state",
    # Ray Train's controller starts its PreemptionWatcher actor with restarts allowed and its
    # arguments in the object store, and Ray's core says at every start (an error line) that such
    # an actor might fail to restart: about Ray's own code, nothing a user can change.
    r"has constructor arguments in the object store and max_restarts > 0",
)


# What Ray's own code prints on the driver's console that says itself it is harmless, with the
# traceback it logs beside it: Ray Train's autoscaling client under load ("Failed to send resource
# request ... it's safe to ignore this error"), the placement-group cleaner's query of a State API
# that finds several Ray instances on the machine. A batch of output that holds one goes to the log
# file (this module's logger: the run's log), not the console (`harmless_output_to_log`).
HARMLESS = ("it's safe to ignore this error", "Found multiple active Ray instances")


def split_harmless(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the lines to print, the lines kept off the console): a batch of one process's output that
    names itself harmless (HARMLESS) goes whole, its traceback with it."""
    return ([], lines) if any(marker in line for line in lines for marker in HARMLESS) else (lines, [])


@contextlib.contextmanager
def harmless_output_to_log() -> Iterator[None]:
    """While the block runs, the worker output Ray prints on this driver leaves out what
    `split_harmless` takes, which goes to this module's log instead; nothing else changes."""
    from orchestrate.thirdparty import tap_ray_worker_output

    def keep(lines: list[str]) -> None:
        log.info("Ray's output, harmless in its own words (kept off the console):\n%s", "\n".join(lines))

    release = tap_ray_worker_output(split_harmless, keep)
    try:
        yield
    finally:
        if release is not None:
            release()


def _quiet_import() -> None:
    """Import ray with RAY_NOISE left out of the worker output its driver prints: Ray's log
    deduplicator skips lines that match RAY_DEDUP_LOGS_SKIP_REGEX (Ray's "Configuring Logging"
    guide), which it reads once, when it is imported. The variable is put back right after; a
    pattern of the user's is kept beside ours. Not when ray is imported already, or when log
    deduplication is off (RAY_DEDUP_LOGS=0: every line is printed as it comes)."""
    if "ray" in sys.modules:
        return
    before = os.environ.get("RAY_DEDUP_LOGS_SKIP_REGEX")
    os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"] = "|".join([*RAY_NOISE, *([f"(?:{before})"] if before else [])])
    try:
        importlib.import_module("ray")
    finally:
        if before is None:
            os.environ.pop("RAY_DEDUP_LOGS_SKIP_REGEX", None)
        else:
            os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"] = before


class _EarlyStart:
    """`init` on a thread of its own, then `then(stop)` there (e.g. tasks that warm the workers;
    `stop` is set when the start is cancelled, and `then` should return soon after). The thread
    stays for the life of the process: Ray's processes are started with Linux's parent-death
    signal, which fires when the *thread* that started them ends."""

    def __init__(self, address: str | None, key: str, then: Callable[[threading.Event], None] | None,
                 runtime: "Runtime | None", local_options: dict):
        self.ready, self.stop = threading.Event(), threading.Event()
        self.started, self.error = False, None
        self.args = (address, key, then, runtime, local_options)
        threading.Thread(target=self._run, name="ray-early-start", daemon=True).start()

    def _run(self) -> None:
        address, key, then, runtime, local_options = self.args
        # Off the main thread Ray leaves SIGTERM's handler alone (what a run wants) and says so; and
        # a sweep refused meanwhile should print its one line only, not Ray's notes.
        from orchestrate.thirdparty import RAY_EARLY_LOGGERS

        chatty = [logging.getLogger(name) for name in RAY_EARLY_LOGGERS]
        for logger in chatty:
            logger.addFilter(_no_early_notes)
        try:
            self.started = _start(address, key, runtime, **local_options)
            if then is not None and not self.stop.is_set():
                then(self.stop)
        except BaseException as e:  # handed to whoever waits for the start
            self.error = e
        finally:
            for logger in chatty:
                logger.removeFilter(_no_early_notes)
            self.ready.set()
        threading.Event().wait()

    def result(self) -> bool:
        if not self.ready.wait(EARLY_START_TIMEOUT_S):
            raise RayUnavailable(f"Ray did not start within {EARLY_START_TIMEOUT_S} s")
        if self.error is not None:
            raise self.error
        return self.started

    def cancel(self) -> None:
        """Shut down the Ray this start brings up: waits for the start to end (Ray torn down while
        it starts, or a process that exits meanwhile, can crash in Ray's C++ core)."""
        self.stop.set()
        if self.ready.wait(EARLY_START_TIMEOUT_S) and self.started:
            leave()




def _no_early_notes(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not message.startswith(("SIGTERM handler is not set", "Token authentication is enabled"))


def init_in_background(address: str | None, key: str, then: Callable[[threading.Event], None] | None = None,
                       runtime: "Runtime | None" = None, **local_options) -> None:
    """Begin `init(address, key, runtime, **local_options)` now, on another thread, and run `then(stop)`
    once Ray is up; the next `init` call in this process waits for it (`then` included) instead
    of starting Ray again. A sweep starts Ray this way while it checks its trials."""
    global _EARLY
    if _EARLY is None:
        _EARLY = _EarlyStart(address, key, then, runtime, local_options)


def cancel_background_init(wait: bool = True) -> None:
    """A start begun by `init_in_background` and not taken (the sweep was refused): the Ray it
    brings up is shut down once it is up (seconds: Ray's own start). `wait=False`: only if it is
    up already; otherwise it is left to `starting()`'s caller, a process about to exit."""
    global _EARLY
    early = _EARLY
    if early is None:
        return
    if wait or early.ready.is_set():
        _EARLY = None
        early.cancel()
    else:
        early.stop.set()  # no warm-ups: nobody will take this Ray


def starting() -> bool:
    """Whether a start begun by `init_in_background` is still under way and not taken. A process
    that exits now must not finalize Python while Ray's C++ core starts on that thread (it can
    crash): `orchestrate.__main__.run` then leaves with os._exit, and Ray's processes end with
    the thread that started them."""
    return _EARLY is not None and not _EARLY.ready.is_set()


def can_grow() -> bool:
    """False for the local instance `init` started in this process and for the warm head (no
    autoscaler: what they have is all they will ever have); True for a cluster that was joined,
    which may autoscale."""
    import ray

    if not ray.is_initialized():
        return True
    return not (_LOCAL_SESSION == ray.get_runtime_context().get_job_id() or _WARM is not None)


def how() -> str | None:
    """How this process got its Ray: "warm" (joined the head `orchestrate up` left running),
    "cold" (a local instance started for this command), "cluster" (an address it was given);
    None when Ray is not initialized."""
    if not _initialized():
        return None
    import ray

    if _WARM is not None:
        return "warm"
    return "cold" if _LOCAL_SESSION == ray.get_runtime_context().get_job_id() else "cluster"


def _initialized() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def check_listening(address: str, key: str, timeout_s: float = 5.0, shown: str | None = None) -> None:
    """Raise RayUnavailable within `timeout_s` if nothing listens at `address`'s host:port (Ray's
    own connect retries an unreachable address for minutes); its line begins with `shown`, else
    `key=address`. `auto` and addresses without a port are left to Ray."""
    hostport = address.split("://")[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RayUnavailable(f"{shown or f'{key}={address}'}: nothing answers at {host}:{port} ({e.strerror or e}); allowed: "
                             "null (a new local Ray), auto, or the address of a running cluster") from None


HEAD_PROBE_S = 2.0  # how often a wait on the cluster asks whether its head answers (`HeadWatch`)
HEAD_LOST_S = 10.0  # how long the head may not answer before that wait is given up


class HeadWatch:
    """For a wait on Ray's results (a sweep's trials): whether the head of the Ray this process
    joined still answers, asked at most every HEAD_PROBE_S (a connection to its GCS port). Without
    it the wait hangs until Ray's own client gives up on the GCS, 60 s later, and ends the process
    on the spot: no summary, the sweep's runs left RUNNING. `check()` raises HeadLost once the
    head has not answered for HEAD_LOST_S. Through Ray Client (`ray://`) the head's own port may
    not be reachable from here at all: nothing is asked; Ray Client's own reconnection applies."""

    def __init__(self) -> None:
        import ray
        from ray.util.client import ray as client

        self.address = None if client.is_connected() else ray.get_runtime_context().gcs_address
        self.answered = self.next_probe = time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if self.address is None or now < self.next_probe:
            return
        self.next_probe = now + HEAD_PROBE_S
        from orchestrate.cluster.ports import answers

        host, _, port = self.address.rpartition(":")
        if answers(host, int(port), 1.0):
            self.answered = now
        elif now - self.answered >= HEAD_LOST_S:
            raise HeadLost(f"the Ray head at {self.address} has not answered for {now - self.answered:.0f} s "
                           "(killed, or its machine gone)")


def resolve_auto(key: str) -> str:
    """The address `auto` names (RAY_ADDRESS, else the Ray started on this machine last), as
    host:port; RayUnavailable in one line where there is none. Given to `ray.init` resolved: Ray's
    own `auto` swaps a head's 127.0.0.1 for the machine's network address, where nothing listens,
    and retries that without end."""
    _quiet_import()
    from orchestrate.thirdparty import ray_auto_address

    found = ray_auto_address()
    if found is None:
        raise RayUnavailable(f"{key}=auto: no Ray runs on this machine to join (none started with `ray start` or "
                             "`orchestrate up`, and RAY_ADDRESS is unset); allowed: null (a new local Ray), or the "
                             "address of a running cluster")
    return found


def check_access(address: str, key: str, timeout_s: float = 5.0) -> None:
    """Refuse, within about `timeout_s` and before anything opens, a cluster this process cannot
    join: nothing listening (`check_listening`), a token the cluster refuses (or none where it wants
    one), a head of another Ray or Python version. Ray's own `ray.init` finds the last two only
    after its retries (18 s of C++ `InvalidAuthToken` lines on the console for a wrong token).
    One read of the cluster's metadata from its GCS, with this process's token: what `ray.init`
    itself reads first. `auto` is the cluster Ray would find (RAY_ADDRESS, else the Ray started on
    this machine last), checked alike; a Ray Client address (`ray://...`) is left to Ray."""
    if address == "auto":
        found = resolve_auto(key)
        check_listening(found, key, timeout_s, shown=f"{key}=auto (the cluster at {found})")
        hostport = found
    else:
        check_listening(address, key, timeout_s)
        hostport = address.split("://")[-1].rstrip("/")
    if "://" in address or not hostport.rpartition(":")[2].isdigit():
        return
    _quiet_import()
    import ray
    from ray.exceptions import AuthenticationError

    from orchestrate.thirdparty import ray_cluster_metadata

    # With this process's token mode as `ray.init` will have it: for an address it is named
    # (RAY_AUTH_MODE=token), never turned on by a token file on this machine (Ray 2.60's ray.init
    # does that only for a cluster it finds itself; a token mode the cluster does not share gets
    # its Ray Train controller cancelled as it starts).
    allowed = "allowed: null (a new local Ray), auto, or the address of a running cluster"
    try:
        with _cpp_lines_to_log():
            metadata = json.loads(ray_cluster_metadata(hostport, timeout_s).decode())
    except AuthenticationError:
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        raise RayUnavailable(f"{key}={address}: the cluster refused this process's Ray token (RAY_AUTH_MODE={mode}; "
                             "the token comes from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): set "
                             "the cluster's token there; " + allowed) from None
    except Exception as e:  # a GCS that answers the socket but not Ray's protocol in time
        raise RayUnavailable(f"{key}={address}: no Ray answer within {timeout_s:g} s ({type(e).__name__}); "
                             + allowed) from None
    mine = {"ray_version": ray.__version__, "python_version": ".".join(map(str, sys.version_info[:3]))}
    theirs = {k: metadata.get(k) for k in mine}
    if theirs["ray_version"] != mine["ray_version"] or \
            str(theirs["python_version"]).split(".")[:2] != mine["python_version"].split(".")[:2]:
        raise RayUnavailable(f"{key}={address}: the cluster runs Ray {theirs['ray_version']} on Python "
                             f"{theirs['python_version']}, this process Ray {mine['ray_version']} on Python "
                             f"{mine['python_version']}; they must match (this project pins Ray {mine['ray_version']})")


@contextlib.contextmanager
def _cpp_lines_to_log() -> Iterator[None]:
    """What Ray's C++ client writes to this process's stderr meanwhile (a refused token: a
    `gcs_client.cc` warning line) goes to this module's log instead of the console."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines():
                log.info(f"Ray's client: {line}")


def wait_for_placement(bundles: Sequence[Mapping[str, float]], strategy: str, timeout_s: float, asked: str,
                       timeout_key: str) -> None:
    """Wait until Ray could place `bundles` (resource dicts such as {"CPU": 1, "GPU": 1}) together
    with `strategy` (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD), at most `timeout_s` seconds; then
    give the resources back. Ray itself would wait forever for work it cannot place (too few CPUs,
    GPUs asked on a cluster without, a cluster busy with other work), so callers check first.

    Ray must be initialized. Zero amounts are left out and an empty bundle needs no wait. On time
    out raises PlacementError: "{asked} asks for ... and could not be placed within
    {timeout_key}={timeout_s}; the Ray cluster has ... in all, free now ...", so `asked` says which
    setting asked (e.g. "hydra.launcher.cpus_per_trial=4: a trial") and `timeout_key` names the
    setting that gave the timeout (e.g. "hydra.launcher.placement_timeout_s"). A cluster that
    cannot grow (the local instance `init` started: no autoscaler) and could never hold the
    bundles fails at once instead."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    wanted = [{k: v for k, v in bundle.items() if v} for bundle in bundles]
    wanted = [bundle for bundle in wanted if bundle]
    if not wanted:
        return
    # What the cluster has, read before the reservation below takes (and gives back) its share.
    total, free = ray.cluster_resources(), ray.available_resources()
    could_hold = _could_ever_hold(wanted, ray.nodes())
    if not can_grow() and not could_hold:
        timeout_s = 0  # waiting cannot help: say so now
    # Reserving a placement group is how Ray answers "could this be scheduled now?" for any
    # cluster shape (several nodes, custom resources); it is freed at once for the real work.
    group = placement_group(wanted, strategy=strategy)
    try:
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    finally:
        remove_placement_group(group)
    if ready:
        return
    keys = sorted({k for bundle in wanted for k in bundle})
    if len(wanted) == 1:
        what = str(wanted[0])
    elif all(bundle == wanted[0] for bundle in wanted):
        what = f"{len(wanted)} x {wanted[0]} ({strategy})"
    else:
        what = f"{wanted} ({strategy})"
    within = f"within {timeout_key}={timeout_s:g}" if timeout_s else "on this cluster, which cannot grow"
    # A cluster that could hold the work but is busy with other work (another sweep on the warm
    # head, another user's jobs) would take it once that work ends: say so, and how to queue.
    short = any(free.get(k, 0.0) < sum(bundle.get(k, 0.0) for bundle in wanted) for k in keys)
    busy = (f"; its nodes could hold it, and other work holds them now: {timeout_key}=<seconds> waits longer for "
            f"that work to end" if timeout_s and could_hold and short else "")
    raise PlacementError(f"{asked} asks for {what} and could not be placed {within}; "
                         f"the Ray cluster has {({k: total.get(k, 0.0) for k in keys})} in all, "
                         f"free now {({k: free.get(k, 0.0) for k in keys})}{busy}")


def _could_ever_hold(bundles: list[dict], nodes: list[dict]) -> bool:
    """Whether the cluster's alive nodes, all free, could hold the bundles: every bundle fits one
    node and the totals suffice (a necessary check, not a full packing)."""
    capacity = [n["Resources"] for n in nodes if n.get("Alive")]
    fits = all(any(all(node.get(k, 0) >= v for k, v in b.items()) for node in capacity) for b in bundles)
    return fits and all(sum(node.get(k, 0) for node in capacity) >= sum(b.get(k, 0) for b in bundles)
                        for k in {k for b in bundles for k in b})
