"""The CPU budget (orchestrate/cpu.py): one rule splits a run's cores between its training threads
and its data loader's processes, whatever the backend; a user's setting wins; the cores are what
the affinity mask, the cgroup's quota and Ray allow."""

import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset

from orchestrate import cpu, process
from orchestrate.job import Job
from tests.conftest import BACKENDS


class Rows(Dataset):
    """A map-style Dataset of the synthetic task's shape (16 features, 4 classes): a loader reads it."""

    def __init__(self, n: int = 512, num_features: int = 16, num_classes: int = 4, **kwargs):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, num_features, generator=g)
        self.y = (self.x[:, :num_classes].argmax(1)).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


MAP_DATA = f"data._target_={__name__}.Rows"


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("reads_ahead", [False, True])
def test_the_rule_never_puts_more_busy_threads_than_cores(cores, reads_ahead):
    budget = cpu.split(cores, "test", reads_ahead=reads_ahead)
    assert budget.threads >= 1 and budget.threads + budget.loader_processes == max(cores, 1)
    # A loader from two cores up, a quarter of them; data in memory has none, one core reads itself.
    assert budget.loader_processes == (max(1, cores // 4) if reads_ahead and cores >= 2 else 0)
    assert budget.chosen == ()


def test_cores_that_other_processes_keep_busy_are_not_the_threads():
    """A thread pool's threads wait for each other at every op: one without a core of its own
    holds the others up. The loader keeps its share (a process of its own gets its slice)."""
    assert cpu.split(8, "x", reads_ahead=False, busy=3).threads == 5
    budget = cpu.split(2, "this machine's cores", reads_ahead=True, busy=2)
    assert (budget.threads, budget.loader_processes) == (1, 1)
    assert budget.source == "this machine's cores"  # the threads are the rule's anyway
    assert cpu.split(2, "this machine's cores", reads_ahead=False, busy=2).source == \
        "this machine's cores; 2 cores busy with other processes"
    assert cpu.split(2, "x", reads_ahead=False, threads=2, busy=2).threads == 2  # the user's setting still wins


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="sized for this project's 2-core machines")
def test_two_busy_processes_on_two_cores_leave_one_thread(make_cfg):
    """Measured, not assumed: two CPU-bound processes running, the machine's busy time (less this
    process's) says two cores are taken, and a run's budget is one thread."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.3)
        busy = cpu.busy_elsewhere(0.3)
        job = Job.build(make_cfg("backend=torch"))
        budget = job.backend.budget(job)
    finally:
        for p in spinning:
            p.kill()
            p.wait(timeout=30)
    assert 1.5 < busy < 2.5
    assert (budget.threads, budget.loader_processes, budget.cores) == (1, 0, 2)
    assert cpu.busy_elsewhere() < 1.5  # their cores free again


def test_a_users_setting_wins_and_the_budget_says_so():
    budget = cpu.split(2, "this machine's cores", reads_ahead=True, threads=4)
    assert (budget.threads, budget.loader_processes) == (4, 1)  # the loader keeps the rule's share
    assert budget.chosen == ("backend.intra_op_threads=4",)
    budget = cpu.split(8, "this machine's cores", reads_ahead=True, loader_processes=6)
    assert (budget.threads, budget.loader_processes) == (2, 6)  # the threads take what the loader leaves
    assert str(budget) == "2 threads + 6 loader processes of 8 cores (this machine's cores; set: data.num_workers=6)"
    library = cpu.split(2, "x", reads_ahead=False, threads=0)
    assert library.params == {"cpu.cores": "2", "cpu.threads": "library default", "cpu.loader_processes": "0"}
    assert library.cell == "default + 0 of 2 (set: backend.intra_op_threads=0)"


@pytest.mark.parametrize(("files", "expected"), [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1),  # 1.5 cores: rounded down
    ({"cpu.max": "400000 100000\n"}, 4),
    ({"cpu.max": "50000 100000\n"}, 1),  # half a core: still one thread
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # cgroup v1, no quota
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({}, None),
])
def test_the_cgroup_quota_is_read_in_whole_cores(files, expected, tmp_path):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu.cgroup_quota(tmp_path) == expected


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow the mask to one")
def test_the_affinity_mask_is_the_cores_a_run_may_use():
    """taskset, Slurm's cpuset, docker --cpuset-cpus: a process on one core of the machine's runs
    one thread and reads in-process."""
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mask)})
    try:
        assert cpu.cores() == (1, "the affinity mask")
        assert cpu.split(*cpu.cores(), reads_ahead=True).loader_processes == 0
    finally:
        os.sched_setaffinity(0, mask)
    assert cpu.cores()[0] == len(mask)


def test_a_ray_task_gets_the_cpus_ray_gave_it(ray_shared):
    """A sweep trial on the Ray launcher (hydra.launcher.cpus_per_trial) and a runner worker
    (backend.cpus_per_worker) are Ray tasks and actors: their budget is Ray's CPUs, not the
    machine's (two trials of one CPU each on two cores: one thread each)."""
    import ray

    @ray.remote(num_cpus=1)
    def found():
        from orchestrate import cpu

        return cpu.cores()

    assert ray.get(found.remote(), timeout=120) == (1, "the 1 CPU(s) Ray gave this process")
    assert cpu.cores(given=1.5) == (1, "the 1.5 CPU(s) Ray gave this process")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_splits_this_machines_cores_by_the_rule(backend, make_cfg):
    """The split each backend trains with on this machine, on data a loader reads: threads +
    loader processes never above the cores (the runner's: one worker's backend.cpus_per_worker)."""
    job = Job.build(make_cfg(f"backend={backend}", MAP_DATA))
    budget = job.backend.budget(job)
    cores = int(job.backend.cpus_per_worker) if job.backend.distributed else len(os.sched_getaffinity(0))
    assert budget.cores == cores
    assert budget.threads >= 1 and budget.threads + budget.loader_processes <= budget.cores
    assert budget.loader_processes == (max(1, cores // 4) if cores >= 2 else 0)
    taken = max(0, cores - max(0, len(os.sched_getaffinity(0)) - round(job.busy or 0)))  # busy elsewhere, if measured
    assert budget.threads == max(1, cores - taken - budget.loader_processes)


@pytest.mark.parametrize("backend", ["torch", "ondevice"])
def test_the_loop_runs_with_its_budgets_threads_and_loader_processes(backend, make_cfg, tmp_path):
    """Measured inside the loop, at each display step: torch's thread pool and the loader's live
    processes are the budget's; afterwards the process has its own thread count back."""
    before = torch.get_num_threads()
    job = Job.prepare(make_cfg(f"backend={backend}", MAP_DATA, "trainer.max_steps=20"), tmp_path)
    seen = []
    job.meter.on_display = lambda step, metrics: seen.append((torch.get_num_threads(),
                                                              len(multiprocessing.active_children())))
    with process.kept():
        job.backend.fit(job)
    job.close_data()
    cores = len(os.sched_getaffinity(0))
    budget = cpu.split(cores, "", reads_ahead=True, busy=max(0, cores - max(0, cores - round(job.busy or 0))))
    assert (job.cpu.threads, job.cpu.loader_processes) == (budget.threads, budget.loader_processes)
    assert set(seen) == {(budget.threads, budget.loader_processes)}
    assert torch.get_num_threads() == before
