"""`orchestrate slurm-ray`: the runner on a Slurm allocation, as the body of an sbatch script.

    python -m orchestrate slurm-ray -- tracking.uri=http://MLFLOW_HOST:5000 trainer.max_steps=1000

Ray's own recipe for Slurm (docs.ray.io, "Deploying on Slurm"), in one command: a Ray head on the
allocation's first node (`srun --nodes=1 --ntasks=1 -w NODE ray start --head --block`), a Ray node
on each other node the same way, joined to it, then the training command as the driver, on the
first node, with RAY_ADDRESS pointing at the head:

    python -m orchestrate backend=runner trainer.num_workers=$SLURM_NTASKS \\
        backend.cpus_per_worker=$SLURM_CPUS_PER_TASK OVERRIDES...

one Ray Train worker per Slurm task (the OVERRIDES come last and win). Each node's Ray offers the
CPUs of the tasks Slurm put there (tasks x cpus-per-task), so the workers land where the tasks
were allocated; GPUs are the ones Slurm makes visible to the node's step. The cluster is the job's
own: a fresh token (RAY_AUTH_MODE=token) guards it, and it is stopped when the command ends,
fails or is cancelled (SIGTERM from `scancel` or the time limit). The exit code is the training
command's (2 for bad input here: outside an allocation, Slurm's commands missing).

Every wait has a limit and names what it waited for: the head's port (--timeout, 120 s), every
node joined (the same), the Ray processes' end (60 s, then Slurm ends their steps).
"""

import argparse
import shutil
import signal
import sys

from orchestrate import errors, signals
from orchestrate.boundary import TOOL, Where, boundary
from orchestrate.cluster.allocation import (
    Allocation,
    RayStep,
    head_folder,
    run_driver,
    run_file,
    start_ray,
    stop_ray,
)
from orchestrate.cluster.ports import free_port


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orchestrate slurm-ray", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, help="the Ray head's port on the first node (default: a free one)")
    p.add_argument("--timeout", type=float, default=120, help="seconds to wait for the head, and for every node")
    p.add_argument("overrides", nargs="*", help="the training command's overrides, after `--`")

    def refuse(message: str) -> None:
        raise errors.Refused(f"{message}; see --help")

    p.error = refuse
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    steps: list[RayStep] = []
    allocation = None
    # scancel and the time limit send SIGTERM: Ray is stopped as on Ctrl-C.
    with boundary(Where(TOOL, prefix="orchestrate slurm-ray: ")), signals.stop_on_signals():
        try:
            args = parse(argv)
            allocation = Allocation.from_environment()
            env = start_ray(allocation, args.port or free_port(""), args.timeout, steps)
            command = [sys.executable, "-m", "orchestrate", "backend=runner", f"trainer.num_workers={allocation.tasks}",
                       f"backend.cpus_per_worker={allocation.cpus_per_task}", *args.overrides]
            print(f"slurm-ray: python {' '.join(command[1:])}", flush=True)
            return run_driver(command, env, run_file(allocation.job_id))
        except KeyboardInterrupt as e:
            print("slurm-ray: stopped by a signal: stopping Ray", file=sys.stderr, flush=True)
            return 128 + getattr(e, "signum", signal.SIGINT)  # as a shell reports it
        finally:
            stop_ray(steps)
            if steps:
                shutil.rmtree(head_folder(allocation.job_id), ignore_errors=True)
                run_file(allocation.job_id).unlink(missing_ok=True)
