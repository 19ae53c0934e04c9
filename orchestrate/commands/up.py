"""`orchestrate up` / `orchestrate down`: the warm local stack (orchestrate.cluster.warm) started,
shown or stopped.

    orchestrate up                  # a Ray head and the MLflow server in front of ./mlflow.db, left running
    orchestrate up --num-cpus 8     # the head's logical CPUs (default: this machine's)
    orchestrate up --workers 4      # the warm pool's commands at once (default: the head's CPUs; 0: no pool)
    orchestrate up --status         # what is up (exit 1 when nothing is), the warm pool's runs
    orchestrate down                # stop both
"""

import argparse
import logging
import pkgutil
import sys
from pathlib import Path

from orchestrate import errors
from orchestrate.boundary import TOOL, Where, boundary
from orchestrate.cluster import pool
from orchestrate.cluster.warm import down, found, recorded, up


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate up", description="Start (or show) the warm local stack: "
                                     "a Ray head and the MLflow server in front of a SQLite store, left running.")
    parser.add_argument("--num-cpus", type=int, default=None, help="the head's logical CPUs (default: this machine's)")
    parser.add_argument("--store", default="sqlite:///mlflow.db",
                        help="the SQLite store the server fronts (default: ./mlflow.db, a command's default store)")
    parser.add_argument("--workers", type=int, default=None,
                        help="the warm pool's commands at once (default: the head's CPUs; 0: no pool): each runs as "
                        "a fork of a process that imported torch, MLflow and orchestrate once")
    parser.add_argument("--status", action="store_true", help="say what is up; exit 1 when nothing is")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    with boundary(Where(TOOL)):
        if args.status:
            return show(found())
        if args.num_cpus is not None and args.num_cpus < 1:
            raise errors.Refused(f"--num-cpus={args.num_cpus}: must be 1 or more")
        if args.workers is not None and args.workers < 0:
            raise errors.Refused(f"--workers={args.workers}: must be 0 (no warm pool) or more")
        running = found()
        if running is not None:
            print(f"already up: {running.describe()}\n`orchestrate down` stops it (then `orchestrate up` starts one "
                  "for another store or size).", flush=True)
            return 0
        if recorded() is not None:  # its head is gone: what is left of it (pool, server, Ray's agents) goes first
            stale = down()
            print(f"the warm stack recorded before ({stale.ray_address}) no longer answered: stopped what was left "
                  "of it", file=sys.stderr, flush=True)
        # errors.Refused for a store it cannot front, Failed for a start
        stack = up(args.num_cpus, args.store, args.workers, warm_imports())
        print(f"up: {stack.describe()}\nCommands on this machine join it by themselves; `orchestrate down` stops it.",
              flush=True)
        return 0


def warm_imports() -> dict:
    """What the warm pool imports before its first fork (it names nothing of orchestrate itself:
    orchestrate.cluster is below the program it serves): the libraries and every backend's module
    (a module per backend in orchestrate/backends), then what a one-step run of `python -m
    orchestrate` imports, which it learns by running one (`{folder}`: that run's own folder)."""
    backends = Path(__file__).resolve().parents[1] / "backends"
    return {"modules": ["torch", "numpy", "mlflow", "hydra", "omegaconf",
                        *(f"orchestrate.backends.{m.name}" for m in pkgutil.iter_modules([str(backends)]))],
            "learn": ["orchestrate", "backend=torch", "trainer.max_steps=1", "trainer.progress=false",
                      "trainer.checkpoint_period=0", "tracking.uri=sqlite:///{folder}/mlflow.db"]}


def show(stack) -> int:
    """`--status`: the stack in one line, then the warm pool's own account (its runs)."""
    if stack is None:
        print("cold: no warm stack is up (`orchestrate up` starts one)")
        return 1
    print(f"warm: {stack.describe()}")
    if stack.pool_socket:
        state = pool.status(stack.pool_socket)
        print("\n".join(pool.describe(state)) if state else "warm pool: not answering (starting again, or gone: "
              "`orchestrate down` then `orchestrate up`)")
    return 0


def main_down(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="orchestrate down", description="Stop the warm local stack.").parse_args(argv)
    with boundary(Where(TOOL)):
        stack = down()
    print(f"stopped: {stack.describe()}" if stack else "nothing to stop: no warm stack is recorded", flush=True)
    return 0
