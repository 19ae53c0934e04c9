"""A sweep's slow services, started while the command line checks its trials.

Before a trial's first step, a sweep needs its MLflow server (a process that takes seconds to
answer), a local Ray instance (seconds again) and a Ray worker that has imported the app (torch,
MLflow, Hydra: seconds more). None of them needs the others, nor the up-front check of every
trial, so `start_early` begins them at once: the server's process, and Ray on a thread of its own
that then hands every slot a warm-up task importing the app and building the sweep's data set
(Ray hands the same worker processes the trials that follow, and `job.build_data` keeps the data
set for them); the launcher's `ray_cluster.init` returns once they are done.

Whoever needs a service takes it as if they had started it: the sweep callbacks
(`_runs.Sweep`) take the server of their store (`take_server`), the launcher's `ray_cluster.init`
waits for Ray. A sweep refused by the check stops both again and removes the store the server
was given, if it made it: a refused command leaves nothing behind.
"""

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

RAY_LAUNCHER = "OrchestrateRayLauncher"
WARM_UP_TIMEOUT_S = 60  # the longest the launcher waits for the warm-ups (then it goes on without them)
# Module state: store URI -> its TrackingServer, started beside the check and not taken yet by the
# sweep's callbacks (Hydra builds them: they cannot be handed it); `release` stops any left.
_SERVERS: dict = {}


@contextlib.contextmanager
def start_early(cfg: DictConfig, trials: int, runtime) -> Iterator[None]:
    """Start what the sweep `cfg` (its multirun config, `hydra` node included) of `trials` trials
    will need, while the body runs (the up-front check); if the body raises, stop it all.
    `runtime` (orchestrate.cluster.runtime): the warm stack's server and head, used where they fit."""
    launcher = cfg.hydra.launcher
    made: list[Path] = []
    if not launcher.get("dry_run", False):
        made = _start_server(cfg, runtime)
        if str(launcher.get("_target_", "")).endswith(RAY_LAUNCHER):
            _start_ray(cfg, trials, runtime)
    try:
        yield
    except BaseException:
        from orchestrate.cluster import ray_cluster

        release()
        ray_cluster.cancel_background_init(wait=False)  # a refusal need not wait for Ray's start
        for path in made:
            path.unlink(missing_ok=True)
        raise


def _start_server(cfg: DictConfig, runtime) -> list[Path]:
    """The sweep's own MLflow server, as `_runs.Sweep` would start it: for a SQLite store the
    trials write through (the sweep_tracking callback's settings). Returns the files it created."""
    from orchestrate.tracking.stores import absolute_uri

    tracking = OmegaConf.select(cfg, "hydra.callbacks.sweep_tracking")
    if tracking is None or not str(tracking.get("_target_", "")).endswith(".SweepTracking"):
        return []
    from orchestrate.sweeps._server import TrackingServer, own_server, prepare_store
    from orchestrate.tracking.stores import new_sqlite_store

    uri = absolute_uri(str(tracking.tracking_uri))
    if not own_server(uri, tracking.get("tracking_server", True)) or uri in _SERVERS:
        return []
    from orchestrate.sweeps.slurm import is_slurm

    if is_slurm(cfg):
        return []  # refused by _runs.Sweep with its own message

    from orchestrate.sweeps._server import warm_server
    from orchestrate.sweeps.remote import server_host

    host = server_host(cfg)
    if host == "127.0.0.1" and warm_server(uri, runtime) is not None:
        return []  # the warm stack's server fronts this store (`orchestrate up`): `_runs.Sweep` uses it
    path = Path(uri.removeprefix("sqlite:///"))
    made = [] if path.exists() else [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
    new_sqlite_store(uri)
    prepare_store(uri, str(tracking.experiment), served_artifacts=host != "127.0.0.1")
    _SERVERS[uri] = TrackingServer(uri, Path("mlartifacts").resolve(), wait=False, host=host)
    return made


def take_server(uri: str):
    """The server started early for store `uri`, answering; None if there is none."""
    server = _SERVERS.pop(uri, None)
    if server is not None:
        server.wait_healthy()
    return server


def release() -> None:
    """Stop every server started early and not taken (the sweep never began)."""
    while _SERVERS:
        _SERVERS.popitem()[1].stop()


atexit.register(release)


def _start_ray(cfg: DictConfig, trials: int, runtime) -> None:
    """Ray as the launcher will ask for it, then one warm-up task per slot a trial can take."""
    from orchestrate.cluster import ray_cluster
    from orchestrate.launch import _core

    launcher = cfg.hydra.launcher
    _core.before_ray_import()
    try:
        data = OmegaConf.to_container(cfg.data, resolve=True)
    except Exception:  # an interpolation only a trial resolves: the trial builds its data itself
        data = None

    def warm(stop: threading.Event) -> None:
        import ray

        slots = min(trials, _core.slots(launcher))  # as many as the launcher runs at once
        task = ray.remote(warm_up).options(num_cpus=launcher.cpus_per_trial, max_retries=0, name="warm-up")
        # Waited for (the launcher's `ray_cluster.init` returns after this): trials submitted
        # while the warm-ups run would make Ray start more workers, each importing everything
        # again. A refused sweep (`stop`) stops waiting at once.
        warming = [task.remote(data) for _ in range(slots)]
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        while warming and not stop.is_set() and time.monotonic() < deadline:
            _, warming = ray.wait(warming, num_returns=len(warming), timeout=0.2)

    ray_cluster.init_in_background(launcher.address, "hydra.launcher.address", then=warm, runtime=runtime,
                                   num_cpus=launcher.num_cpus)


def warm_up(data: dict | None) -> None:
    """Runs in a Ray worker before any trial: import what a trial imports first (the app, with
    torch, MLflow and Hydra), and build the sweep's data set into the worker's cache. Failures
    are the trial's to report, not this task's."""
    with contextlib.suppress(Exception):
        from orchestrate import app  # noqa: F401 - imported for the trials that follow in this worker

        if data is not None:
            from orchestrate.job import build_data

            build_data(OmegaConf.create(data))
