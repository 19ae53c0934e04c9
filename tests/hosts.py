"""Test hosts that share nothing, on this machine: each a Linux network namespace of its own, all
joined by veth pairs to one bridge (in a namespace of its own too), so that 127.0.0.1 on one host
is not the other's and a host reaches the others only at the addresses given here. Every host but
the first also has a mount namespace of its own: its own /tmp, /dev/shm and home (empty), where
the driver's folders and files are not visible; it sees the same installed software (Python, the
virtual environment, this checkout's package), as the nodes of one machine image do.

    python tests/hosts.py --hosts 3 --cpus 1       # hold 3 hosts with a Ray cluster up; Ctrl-C ends them
    python tests/hosts.py --hosts 3 --no-ray       # the hosts only

The first host (`hosts[0]`) is the driver's machine: the Ray head runs there (with no CPUs, so that
every worker lands on another host), and a test runs its commands there as a user on that machine
would (`Host.command`), in its own folders. The others run one Ray node each.

Nothing outside the namespaces made here is touched: no address is added to this machine's own
interfaces, no route changes, and every process started on a host is stopped by the namespace's
own list of processes (`ip netns pids`), then the namespaces are deleted. Needs root and Debian's
iproute2 (`ip`) and util-linux (`unshare`): `.ci/run` installs iproute2 when missing;
`cannot_start()` says what is missing, and the tests that need the hosts fail with it.

Also used by pytest (the `hosts` fixture of tests/conftest.py, one per session).
"""

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.0"  # the hosts' addresses: SUBNET.1, SUBNET.2, ... on their own bridge only
RAY_PORT, DASHBOARD_PORT = 6380, 8265
START_TIMEOUT_S = 90  # the cluster's nodes all alive
STOP_TIMEOUT_S = 20
GRACE_S = 5  # the hosts' end: a test cluster's processes get this long after SIGTERM
OBJECT_STORE_BYTES = 150 * 2**20  # each node's (its own /dev/shm): small, the tests move little data
HIDDEN = ("/tmp", "/dev/shm", "/var/tmp")  # a host's own, empty at its start (and its home)


def cannot_start() -> str:
    """Why no hosts can start here ("" if they can): not root, or iproute2/unshare missing."""
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    missing = [p for p in ("ip", "unshare") if shutil.which(p, path=path) is None]
    if missing:
        return f"the test hosts need {', '.join(missing)} (Debian's iproute2 and util-linux); .ci/run installs iproute2"
    if os.geteuid() != 0:
        return "the test hosts are network and mount namespaces: they need root (CI, a container)"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def software_paths() -> list[str]:
    """What every host sees as on the driver's machine: the Pythons (base and virtual environment)
    and the folder this package is installed from (an editable install is this checkout)."""
    import importlib.util

    spec = importlib.util.find_spec("orchestrate")
    package = Path(spec.origin).resolve().parent.parent if spec and spec.origin else None
    paths = {str(Path(p).resolve()) for p in (sys.base_prefix, sys.prefix)}
    if package is not None:
        paths.add(str(package))
    return sorted(paths)


@dataclass
class Host:
    """One test host: a network namespace (`netns`) with one address on its link to the bridge,
    and (`private`) a mount namespace of its own made for each process started on it."""

    name: str
    netns: str
    address: str
    private: bool
    hosts_file: str = ""  # /etc/hosts on a private host: every host's name and address
    home: str = field(default_factory=lambda: os.environ.get("HOME", "/root"))

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as run on this host: in its network namespace and, for a private host, with its
        own host name, /etc/hosts (the hosts by name), empty /tmp, /dev/shm and home (the
        software paths kept)."""
        inner = [str(a) for a in argv]
        if self.private:
            inner = ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c",
                     f"hostname {self.name} && " + self._mounts() + ' && exec "$@"', "host-setup", *inner]
        return ["ip", "netns", "exec", self.netns, *inner]

    def _mounts(self) -> str:
        """The shell lines that give this host its own empty folders: the software paths inside
        them are bound to a staging folder first, then put back over the new empty ones."""
        covered = [*HIDDEN, self.home]
        keep = [p for p in software_paths() if any(p == c or p.startswith(c.rstrip("/") + "/") for c in covered)]
        q = shlex.quote
        lines = [f"mount --bind {q(self.hosts_file)} /etc/hosts", "mount -t tmpfs -o size=64m orchestrate-stage /mnt"]
        lines += [f"mkdir -p /mnt/k{i} && mount --rbind {q(p)} /mnt/k{i}" for i, p in enumerate(keep)]
        # mkdir: a home inside a folder hidden just before (HOME=$(mktemp -d)) is not there any more.
        lines += [f"mkdir -p {q(c)} && mount -t tmpfs -o size=2g,mode=1777 {self.name}-tmp {q(c)}" for c in covered]
        lines += [f"mkdir -p {q(p)} && mount --move /mnt/k{i} {q(p)}" for i, p in enumerate(keep)]
        lines += [f"mkdir -p {q(self.home)}/.cache"]
        return " && ".join(lines)

    def run(self, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def link(self, up: bool) -> None:
        """This host's link to the others up or down (its network namespace's interface): a host
        lost to the network, then back."""
        _ip("-n", self.netns, "link", "set", "eth0", "up" if up else "down")

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30).stdout
        return [int(p) for p in out.split()]

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop_processes(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Every process started on this host: SIGTERM, then SIGKILL after `timeout_s`."""
        stop_all([self], timeout_s)


def stop_all(hosts: list[Host], timeout_s: float) -> None:
    """Every process on these hosts, at once: SIGTERM, then SIGKILL after `timeout_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for host in hosts:
            host.signal_all(sig)
        deadline = time.monotonic() + timeout_s
        while any(host.pids() for host in hosts) and time.monotonic() < deadline:
            time.sleep(0.2)


class Hosts:
    """`count` hosts that share nothing; with `ray_cpus`, a Ray cluster on them: the head on
    hosts[0] (no CPUs), a node of `ray_cpus` CPUs on each of the others. Token authentication is
    on, as on a real cluster: its token is the `env` a driver passes (RAY_AUTH_MODE,
    RAY_AUTH_TOKEN). Use as a context manager; `stop()` removes everything it made."""

    def __init__(self, count: int = 3, ray_cpus: float | None = 1, prefix: str | None = None):
        if count < 2:
            raise ValueError("test hosts: at least 2 (a driver's host and another)")
        self.prefix = prefix or f"orch{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.ray_cpus = ray_cpus
        self.token = secrets.token_hex(32)
        self.folder = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        names = [socket.gethostname(), *(f"host{i}" for i in range(1, count))]  # the driver's keeps its own
        table = self.folder / "hosts"
        # As a cluster's DNS would answer: each name's address, also reversed from its IPv4-mapped
        # IPv6 form (torch's TCPStore sees its clients' addresses so, and asks their names).
        table.write_text("127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} {n}\n::ffff:{SUBNET}.{i + 1} {n}\n"
                                                           for i, n in enumerate(names)))
        self.hosts = [Host(name, f"{self.prefix}-h{i}", f"{SUBNET}.{i + 1}", private=i > 0, hosts_file=str(table))
                      for i, name in enumerate(names)]
        self.logs: dict[str, Path] = {}
        self.nodes: dict[str, subprocess.Popen] = {}

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """What a driver (or `ray job submit`) needs beside its own environment to use the cluster."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def __enter__(self) -> "Hosts":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        why = cannot_start()
        if why:
            raise RuntimeError(why)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.netns)
            # The pair is made inside the host's namespace with its peer in the switch's: it never
            # exists in this machine's own namespace.
            _ip("-n", host.netns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        if self.ray_cpus is not None:
            self.start_ray()

    def _ray_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
        return {**env, **self.env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}

    def start_ray(self) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        head = self.head
        common = ["--block", "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}"]
        self._start_node(head, [ray, "start", "--head", f"--node-ip-address={head.address}", f"--port={RAY_PORT}",
                                "--num-cpus=0", "--include-dashboard=true", f"--dashboard-host={head.address}",
                                f"--dashboard-port={DASHBOARD_PORT}", f"--temp-dir={self.folder / 'ray'}", *common])
        self._wait_port(head, RAY_PORT)
        for host in self.hosts[1:]:
            self._start_node(host, self._node_argv(host))
        self.wait_nodes(len(self.hosts))

    def _node_argv(self, host: Host) -> list[str]:
        return [str(Path(sys.executable).parent / "ray"), "start", f"--address={self.ray_address}",
                f"--node-ip-address={host.address}", f"--num-cpus={self.ray_cpus:g}", "--block", "--disable-usage-stats",
                f"--object-store-memory={OBJECT_STORE_BYTES}"]

    def _start_node(self, host: Host, argv: list[str]) -> None:
        log = self.folder / f"{host.name}-ray.log"
        self.logs[host.name] = log
        self.nodes[host.name] = host.popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=self._ray_env(),
                                           cwd="/", start_new_session=True)

    def restart_node(self, host: Host) -> None:
        """A node killed (or its host lost) started again, joining the head as before."""
        host.stop_processes()
        self._start_node(host, self._node_argv(host))

    def _wait_port(self, host: Host, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = [sys.executable, "-c", f"import socket; socket.create_connection(('{host.address}', {port}), 1).close()"]
        while time.monotonic() < deadline:
            if host.run(probe, timeout=10, capture_output=True).returncode == 0:
                return
            self._check_nodes()
            time.sleep(0.5)
        raise TimeoutError(f"the Ray head on {host.name} ({host.address}:{port}) did not listen within "
                           f"{START_TIMEOUT_S} s; its log: {self.logs.get(host.name)}")

    def _check_nodes(self) -> None:
        for name, node in self.nodes.items():
            if node.poll() is not None:
                raise RuntimeError(f"the Ray node on {name} ended (exit {node.returncode}): "
                                   f"{self.logs[name].read_text()[-2000:]}")

    def alive_nodes(self) -> int:
        """How many Ray nodes the head counts alive (asked from the head's host)."""
        script = (f"import ray, json; ray.init(address='{self.ray_address}', log_to_driver=False, configure_logging=False); "
                  "print(json.dumps(sum(1 for n in ray.nodes() if n['Alive'])))")
        done = self.head.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True,
                             env=self._ray_env(), cwd=str(self.folder))
        if done.returncode != 0:
            return 0
        return int(done.stdout.strip().splitlines()[-1])

    def wait_nodes(self, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_nodes()
            if self.alive_nodes() >= count:
                return
            time.sleep(1)
        raise TimeoutError(f"the Ray cluster on the test hosts did not have {count} nodes within {timeout_s:g} s; "
                           f"logs: {', '.join(map(str, self.logs.values()))}")

    def stop(self) -> None:
        """Every process on every host, then the namespaces (their links go with them)."""
        stop_all([host for host in self.hosts if _exists(host.netns)], GRACE_S)
        for node in self.nodes.values():
            try:
                node.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        for netns in [h.netns for h in self.hosts] + [self.switch]:
            if _exists(netns):
                subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


def _exists(netns: str) -> bool:
    return Path("/var/run/netns", netns).exists() or Path("/run/netns", netns).exists()


def port_on(host: Host) -> int:
    """A port free on `host`'s address (asked inside its namespace)."""
    script = f"import socket; s = socket.socket(); s.bind(('{host.address}', 0)); print(s.getsockname()[1])"
    done = host.run([sys.executable, "-c", script], timeout=30, capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


USER_MODEL = '''\
"""A model of the user's own, beside the driver only."""
import torch


class DigitsNet(torch.nn.Module):
    def __init__(self, in_features: int = 64, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(in_features, width), torch.nn.ReLU(),
                                          torch.nn.Linear(width, num_classes))

    def forward(self, x):
        return self.layers(x)
'''


def write_project(folder: Path) -> Path:
    """A user's project in `folder`, as it lives beside the driver only: a model module and a
    `--config-dir` folder naming it (`model=usernet`). Returns `folder`."""
    (folder / "user_model.py").write_text(USER_MODEL)
    (folder / "conf" / "model").mkdir(parents=True, exist_ok=True)
    (folder / "conf" / "model" / "usernet.yaml").write_text(
        "_target_: user_model.DigitsNet\nin_features: 64\nnum_classes: 10\nwidth: 32\n")
    return folder


@contextlib.contextmanager
def s3_server(hosts: "Hosts", bucket: str = "checkpoints"):
    """An S3 API server (moto's server mode, as Ray's and pyarrow's own S3 tests use) on the
    driver's host, which every host reaches; yields the AWS_* variables a driver sets, with
    `bucket` made; stopped at the end."""
    port = port_on(hosts.head)
    env = {"AWS_ENDPOINT_URL": f"http://{hosts.head.address}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server = hosts.head.popen([str(Path(sys.executable).parent / "moto_server"), "-H", hosts.head.address,
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        make = ("import boto3, time\n"
                "for _ in range(100):\n"
                "    try:\n"
                f"        boto3.client('s3').create_bucket(Bucket={bucket!r}); break\n"
                "    except Exception:\n"
                "        time.sleep(0.2)\n"
                "else:\n"
                "    raise SystemExit('the S3 server did not answer')\n")
        hosts.head.run([sys.executable, "-c", make], timeout=60, check=True, env={**os.environ, **env})
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--cpus", type=float, default=1, help="each worker host's Ray node's CPUs")
    parser.add_argument("--no-ray", action="store_true", help="the hosts only, no Ray cluster")
    args = parser.parse_args()
    with Hosts(args.hosts, None if args.no_ray else args.cpus) as hosts:
        for host in hosts.hosts:
            print(f"{host.name}: {host.address}  ip netns exec {host.netns} ...  ({'private' if host.private else 'the driver'})")
        if not args.no_ray:
            print(f"Ray: {hosts.ray_address} (dashboard {hosts.dashboard}); "
                  f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN={hosts.token}")
        print("Ctrl-C (or SIGTERM) ends them.", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, _interrupt)  # also when started in the background, where SIGINT is ignored
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal does not cut the hosts' removal short
            signal.signal(sig, signal.SIG_IGN)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    socket.setdefaulttimeout(30)
    main()
