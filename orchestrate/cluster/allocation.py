"""Ray across a Slurm allocation (what `orchestrate slurm-ray` runs: orchestrate.commands.slurm_ray).

Ray's own recipe for Slurm (docs.ray.io, "Deploying on Slurm"): a Ray head on the allocation's
first node (`srun --nodes=1 --ntasks=1 -w NODE ray start --head --block`), a Ray node on each
other node the same way, joined to it, then the training command as the driver, on the first
node, with RAY_ADDRESS pointing at the head. Each node's Ray offers the CPUs of the tasks Slurm
put there (tasks x cpus-per-task); GPUs are the ones Slurm makes visible to the node's step. The
cluster is the job's own: a fresh token (RAY_AUTH_MODE=token) guards it, and it is stopped when
the command ends, fails or is cancelled.

Every wait has a limit and names what it waited for: the head's port, every node joined, the Ray
processes' end (60 s, then Slurm ends their steps).
"""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrate import errors
from orchestrate.cluster.ports import answers, free_port
from orchestrate.tracking.handover import RUN_FILE_VARIABLE, end_run_left_open

STOP_TIMEOUT_S = 60  # each `ray start --block` step's end after SIGTERM (then it is killed)
# The training command's end after SIGTERM (it marks its MLflow run KILLED; Ray ends it 5 s after
# the job's head is gone): then it is killed, and its run, if still RUNNING, is ended KILLED from
# here. All of it well within Slurm's default KillWait (30 s), after which Slurm kills the job.
DRIVER_STOP_TIMEOUT_S = 8
LOOPBACK = ("127.0.0.1", "localhost")


class SlurmRayError(errors.Refused):
    """Bad input or a wait that ran out: one line, exit code 2."""


@dataclass
class Allocation:
    """The job's nodes and tasks, from the variables Slurm sets in an sbatch script."""

    job_id: str
    nodes: list[str]  # the first runs the batch script, and the Ray head
    tasks_per_node: list[int]
    cpus_per_task: int

    @classmethod
    def from_environment(cls) -> "Allocation":
        env = os.environ
        if "SLURM_JOB_ID" not in env or "SLURM_JOB_NODELIST" not in env:
            raise SlurmRayError("not inside a Slurm allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST are not set): "
                                "run it as the body of an sbatch script (docs/runner.md: \"On a Slurm allocation\")")
        for program in ("srun", "scontrol"):
            if shutil.which(program) is None:
                raise SlurmRayError(f"{program}: not found on PATH (Slurm's client commands are needed)")
        nodes = scontrol("show", "hostnames", env["SLURM_JOB_NODELIST"]).split()
        tasks = expand_counts(env.get("SLURM_TASKS_PER_NODE", "1"))
        if len(tasks) != len(nodes):
            raise SlurmRayError(f"SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')} does not match the "
                                f"{len(nodes)} node(s) of SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']}")
        return cls(env["SLURM_JOB_ID"], nodes, tasks, int(env.get("SLURM_CPUS_PER_TASK", "1")))

    @property
    def tasks(self) -> int:
        return sum(self.tasks_per_node)


def expand_counts(spec: str) -> list[int]:
    """Slurm's compressed per-node counts, `2(x3),1` -> [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        value, _, times = part.partition("(x")
        counts += [int(value)] * int(times.rstrip(")") or 1)
    return counts


def scontrol(*args: str) -> str:
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise SlurmRayError(f"scontrol {' '.join(args)}: {said[-1]}")
    return done.stdout


def node_address(node: str) -> str:
    """The IP address Slurm reaches `node` at (its NodeAddr, resolved), for Ray to bind and join."""
    fields = scontrol("show", "node", "--oneliner", node).split()
    addr = next((f.split("=", 1)[1] for f in fields if f.startswith("NodeAddr=")), node)
    try:
        return socket.gethostbyname(addr)
    except OSError as e:
        raise SlurmRayError(f"node {node}: its address {addr} does not resolve ({e})") from None


@dataclass
class RayStep:
    """`srun` one task on `node` with its `cpus`, running `ray start ... --block` (Ray's guide): the
    node's Ray lives as long as the step, and Slurm ends the step with the job. Its output (Ray's
    start-up banner, its errors) goes to `log`, beside the job's own output."""

    node: str
    proc: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, job_id: str, node: str, cpus: int, *ray_args: str, env: dict) -> "RayStep":
        command = ["srun", "--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}", f"--nodelist={node}", "--overlap",
                   sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--num-cpus={cpus}",
                   "--disable-usage-stats", *ray_args]
        log = Path(f"slurm-ray-{job_id}-{node}.log").resolve()
        with open(log, "w") as out:
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return cls(node, proc, log)

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def last_line(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no output)"


def wait_for(what: str, ready, steps: list[RayStep], timeout_s: float) -> None:
    """Poll `ready()` every second until it holds; SlurmRayError when `timeout_s` passes or a Ray
    step ends meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        ended = [s for s in steps if s.ended()]
        if ended:
            step = ended[0]
            raise SlurmRayError(f"waiting for {what}: Ray on {step.node} exited with code {step.proc.returncode}: "
                                f"{step.last_line()} (its output: {step.log})")
        if time.monotonic() > deadline:
            raise SlurmRayError(f"waited {timeout_s:g} s for {what} (Ray's output: "
                                f"{', '.join(str(s.log) for s in steps)})")
        time.sleep(1)


def wait_for_nodes(address: str, count: int, steps: list[RayStep], timeout_s: float) -> None:
    """Wait until `count` Ray nodes are alive in the cluster at `address`: this process joins it as a
    driver to count them, and leaves. Ray's init and shutdown set SIGTERM's handler: ours comes back."""
    import ray

    handler = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, configure_logging=False, log_to_driver=False)
    try:
        signal.signal(signal.SIGTERM, handler)
        wait_for(f"all {count} node(s) to join the Ray cluster at {address}",
                 lambda: sum(1 for n in ray.nodes() if n["Alive"]) >= count, steps, timeout_s)
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, handler)


def head_folder(job_id: str) -> Path:
    """The Ray head's temporary folder: the job's own, removed once Ray has stopped (Ray's output
    is in slurm-ray-<job>-<node>.log)."""
    return Path(tempfile.gettempdir()) / f"ray-slurm-{job_id}"


def run_file(job_id: str) -> Path:
    """Where the training command names its MLflow run (orchestrate.tracking.handover), beside the
    job's output; removed at the end."""
    return Path(f"slurm-ray-{job_id}.run").resolve()


def start_ray(allocation: Allocation, port: int, timeout_s: float, steps: list[RayStep]) -> dict:
    """The head on the first node, then a node on each other one, each waited for; returns the
    environment that reaches the cluster (RAY_ADDRESS, the token)."""
    head_ip = node_address(allocation.nodes[0])
    address = f"{head_ip}:{port}"
    env = {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16),
           # Ray Train leaves a detached actor behind: its nodes would wait 30 s for it at the end.
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           # The cluster is the job's own: when its head is gone (scancel, the time limit), the
           # driver and the nodes give up on it after 5 s, not Ray's 60.
           "RAY_gcs_rpc_server_reconnect_timeout_s": "5"}
    if head_ip in LOOPBACK:
        # A one-node cluster on 127.0.0.1 (tests): without this Ray swaps loopback for the machine's
        # network address (orchestrate.cluster.ray_cluster says more).
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.update({k: env[k] for k in env if k.startswith("RAY_")})  # this process counts the nodes
    cpus = [tasks * allocation.cpus_per_task for tasks in allocation.tasks_per_node]
    print(f"slurm-ray: job {allocation.job_id}: Ray head on {allocation.nodes[0]} ({address}), "
          f"{len(allocation.nodes)} node(s): " + ", ".join(f"{n} {c} CPU(s)" for n, c in zip(allocation.nodes, cpus)),
          flush=True)
    # The dashboard serves Ray's state API, which Ray Train's clean-up actor polls (without it, a
    # warning every few seconds); on the head's address, behind the token.
    # The head's files in a folder of the job's own: `ray start --head` leaves the address of its
    # cluster in <temp dir>/ray_current_cluster, and a later plain `ray.init()` on the node (Ray
    # Train's clean-up actor looks the cluster up that way) would wait for a cluster long gone.
    steps.append(RayStep.start(allocation.job_id, allocation.nodes[0], cpus[0], "--head", f"--port={port}",
                               f"--temp-dir={head_folder(allocation.job_id)}",
                               f"--node-ip-address={head_ip}", "--include-dashboard=true",
                               f"--dashboard-host={head_ip}", f"--dashboard-port={free_port('')}", env=env))
    wait_for(f"the Ray head on {allocation.nodes[0]} to answer at {address}", lambda: answers(head_ip, port, 2),
             steps, timeout_s)
    for node, node_cpus in zip(allocation.nodes[1:], cpus[1:]):
        steps.append(RayStep.start(allocation.job_id, node, node_cpus, f"--address={address}",
                                   f"--node-ip-address={node_address(node)}", env=env))
    wait_for_nodes(address, len(allocation.nodes), steps, timeout_s)
    return env


def stop_ray(steps: list[RayStep]) -> None:
    """SIGTERM to each `srun`, the other nodes first: srun has Slurm end its step (SIGTERM to `ray
    start --block`, which stops its node's Ray processes, SIGKILL to what is left after KillWait);
    SIGKILL to srun itself after STOP_TIMEOUT_S."""
    began = time.monotonic()
    for step in reversed(steps):
        if not step.ended():
            step.proc.send_signal(signal.SIGTERM)
    for step in steps:
        try:
            step.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"slurm-ray: Ray's step on {step.node} did not end {STOP_TIMEOUT_S} s after SIGTERM: killed",
                  flush=True)
            step.proc.kill()
            step.proc.wait()
    if steps:
        print(f"slurm-ray: Ray stopped on {len(steps)} node(s) in {time.monotonic() - began:.1f} s", flush=True)


def run_driver(command: list[str], env: dict, named_in: Path) -> int:
    """The training command, in the foreground; a signal to this process (scancel, the time limit)
    is handed on to it, and it gets DRIVER_STOP_TIMEOUT_S to close its MLflow run (KILLED). The
    command writes its run's URI and id to `named_in` when it opens the run: a run it could not
    end (killed, or ended by Ray when the job's head went away first) is ended KILLED from here."""
    driver = subprocess.Popen(command, env={**env, RUN_FILE_VARIABLE: str(named_in)})
    try:
        return driver.wait()
    except KeyboardInterrupt as e:
        began = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(timeout=DRIVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        print(f"slurm-ray: the training command ended {time.monotonic() - began:.1f} s after the signal "
              f"(exit code {driver.returncode})", file=sys.stderr, flush=True)
        said = end_run_left_open(named_in, signal.Signals(getattr(e, "signum", signal.SIGINT)).name)
        if said:
            print(f"slurm-ray: {said}", file=sys.stderr, flush=True)
        raise
