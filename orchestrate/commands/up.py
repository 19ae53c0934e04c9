"""`orchestrate up` / `orchestrate down`: the warm local stack (orchestrate.cluster.warm) started,
shown or stopped.

    orchestrate up                  # a Ray head and the MLflow server in front of ./mlflow.db, left running
    orchestrate up --num-cpus 8     # the head's logical CPUs (default: this machine's)
    orchestrate up --status         # what is up, in one line (exit 1 when nothing is)
    orchestrate down                # stop both
"""

import argparse
import logging

from orchestrate import errors
from orchestrate.boundary import TOOL, Where, boundary
from orchestrate.cluster.warm import down, found, up


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate up", description="Start (or show) the warm local stack: "
                                     "a Ray head and the MLflow server in front of a SQLite store, left running.")
    parser.add_argument("--num-cpus", type=int, default=None, help="the head's logical CPUs (default: this machine's)")
    parser.add_argument("--store", default="sqlite:///mlflow.db",
                        help="the SQLite store the server fronts (default: ./mlflow.db, a command's default store)")
    parser.add_argument("--status", action="store_true", help="say what is up; exit 1 when nothing is")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    with boundary(Where(TOOL)):
        if args.status:
            stack = found()
            print(f"warm: {stack.describe()}" if stack else "cold: no warm stack is up (`orchestrate up` starts one)")
            return 0 if stack else 1
        if args.num_cpus is not None and args.num_cpus < 1:
            raise errors.Refused(f"--num-cpus={args.num_cpus}: must be 1 or more")
        running = found()
        if running is not None:
            print(f"already up: {running.describe()}\n`orchestrate down` stops it (then `orchestrate up` starts one "
                  "for another store or size).", flush=True)
            return 0
        stack = up(args.num_cpus, args.store)  # errors.Refused for a store it cannot front, Failed for a start
        print(f"up: {stack.describe()}\nCommands on this machine join it by themselves; `orchestrate down` stops it.",
              flush=True)
        return 0


def main_down(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="orchestrate down", description="Stop the warm local stack.").parse_args(argv)
    with boundary(Where(TOOL)):
        stack = down()
    print(f"stopped: {stack.describe()}" if stack else "nothing to stop: no warm stack is recorded", flush=True)
    return 0
