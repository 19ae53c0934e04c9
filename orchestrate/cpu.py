"""The CPU budget: how many cores a run may use, and how they are split between its training
threads and its data loader's processes. One rule for every backend, so that a comparison between
backends says which path is faster and not which one oversubscribed the cores.

The cores (`cores`), the least of:
- the CPUs Ray gave this process, when it is a Ray task or actor: a sweep trial's
  `hydra.launcher.cpus_per_trial`, a runner worker's `backend.cpus_per_worker` (a runner worker in
  the driver's own process is given them by the runner: `Parallel.cores`);
- the affinity mask (taskset, Slurm's cpuset, `docker run --cpuset-cpus`);
- the cgroup's CPU quota (`docker run --cpus`, a Kubernetes limit), rounded down.

The split (`split`):
- the loader's processes, for data read through a torch DataLoader (a map-style Dataset of the
  user's, token shards): a quarter of the cores, at least one from two cores up; on one core none
  (the training process reads its batches itself). Data held in memory has no loader.
- the training threads, the rest (at least one), less the cores that other processes keep busy
  when the run starts (`busy_elsewhere`, sampled for a tenth of a second): torch's intra-op pool
  (`torch.set_num_threads`, which also sizes the OpenMP pool of Inductor's compiled C++ kernels),
  ORT's session intra-op pool (ORTModule, the on-device API). A pool of N runs on the calling thread
  and N - 1 others: N busy, and they wait for each other at every op, so a thread without a core
  of its own holds up the others (measured on 2 cores with 2 other busy processes: PyTorch's two
  threads ran 0.72x one thread's speed, ORTModule's 0.17x). The loader's processes keep their share:
  each is a process of its own that the scheduler gives its slice.
So training threads + loader processes <= cores: no busy thread waits for a core that another of
the run's own holds. What the rule leaves alone: torch's inter-op pool (an eager loop never runs
work on it: only `torch.jit.fork` does), ORT's inter-op pool (ORT runs its graphs sequentially:
one thread), Inductor's compile workers (busy only while the first step compiles, when no training
thread is; Inductor sizes them from the affinity mask).

A user's setting wins: `backend.intra_op_threads=N` (0: the library's own default, one thread
per core), `data.num_workers=N`. The run logs what it ran with as params (`cpu.cores`,
`cpu.threads`, `cpu.loader_processes`) and its summary shows it; `backend=auto` and the shootout's
table say each candidate's.
"""

import math
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Budget:
    cores: int  # the cores the run may use
    source: str  # where that number comes from, in words
    threads: int  # training threads; 0: the library's own default (backend.intra_op_threads=0)
    loader_processes: int  # the data loader's worker processes (0: the training process reads)
    chosen: tuple[str, ...] = ()  # the user's settings that decided a part, e.g. "backend.intra_op_threads=4"

    @property
    def params(self) -> dict[str, str]:
        """The budget as the run's MLflow params."""
        return {"cpu.cores": str(self.cores), "cpu.threads": str(self.threads) if self.threads else "library default",
                "cpu.loader_processes": str(self.loader_processes)}

    @property
    def cell(self) -> str:
        """Short, for a table's cell: `shown`'s, with the user's settings that decided a part."""
        chosen = f" (set: {', '.join(self.chosen)})" if self.chosen else ""
        return shown(self.params) + chosen

    def __str__(self) -> str:
        """e.g. "1 thread + 1 loader process of 2 cores (this machine's)"."""
        threads = "the library's default threads" if not self.threads else \
            f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        loader = f" + {self.loader_processes} loader process{'es' if self.loader_processes > 1 else ''}" \
            if self.loader_processes else ""
        chosen = f"; set: {', '.join(self.chosen)}" if self.chosen else ""
        return f"{threads}{loader} of {self.cores} core{'s' if self.cores > 1 else ''} ({self.source}{chosen})"

    def apply(self) -> None:
        """Size torch's intra-op pool (and with it the OpenMP pool of Inductor's kernels) for the
        run; put back when the run ends (orchestrate.process.kept). ORT's sessions take
        `threads` in their options."""
        import torch

        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def shown(params: dict[str, str]) -> str:
    """A budget from its params (`Budget.params`, a run's cpu.* params): "1 + 1 of 2" (threads +
    loader processes of cores; "default" threads: the library's); "" for a run without them."""
    if "cpu.cores" not in params:
        return ""
    threads = "default" if params["cpu.threads"] == "library default" else params["cpu.threads"]
    return f"{threads} + {params['cpu.loader_processes']} of {params['cpu.cores']}"


def split(cores: int, source: str, reads_ahead: bool, threads: int | None = None,
          loader_processes: int | None = None, busy: int = 0) -> Budget:
    """The rule (see the module): `reads_ahead` when the data has a loader; `threads` and
    `loader_processes` are the user's settings (None: the rule decides); `busy` how many of the
    `cores` other processes keep busy (`budget`: from `busy_elsewhere`)."""
    chosen = []
    if not reads_ahead:
        loader_processes = 0
    elif loader_processes is None:
        loader_processes = max(1, cores // 4) if cores >= 2 else 0
    else:
        chosen.append(f"data.num_workers={loader_processes}")
    if threads is None:
        threads = max(1, cores - busy - loader_processes)
        if busy and threads < cores - loader_processes:
            source += f"; {busy} core{'s' if busy > 1 else ''} busy with other processes"
    else:
        chosen.append(f"backend.intra_op_threads={threads}")
    return Budget(cores, source, threads, loader_processes, tuple(chosen))


def os_cores() -> int:
    """The cores of the affinity mask: those this process's threads may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def busy_elsewhere(seconds: float = 0.1) -> float:
    """How many of the affinity mask's cores other processes kept busy over `seconds`: the busy
    time of those cores (/proc/stat) less this process's and its children's (the loader's: their
    /proc/<pid>/stat). 0.0 where Linux's /proc is not there."""
    def sample() -> tuple[int, int]:
        mask = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        busy = 0
        for line in Path("/proc/stat").read_text().splitlines():
            name, *values = line.split()
            if name in mask:  # user nice system idle iowait irq softirq steal ...
                v = [int(x) for x in values[:8]]
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        own = 0
        for pid in [os.getpid(), *(p.pid for p in multiprocessing.active_children())]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                own += int(fields[11]) + int(fields[12])  # utime, stime (of every thread)
            except (OSError, IndexError, ValueError):
                continue  # a child that just ended
        return busy, own

    try:
        (busy0, own0), began = sample(), time.perf_counter()
        time.sleep(seconds)
        (busy1, own1), took = sample(), time.perf_counter() - began
    except (OSError, ValueError, AttributeError):
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return max(0.0, ((busy1 - busy0) - (own1 - own0)) / ticks / took)


def cores(given: float | None = None) -> tuple[int, str]:
    """The cores this process may use, and where that number comes from (see the module).
    `given`: the CPUs a caller gave it (the runner's in-driver worker: backend.cpus_per_worker)."""
    mask = os_cores()
    found = [(mask, "this machine's cores" if mask == os.cpu_count() else "the affinity mask")]
    quota = cgroup_quota()
    if quota is not None:
        found.append((quota, "the cgroup's CPU quota"))
    ray_cpus = given if given is not None else ray_assigned_cpus()
    if ray_cpus is not None:
        found.append((max(1, int(ray_cpus)), f"the {ray_cpus:g} CPU(s) Ray gave this process"))
    return min(found, key=lambda pair: pair[0])


def ray_assigned_cpus() -> float | None:
    """The CPUs Ray assigned to this process when it is a Ray task or actor (a sweep trial, a
    runner worker), else None. Ray is not imported for this: a process that has not imported it
    is none of them."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except AssertionError:  # Ray's answer in the driver: "only available when the process is a worker"
        return None
    return cpus if cpus else None


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's CPU quota in whole cores (rounded down, at least 1), or None without one.
    cgroup v2's cpu.max ("max 100000": none; "150000 100000": 1.5 cores), v1's cfs files."""
    try:
        if (root / "cpu.max").is_file():
            quota, period = (root / "cpu.max").read_text().split()[:2]
        else:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or not period.isdigit() or int(period) == 0:
        return None
    return max(1, math.floor(int(quota) / int(period)))


def budget(backend, data, given: float | None = None, busy: Callable[[], float] = lambda: 0.0) -> Budget:
    """The budget of a run of `backend` on `data` (built objects): the cores this process may use
    (`given`: what the runner gave an in-driver worker), split by the rule, the user's
    `backend.intra_op_threads` and `data.num_workers` winning. `busy()` measures how many cores
    other processes keep busy (`busy_elsewhere`, a tenth of a second): asked only when the answer
    can change the threads (not for a user's thread count, nor where the rule leaves one thread)."""
    count, source = cores(given)
    reads_ahead = hasattr(data, "use_processes")  # a loader's data (MapData)
    threads, loader = getattr(backend, "intra_op_threads", None), getattr(data, "num_workers", None)
    taken = 0
    if threads is None and split(count, source, reads_ahead, loader_processes=loader).threads > 1:
        free = max(0, os_cores() - round(busy()))  # of the affinity mask's cores, those no other process keeps busy
        taken = max(0, count - free)
    return split(count, source, reads_ahead, threads=threads, loader_processes=loader, busy=taken)
