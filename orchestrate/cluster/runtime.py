"""How this process was started, chosen once where it starts and handed down: the one value that
says whether a command runs cold or warm.

- cold: the command starts what it needs (a local Ray, a sweep's MLflow server) and stops it at
  its end;
- warm: `orchestrate up` keeps a Ray head, an MLflow server and a pool of pre-imported processes
  running (orchestrate.cluster.warm): a command with no Ray address of its own joins the head, its
  Ray workers are forks of the pool, a sweep whose store the server fronts writes through it, and
  the command itself may be a fork of the pool.

The entry picks it (`orchestrate.cluster.warm.runtime`: `python -m orchestrate` and the commands,
once, before anything else) and hands it down: to the app and the job (`Job.runtime`, which the
backends' `check`, `start_early` and `connect` read), to Ray's start (`ray_cluster.init`), and,
for what Hydra builds from configs (the sweep's callbacks, the Ray launcher), through `entered`:
the entry runs Hydra inside it, and `current()` is what it entered (cold anywhere else: a Ray
worker, a Slurm job, a library call). Nothing below the entry reads the warm stack's record, asks
whether it is a fork, or words the start line itself.

Imports nothing of orchestrate: the core (app, job, backends, meter, tracking) imports this, and
nothing that knows the warm stack (tests/test_imports.py).
"""

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    head: str | None = None  # the warm Ray head (127.0.0.1:PORT), joined by a command with no address of its own
    head_cpus: int = 0  # its CPUs: all it will ever have (no autoscaler)
    worker_python: str | None = None  # Ray's py_executable for jobs on that head: its workers are forks of the pool
    server_uri: str | None = None  # the warm MLflow server
    server_store: str | None = None  # the SQLite store it fronts (sqlite:////abs/path)
    server_artifacts: str | None = None  # where it serves artifacts from
    server_answers: bool = False  # whether it answered when the entry asked
    forked: bool = False  # this process is a fork of the warm pool (its imports were done before it started)
    # Ray and a sweep's MLflow server begun while the command line checks the config (cli.validate,
    # orchestrate.sweeps.early); ORCHESTRATE_EARLY_START=0 turns it off (benchmarks/warm.py measures both)
    early_start: bool = True

    def server_for(self, store_uri: str) -> tuple[str, str] | None:
        """(URI, artifacts) of the warm MLflow server if it fronts `store_uri` (an absolute
        sqlite:/// URI) and answered, else None: the sweep starts a server of its own (a line
        says so when the warm one fronts the store and did not answer)."""
        if not self.server_uri or self.server_store != store_uri:
            return None
        if not self.server_answers:
            log.warning(f"the warm stack's MLflow server {self.server_uri} does not answer; this sweep starts its own "
                        "(`orchestrate down` then `orchestrate up` starts the stack again)")
            return None
        return self.server_uri, self.server_artifacts or ""

    def start_line(self, ray: str | None, server: bool | None) -> str:
        """The summary's line on how the command started: `ray` as orchestrate.cluster.ray_cluster.how
        says (warm, cold, cluster; None: no Ray), `server` whether the sweep's MLflow server was
        the warm stack's (None: no server of its own); in a fork of the warm pool, that too."""
        warm = [what for what, yes in (("the Ray head", ray == "warm"), ("the MLflow server", server is True)) if yes]
        cold = [what for what, yes in (("a local Ray", ray == "cold"), ("an MLflow server", server is False)) if yes]
        if ray == "cluster":
            warm.append("the Ray cluster it was given")
        if not warm and not cold:
            return ("warm: in a fork of the warm pool that `orchestrate up` keeps (its imports done); no Ray and no "
                    "server") if self.forked else "one process: no Ray and no server to keep warm"
        said = []
        if warm:
            said.append(f"warm: joined {' and '.join(warm)}" + (" that `orchestrate up` keeps running"
                                                                 if ray == "warm" or server else "") +
                        (", in a fork of the warm pool (imports done)" if self.forked else ""))
        elif self.forked:
            said.append("warm: in a fork of the warm pool that `orchestrate up` keeps (imports done)")
        if cold:
            said.append(f"cold: started {' and '.join(cold)} for this command, stopped at its end "
                        "(`orchestrate up` keeps them running between commands)")
        return "; ".join(said)


COLD = Runtime()
# Module state: the runtime the entry entered (`entered`), for what Hydra builds from configs and
# cannot be handed it; put back when the entry's block ends.
_ENTERED: list[Runtime] = []


def current() -> Runtime:
    """The runtime the entry entered; cold outside it."""
    return _ENTERED[-1] if _ENTERED else COLD


@contextlib.contextmanager
def entered(runtime: Runtime) -> Iterator[Runtime]:
    """Run the block as `runtime` says (the entry, around Hydra's app)."""
    _ENTERED.append(runtime)
    try:
        yield runtime
    finally:
        _ENTERED.pop()
