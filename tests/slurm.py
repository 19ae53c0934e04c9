"""A real single-node Slurm cluster on 127.0.0.1 for the tests (`slurm_cluster` in conftest.py):
Debian's `munge`, `slurmctld` and `slurmd` (Slurm 22.05; `.ci/run` installs them), each run in the
foreground as a child of the test session (and ended with it), with every file they write (configuration, munge key
and socket, state, spool, logs, pid files) in one temporary folder that is removed at the end.
Nothing under /etc, /run or /var is read or written: clients find the cluster through SLURM_CONF.

The controller and the node listen on free ports of 127.0.0.1 only. The node is this machine,
under its own host name (slurmctld accepts to run only on a host its configuration names), with
the CPUs Slurm sees here. Accounting is off, as on most small clusters: `sacct` answers "Slurm
accounting storage is disabled", which is what a sweep on such a cluster meets.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrate.cluster.mlflow_server import _die_with_parent
from tests.helpers import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
PARTITION = "debug"
START_TIMEOUT_S = 60  # each daemon's start, and the node's first `idle`
STOP_TIMEOUT_S = 30  # each daemon's exit after SIGTERM, and the jobs' end after scancel


def cannot_start() -> str:
    """Why no cluster can start here ("" if it can): Slurm's or munge's programs missing (searched
    in /usr/sbin too: Debian puts the daemons there, off a user's PATH), or not root."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [p for p in (*DAEMONS, *CLIENTS) if shutil.which(p, path=path) is None]
    if missing:
        return (f"Slurm is not installed (missing: {', '.join(missing)}); .ci/run installs Debian's slurmctld, "
                "slurmd and munge")
    if os.geteuid() != 0:
        return "slurmd starts each job as the user who submitted it: the Slurm tests run as root (CI, a container)"
    return ""


def memory_mb() -> int:
    """What the node offers jobs (`--mem`): 90% of this machine's memory (slurmd refuses to register a
    node configured with more than it finds)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9) // 2**20


SLURM_CONF = """\
# A one-node cluster on 127.0.0.1 for orchestrate's tests (tests/slurm.py).
ClusterName=orchestrate-tests
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# A job step that outlives its SIGTERM (scancel, the time limit) is killed 30 s later (Slurm's default).
KillWait=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running cluster: `env` is this process's environment with SLURM_CONF pointing at it (and
    /usr/sbin on PATH); every Slurm command the tests run, and every job, uses it."""

    folder: Path
    partition: str
    node: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen]

    def run(self, *command: str, cwd: Path | None = None, timeout: float = 30) -> str:
        """A Slurm command's output; raises with its stderr if it fails."""
        done = subprocess.run(command, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self) -> str:
        """The node's state in sinfo's short form: `idle` once no job is on it, none completing."""
        return self.run("sinfo", "--noheader", f"--nodes={self.node}", "--format=%t").strip()

    def job_state(self, job_id: str) -> str:
        """The job's state as the controller has it (PENDING, RUNNING, COMPLETED, CANCELLED, ...)."""
        return self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").strip()

    def wait_for(self, what: str, ready, timeout_s: float) -> None:
        """Poll `ready()` every half second; fail with `what` (and the daemons' log tails) on time out."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:g} s for {what}\n{self.log_tails()}")
            time.sleep(0.5)

    def log_tails(self, lines: int = 15) -> str:
        tails = []
        for log in sorted((self.folder / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(tails)


def start() -> SlurmCluster:
    """munged, slurmctld and slurmd, each in the foreground, configured in a new temporary folder;
    returns once the node is idle. On failure whatever started is stopped again."""
    # munged refuses a socket in a folder that others cannot enter: a folder of its own under /tmp
    # (pytest's base temp is closed to others), the key in a subfolder only its owner reads.
    folder = Path(tempfile.mkdtemp(prefix="orchestrate-slurm-", dir="/tmp"))
    folder.chmod(0o755)
    for sub in ("munge", "state", "spool", "log"):
        (folder / sub).mkdir()
    (folder / "munge").chmod(0o755)
    (folder / "munge" / "munge.key").write_bytes(os.urandom(1024))
    (folder / "munge" / "munge.key").chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, folder=folder, ctld_port=free_port(),
                                      slurmd_port=free_port(), cpus=os.cpu_count(), memory_mb=memory_mb(),
                                      partition=PARTITION))
    env = {**os.environ, "SLURM_CONF": str(conf),
           "PATH": os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])}
    cluster = SlurmCluster(folder, PARTITION, host, env, {})
    munge = folder / "munge"
    commands = {
        "munged": ["munged", "--foreground", f"--key-file={munge / 'munge.key'}", f"--socket={munge / 'munge.socket'}",
                   f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}",
                   f"--log-file={folder / 'log' / 'munged.log'}"],
        "slurmctld": ["slurmctld", "-D", "-i", "-f", str(conf)],  # -i: no state from an earlier start
        "slurmd": ["slurmd", "-D", "-N", host, "-f", str(conf)],
    }
    ready = {
        "munged": lambda: (munge / "munge.socket").exists(),
        "slurmctld": lambda: _answers(cluster, "scontrol", "ping"),
        "slurmd": lambda: True,
    }
    try:
        for name, command in commands.items():
            # Each daemon gets SIGTERM should the test session die without stopping it.
            with open(folder / "log" / f"{name}.out", "w") as out:
                cluster.procs[name] = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                       start_new_session=True, preexec_fn=_die_with_parent)
            cluster.wait_for(f"{name} to start", lambda: ready[name]() or _exited(cluster, name), START_TIMEOUT_S)  # noqa: B023
            if cluster.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited {cluster.procs[name].returncode} at start\n{cluster.log_tails()}")
        cluster.wait_for(f"node {host} to be idle in partition {PARTITION}",
                         lambda: _answers(cluster, "sinfo") and cluster.node_state() == "idle", START_TIMEOUT_S)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _answers(cluster: SlurmCluster, *command: str) -> bool:
    return subprocess.run(command, env=cluster.env, capture_output=True, timeout=30).returncode == 0


def _exited(cluster: SlurmCluster, name: str) -> bool:
    return cluster.procs[name].poll() is not None


def stop(cluster: SlurmCluster) -> None:
    """Cancel every job still there and wait for their end, then stop slurmd, slurmctld and
    munged (SIGTERM, SIGKILL after STOP_TIMEOUT_S) and remove the folder."""
    if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
        try:
            if _answers(cluster, "scancel", "--full", f"--partition={cluster.partition}"):
                # Idle: no job left on the node, none completing (its processes gone).
                cluster.wait_for("the jobs to end after scancel", lambda: cluster.node_state() == "idle",
                                 STOP_TIMEOUT_S)
        except (TimeoutError, RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"slurm_cluster: {e}")
    for name in reversed(list(cluster.procs)):
        proc = cluster.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"slurm_cluster: {name} did not exit {STOP_TIMEOUT_S} s after SIGTERM: killed")
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
    shutil.rmtree(cluster.folder, ignore_errors=True)
