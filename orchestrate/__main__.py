"""`orchestrate` / `python -m orchestrate`: a training run or a sweep (orchestrate.cli), or one of
the COMMANDS below. Each is imported only when named: `orchestrate server` does not pay for torch.
"""

import importlib
import os
import sys

COMMANDS = {
    "server": "orchestrate.commands.server",  # the team's MLflow server on PostgreSQL, artifacts served
    "doctor": "orchestrate.commands.doctor",  # will this stack work? one line per check
    "sync": "orchestrate.commands.sync",  # send what a run kept while its MLflow server was away
    "slurm-ray": "orchestrate.commands.slurm_ray",  # in an sbatch script: Ray across the allocation, then the runner on it
    "up": "orchestrate.commands.up",  # the warm local stack: a Ray head and an MLflow server, left running
    "down": "orchestrate.commands.up:main_down",  # ... stopped
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        module, _, function = COMMANDS[sys.argv[1]].partition(":")
        raise SystemExit(getattr(importlib.import_module(module), function or "main")(sys.argv[2:]))
    # On the warm stack the command runs as a fork of the warm pool, which imported torch, MLflow and
    # orchestrate at `orchestrate up` (orchestrate.cluster.pool); this process only stands in for it.
    from orchestrate.cluster import warm

    code = warm.dispatch(sys.argv[1:])
    if code is not None:
        raise SystemExit(code)
    from orchestrate import cli

    cli.main()


def run() -> None:
    """The program (`orchestrate`, `python -m orchestrate`): `main`, then the exit. A command
    refused while the Ray it began to start early is still starting (a refused sweep or runner
    config: orchestrate.cluster.ray_cluster.init_in_background) leaves at once with its exit code: waiting
    for Ray's start to shut it down would cost seconds, and finalizing Python while Ray's C++ core
    starts on another thread can crash. Ray's processes end with the thread that started them."""
    try:
        main()
    except SystemExit as e:
        from orchestrate.cluster import ray_cluster

        if ray_cluster.starting():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code if isinstance(e.code, int) else 1)
        raise


if __name__ == "__main__":
    run()
