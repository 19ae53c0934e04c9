"""The Ray launcher's work, imported by `hydra_plugins.orchestrate_ray_launcher` only when a sweep
launches: compose every job's config, start or join Ray, make sure a job can be placed, run each
job as a Ray task (Hydra's `run_job` in the worker, Hydra's global state restored as the joblib and
ray launchers do), collect the results as they come, and return once every job's printed output
has reached this console.

Generic: nothing here knows the app it runs; of orchestrate it uses `ray_cluster` alone.
"""

import collections
import contextlib
import ctypes
import functools
import logging
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, open_dict

from orchestrate import thirdparty
from orchestrate.cluster import ray_cluster, runtime

log = logging.getLogger(__name__)
OUTPUT_WAIT_S = 10.0  # longest wait, once the jobs are done, for their last lines to reach this console
CANCEL_WAIT_S = 10.0  # longest wait, with fail_fast, for the cancelled jobs to end
END_OF_OUTPUT = ":orchestrate_end_of_output:"  # opens the marker a job writes last on stdout and stderr


class RemoteTraceback(Exception):
    """The cause shown under a TrialError: the job's traceback as its Ray worker printed it."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0]}"""'


class TrialError(RuntimeError):
    """A job's exception as text ("ValueError: boom") with its worker's traceback as the cause. It
    travels back from the Ray worker as text whatever the original type: an exception class that
    cannot be pickled or rebuilt here would otherwise replace the job's error with a pickling one."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)

    def __reduce__(self):
        return TrialError, (str(self), self.remote_traceback)

    @classmethod
    def of(cls, e: BaseException) -> "TrialError":
        return cls(f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e)))


class TrialLost(TrialError):
    """The job's process died under it (its worker killed, its node or the cluster's head lost):
    not a failure of the job itself. An asynchronous sweeper runs its point again."""

    def __reduce__(self):
        return TrialLost, (str(self), self.remote_traceback)


def _run_job(hydra_context, task_function, sweep_config: DictConfig, singleton_state: dict,
             end_marker: Optional[str], cwd: Optional[str] = None) -> tuple[JobReturn, float]:
    """Runs in a Ray worker: restore Hydra's global state as the driver has it, run the job in its
    own folder (Hydra's callbacks' on_job_start/on_job_end run here), then mark the end of its
    output (see OutputBarrier). `cwd`: the launching command's folder, where relative paths (the
    sweep's output folder, a relative store) mean what they mean to the user; a worker of a Ray
    started elsewhere (the warm head of `orchestrate up`) runs in the folder the head started
    in. Kept where that folder does not exist (a node of a remote cluster). Returns the job's
    JobReturn and its seconds on this worker (the time it waited in Ray's queue left out)."""
    before, began = os.getcwd(), time.perf_counter()
    try:
        if cwd is not None and os.path.isdir(cwd):
            os.chdir(cwd)
        setup_globals()
        Singleton.set_state(singleton_state)
        HydraConfig.instance().set_config(sweep_config)
        ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        if ret.status == JobStatus.FAILED:
            ret.return_value = TrialError.of(thirdparty.job_error(ret))
        return ret, time.perf_counter() - began
    finally:
        os.chdir(before)
        _write_end_marker(end_marker)


def _write_end_marker(marker: Optional[str]) -> None:
    """Write `marker` as the last line of this worker's stdout and stderr, after everything the job
    wrote there (Python's buffers and C's stdio buffers, for libraries printing from C/C++)."""
    if marker is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
    for fd in (1, 2):  # the descriptors Ray's log monitor tails, whatever sys.stdout is now
        with contextlib.suppress(OSError):
            os.write(fd, f"{marker}\n".encode())


@dataclass
class SweepJob:
    """One job of the sweep: its index (hydra.job.num), its overrides and, once composed, its config."""

    idx: int
    overrides: list[str]
    config: Optional[DictConfig] = None

    def compose(self, launcher) -> DictConfig:
        """The job's config, as Hydra's launchers compose it (the sweep's config with its overrides)."""
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, self.overrides)
        with open_dict(config):
            config.hydra.job.id = f"{config.hydra.job.name}_{self.idx}"
            config.hydra.job.num = self.idx
        self.config = config
        return config

    @property
    def shown(self) -> str:
        return " ".join(filter_overrides(self.overrides))


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
    """One JobReturn per job, in the order of `job_overrides`; a failed job's return value is a
    TrialError (raised at once with fail_fast). Raises PlacementError when a job cannot be placed.
    Calls may overlap (an asynchronous sweeper launches each trial from its own thread as a slot
    frees): Ray is started and the placement checked once, and the jobs' output shares one barrier."""
    setup_globals()
    assert launcher.config is not None and launcher.hydra_context is not None
    assert launcher.task_function is not None
    conf = launcher.conf
    # Each job's config is composed just before it is submitted (`run`), not all of them before
    # the first starts: Hydra composes a config in about 0.1 s, minutes for a grid of thousands.
    jobs = [SweepJob(initial_job_idx + i, list(overrides)) for i, overrides in enumerate(job_overrides)]
    if conf.dry_run:
        check_launcher(conf)
        print_plan(jobs, conf, resources_of(conf))
        return [JobReturn(overrides=j.overrides, status=JobStatus.COMPLETED) for j in jobs]
    ready(launcher)
    log.info(f"Launching {len(jobs)} job(s) on Ray ({where(conf)}), each asking for "
             f"{resources_of(conf) or 'no resources'}; sweep output dir : {launcher.config.hydra.sweep.dir}")
    for job in jobs:
        log.info(f"\t#{job.idx} : {job.shown}")
    with shared_barrier() as barrier:
        return run(jobs, launcher, barrier)


def resources_of(conf) -> dict:
    return {k: v for k, v in (("CPU", conf.cpus_per_trial), ("GPU", conf.gpus_per_trial)) if v}


# Module state: held while a launcher starts Ray and checks the placement (the asynchronous Optuna
# sweeper launches from several threads of one process); held only within a call.
_READY = threading.Lock()


def ready(launcher) -> None:
    """Once per launcher: Hydra's logging, the settings checked, the sweep folder, Ray started or
    joined, and one job's resources seen free somewhere (or PlacementError)."""
    with _READY:
        if getattr(launcher, "ready", False):
            return
        cfg, conf = launcher.config, launcher.conf
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        check_launcher(conf)
        Path(str(cfg.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        before_ray_import()
        if conf.address and conf.num_cpus is not None:
            log.warning(f"hydra.launcher.num_cpus={conf.num_cpus} is ignored: it sizes a new local Ray instance, "
                        f"and hydra.launcher.address={conf.address} joins a running cluster")
        began = time.perf_counter()
        # With no address: the warm head of the runtime the command's entry entered, if any.
        started = ray_cluster.init(conf.address, "hydra.launcher.address", runtime.current(), num_cpus=conf.num_cpus)
        import ray  # after ray_cluster.init: the loopback setting is read when ray is imported

        if started:
            log.info(f"Ray ready (waited {time.perf_counter() - began:.1f} s for it): {ray.cluster_resources()}")
        asked = " ".join(f"hydra.launcher.{key}={getattr(conf, key):g}" for key in ("cpus_per_trial", "gpus_per_trial")
                         if getattr(conf, key)) + ": a trial"
        ray_cluster.wait_for_placement([resources_of(conf)], "PACK", conf.placement_timeout_s, asked,
                                       "hydra.launcher.placement_timeout_s")
        launcher.ready = True


def before_ray_import() -> None:
    """Settings Ray reads when it is imported (a sweep may import it early: see ray_cluster.init_in_background)."""
    if "ray" not in sys.modules:
        # Ray's driver folds lines that look alike across workers into "[repeated Nx across
        # cluster]": the jobs of a sweep print alike lines, and all but one job's would be hidden.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def check_launcher(conf) -> None:
    """Refuse settings Ray would reject deep inside, or wait forever on."""
    for key in ("cpus_per_trial", "gpus_per_trial", "num_cpus"):
        value = getattr(conf, key)
        if value is not None and value < 0:
            raise ValueError(f"hydra.launcher.{key}={value}: must be 0 or more")
    if conf.placement_timeout_s <= 0:
        raise ValueError(f"hydra.launcher.placement_timeout_s={conf.placement_timeout_s}: must be above 0")


def run(jobs: list[SweepJob], launcher, barrier: "OutputBarrier") -> list[JobReturn]:
    """Submit every job, then take the results as they come; with fail_fast, cancel the rest and
    raise at the first failure."""
    import ray

    conf = launcher.conf
    remote = _remote_run_job(conf.process_per_trial)
    options = dict(num_cpus=conf.cpus_per_trial, num_gpus=conf.gpus_per_trial, max_retries=0)
    # Shipped once to the object store, not once per job.
    shared = [ray.put(launcher.hydra_context), ray.put(launcher.task_function)]
    state = ray.put(Singleton.get_state())
    waiting = collections.deque(jobs)
    pending: dict = {}
    returns: dict[int, JobReturn] = {}
    marked: list[int] = []  # jobs whose worker wrote the end of its output

    def submit_more(ahead: int) -> None:
        """Compose and submit jobs until `ahead` are submitted and not done (or none is left). A
        task's name prefixes its lines on this console: "(#3 pid=4242) ..." is job #3's. A job
        whose config does not compose fails alone (with fail_fast, the sweep stops on it)."""
        while waiting and len(pending) < ahead:
            job = waiting.popleft()
            try:
                config = job.compose(launcher)
            except Exception as e:
                returns[job.idx] = JobReturn(overrides=job.overrides, status=JobStatus.FAILED,
                                             _return_value=TrialError.of(e))
                log.error(f"\t#{job.idx} : {job.shown} FAILED: its config does not compose: {e}")
                if conf.fail_fast:
                    stop()
                    raise
                continue
            ref = remote.options(name=f"#{job.idx}", **options).remote(*shared, config, state, barrier.marker(job.idx),
                                                                      os.getcwd())
            pending[ref] = job
            launcher.in_flight.add(ref)

    def stop() -> None:
        """fail_fast: the jobs not done are cancelled (running ones ended), the rest never start."""
        for other in [*pending.values(), *waiting]:
            log.warning(f"\t#{other.idx} : {other.shown} CANCELLED (hydra.launcher.fail_fast=true)")
        cancel(list(pending))
        barrier.wait(marked)

    # Jobs queued beyond those running, so that a slot that frees up finds its next job waiting;
    # the rest are composed as jobs end. A cluster that may grow (an autoscaler) sees every job.
    fixed = not ray_cluster.can_grow() and (conf.cpus_per_trial or conf.gpus_per_trial)
    ahead = max(4, 2 * slots(conf)) if fixed else len(jobs)
    submit_more(1)  # the first job starts before the others are composed
    submit_more(ahead)
    began = time.perf_counter()
    head = ray_cluster.HeadWatch()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=ray_cluster.HEAD_PROBE_S)
        if not done:
            head.check()  # HeadLost: its jobs' runs are closed by the sweep's callbacks as it ends
            continue
        (ref,) = done
        job = pending.pop(ref)
        launcher.in_flight.discard(ref)
        ret, seconds, wrote_marker, died = collect(ref, job)
        returns[job.idx] = ret
        if died and job.config is not None:
            # Its worker died (its host lost, killed): the job's own on_job_end never ran there.
            # Hydra's callbacks hear of it here instead (orchestrate's closes the trial's run FAILED).
            launcher.hydra_context.callbacks.on_job_end(config=job.config, job_return=ret)
        if wrote_marker:
            marked.append(job.idx)
        if ret.status == JobStatus.COMPLETED:
            log.info(f"\t#{job.idx} : {job.shown} COMPLETED in {seconds:.1f} s on its worker "
                     f"({time.perf_counter() - began:.1f} s into this launch)")
            submit_more(ahead)
            continue
        log.error(f"\t#{job.idx} : {job.shown} FAILED: {thirdparty.job_error(ret)}")
        if conf.fail_fast:
            stop()
            raise thirdparty.job_error(ret)
        submit_more(ahead)
    barrier.wait(marked)
    return [returns[job.idx] for job in jobs]


def cancel_in_flight(launcher) -> None:
    """Cancel every job this launcher submitted that has not returned (all its `launch` calls)."""
    refs, launcher.in_flight = list(launcher.in_flight), set()
    if refs:
        cancel(refs)


def queued(conf) -> int:
    """How many jobs beyond `slots` an asynchronous sweeper keeps launched: they wait in Ray's
    queue and start the moment a slot frees, with no round trip through the driver (its result
    told, the next trial asked and composed) between one trial and the next. On a cluster with an
    autoscaler they are demand like any task (a node it adds takes trials too). None for jobs that
    ask for no CPU or GPU: Ray would run them at once, beside the slots."""
    if not (conf.cpus_per_trial or conf.gpus_per_trial):
        return 0
    return max(1, slots(conf) // 2)


def slots(conf) -> int:
    """How many jobs the cluster can run at once, by the CPUs and GPUs each asks for."""
    import ray

    total = ray.cluster_resources()
    fits = [total.get(key, 0) / asked for key, asked in (("CPU", conf.cpus_per_trial), ("GPU", conf.gpus_per_trial))
            if asked]
    return max(1, int(min(fits))) if fits else 1


def cancel(refs: list, wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancel jobs and wait (up to wait_s) until each has ended, so that their CPUs are free when
    the launcher returns. Ray cancels asynchronously, and a cancel that meets a job while a worker
    is being leased for it can miss: the job then starts anyway. Cancelling again whatever is
    still not ended catches those (force=True kills a running job's worker)."""
    import ray

    deadline = time.monotonic() + wait_s
    while refs and time.monotonic() < deadline:
        for ref in refs:
            ray.cancel(ref, force=True)
        _, refs = ray.wait(refs, num_returns=len(refs), timeout=0.5)
    if refs:
        log.warning(f"{len(refs)} cancelled job(s) had not ended after {wait_s:g} s")


@functools.cache
def _remote_run_job(process_per_trial: bool = False):
    """`_run_job` as a Ray remote function, made once: Ray exports a function each time one is
    made (and warns past 100), and an Optuna sweep launches once per batch. `process_per_trial`:
    its worker exits after the job, so that the next starts in a new process (Ray's max_calls,
    which only the function's own options take)."""
    import ray

    return ray.remote(max_calls=1)(_run_job) if process_per_trial else ray.remote(_run_job)


def collect(ref, job: SweepJob) -> tuple[JobReturn, float, bool, bool]:
    """The job's JobReturn, or a FAILED one when Ray itself failed (the worker died, the result
    could not be serialized); its seconds on its worker (0 when Ray failed); whether the worker got
    to mark the end of the job's output; and whether the job's process died under it (its worker
    or its node lost, not a cancel)."""
    import ray

    try:
        ret, seconds = ray.get(ref)
        return ret, seconds, True, False
    except ray.exceptions.RayTaskError as e:  # raised in _run_job, around the job: its finally ran
        cause = e.cause if e.cause is not None else e
        error, marked, died = TrialError(f"{type(cause).__name__}: {cause}", str(e)), True, False
    except ray.exceptions.RayError as e:  # the worker died (or its node), or the job was cancelled
        died, marked = not isinstance(e, ray.exceptions.TaskCancelledError), False
        # Which trial, and what it lost (Ray's own words name neither): its run ends FAILED, and
        # the same command runs the sweep on (the study's other trials).
        lost = f"trial #{job.idx} ({job.shown}) lost its process (killed, or its node gone): " if died else ""
        error = (TrialLost if died else TrialError)(f"{lost}{type(e).__name__}: {str(e).splitlines()[0]}")
    return JobReturn(overrides=job.overrides, cfg=job.config, status=JobStatus.FAILED, _return_value=error), 0.0, \
        marked, died


def where(conf) -> str:
    """Where the jobs run (or would): "local, 2 CPUs in all", "auto, 64 CPUs in all", "local, all CPUs"."""
    place = conf.address or os.environ.get("RAY_ADDRESS") or "local"
    ray = sys.modules.get("ray")  # a dry run imports no Ray
    if ray is not None and ray.is_initialized():
        return f"{place}, {ray.cluster_resources().get('CPU', 0):g} CPUs in all"
    if place == "local":
        return f"local, {'all' if conf.num_cpus is None else conf.num_cpus} CPUs"
    return place


def print_plan(jobs: list[SweepJob], conf, resources: dict) -> None:
    print(f"plan: {len(jobs)} trial(s) on Ray ({where(conf)}), each asking for {resources or 'no resources'}"
          f"{', fail fast' if conf.fail_fast else ''}; dry run: nothing is run")
    for job in jobs:
        print(f"\t#{job.idx} : {job.shown}")
    sys.stdout.flush()


# Module state: [the OutputBarrier in use, how many launches use it], shared by the concurrent
# launches of one sweep (one barrier orders their trials' output); the last launch to end removes it.
_BARRIER_LOCK = threading.Lock()
_BARRIER: list = []


@contextlib.contextmanager
def shared_barrier():
    """The OutputBarrier of the launches running now: the first one in taps Ray's output, the
    last one out puts it back (overlapping taps would wrap Ray's printer in each other)."""
    with _BARRIER_LOCK:
        if not _BARRIER:
            _BARRIER[:] = [OutputBarrier().__enter__(), 0]
        _BARRIER[1] += 1
        barrier = _BARRIER[0]
    try:
        yield barrier
    finally:
        with _BARRIER_LOCK:
            _BARRIER[1] -= 1
            if not _BARRIER[1]:
                _BARRIER.pop(0).__exit__(None, None, None)
                _BARRIER.clear()


class OutputBarrier:
    """Makes the launcher return only once every job's printed output has reached this console.

    Ray ships what jobs print to the driver asynchronously (a log monitor tails each worker's
    stdout and stderr files and publishes new lines; a thread here prints them), so without this
    the last lines of a sweep's jobs arrive after the launcher has returned, e.g. after a summary
    printed by an `on_multirun_end` callback. Each job writes a marker line last on its stdout and
    stderr (`_write_end_marker`); each file's lines arrive in order, so once both markers of every
    finished job have come through, all of their output has been printed. The markers themselves
    are taken out before Ray prints the lines. Output stays live: nothing is held back."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex  # this launch's markers, not an earlier one's
        self.seen: collections.Counter = collections.Counter()
        self.changed = threading.Condition()
        self.release: Optional[Callable[[], None]] = None

    def __enter__(self) -> "OutputBarrier":
        self.release = thirdparty.tap_ray_worker_output(self._take_markers, self._saw)
        return self

    def __exit__(self, *exc) -> None:
        if self.release is not None:
            self.release()

    def marker(self, idx: int) -> Optional[str]:
        """The marker job `idx` writes last; None when this driver prints no worker output."""
        return f"{END_OF_OUTPUT}{self.token}:{idx}" if self.release is not None else None

    def _take_markers(self, lines: list[str]) -> tuple[list[str], list[str]]:
        """(the lines without markers, the markers found). A job whose last line had no newline
        gets the marker at the end of that line: the text before it is kept."""
        kept, found = [], []
        for line in lines:
            at = line.find(END_OF_OUTPUT)
            if at < 0:
                kept.append(line)
                continue
            found.append(line[at:].strip())
            if line[:at]:
                kept.append(line[:at])
        return kept, found

    def _saw(self, markers: list[str]) -> None:
        with self.changed:
            self.seen.update(markers)
            self.changed.notify_all()

    def wait(self, indices: list[int]) -> None:
        """Wait (at most OUTPUT_WAIT_S) until jobs `indices` have both markers through."""
        if self.release is None or not indices:
            return
        wanted = [self.marker(i) for i in indices]
        with self.changed:
            done = self.changed.wait_for(lambda: all(self.seen[m] >= 2 for m in wanted), timeout=OUTPUT_WAIT_S)
            late = [i for i, m in zip(indices, wanted) if self.seen[m] < 2]
        if not done:
            log.warning(f"the last output of job(s) {', '.join(f'#{i}' for i in late)} has not reached this console "
                        f"after {OUTPUT_WAIT_S:g} s; it may follow")
