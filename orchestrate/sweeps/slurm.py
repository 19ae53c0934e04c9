"""A sweep on Slurm (`hydra/launcher=submitit_slurm`), as its launching process follows the jobs.

Measured on a one-node Slurm 22.05 cluster that keeps no accounting (`AccountingStorageType=
accounting_storage/none`, common on small clusters; tests/launch/test_slurm.py), submitit 1.5.4 on
its own:
- asks `sacct` for its jobs' states at every poll; `sacct` fails ("Slurm accounting storage is
  disabled", written to the console by sacct itself) and submitit warns on stdout, on stderr and
  through Hydra's log: four lines every poll, the sweep's summary buried among them;
- with no state to read, never sees a job end that ended without writing its result (`scancel`,
  its time limit, the out-of-memory killer, a lost node): the sweep waited forever;
- and Hydra's launcher collects the results in trial order and raises at the first job without
  one, while the trials after it still run on the cluster.

So, in the launching process of such a sweep, `SlurmJobs` (a Hydra callback beside
`sweep_tracking`, conf/config.yaml) asks `sacct` once whether it answers, and puts
`_squeue.QueueWatcher` in place of submitit's watcher: submitit's own polling where `sacct`
answers, `squeue` where it does not. submitit has no setting for this, so the job class's shared
`watcher` is replaced for the sweep and put back after it. submitit's log records go to
`<sweep dir>/submitit.log` (the first warning also to the console, once, naming the file). After
the launcher raised, `settle()` (called by orchestrate/cli.py before the summary) waits for the
sweep's jobs still on the cluster, or cancels them after Ctrl-C.
"""

import contextlib
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from orchestrate import errors

log = logging.getLogger(__name__)
ROUTED = ("submitit", __name__)  # the loggers whose records go to the sweep's submitit.log
COMMAND_TIMEOUT_S = 60  # one sacct, squeue or scancel call
# Module state: the Slurm sweep this process launched, while it runs (Hydra's launcher returns
# at the first failed job); `settle` (cli.main's end) waits for its jobs and clears it.
_SWEEP: "_Installed | None" = None


def is_slurm(config: DictConfig) -> bool:
    """Whether the sweep's trials run as Slurm jobs (hydra/launcher=submitit_slurm)."""
    return str(OmegaConf.select(config, "hydra.launcher._target_", default="")).endswith(".SlurmLauncher")


class SlurmJobs(Callback):
    """Hydra callback: a `submitit_slurm` sweep's jobs followed with squeue where sacct does not
    answer, submitit's notes in the sweep's log. Other launchers and single runs: nothing."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if is_slurm(config) and not OmegaConf.select(config, "hydra.launcher.dry_run", default=False):
            install(Path(str(config.hydra.sweep.dir)), OmegaConf.select(config, "hydra.launcher.timeout_min"))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        uninstall()


def install(sweep_dir: Path, timeout_min: int | None) -> None:
    """submitit's records to `sweep_dir/submitit.log`, `_squeue.QueueWatcher` in place of its watcher
    (this module stays light: Hydra imports it for every run; submitit is imported here)."""
    global _SWEEP
    if _SWEEP is not None:
        return
    from orchestrate import thirdparty
    from orchestrate.sweeps._squeue import QueueWatcher

    theirs = thirdparty.submitit_slurm_watcher()  # first: importing submitit sets its logger's handlers
    sweep_dir.mkdir(parents=True, exist_ok=True)
    routed = _RoutedLogs(sweep_dir / "submitit.log")
    watcher = QueueWatcher(delay_s=thirdparty.submitit_watch_delay_s(theirs), squeue=not _sacct_answers())
    _SWEEP = _Installed(theirs, watcher, routed, timeout_min)
    thirdparty.submitit_slurm_watcher(watcher)


def uninstall() -> None:
    global _SWEEP
    sweep, _SWEEP = _SWEEP, None
    if sweep is not None:
        from orchestrate.thirdparty import submitit_slurm_watcher

        submitit_slurm_watcher(sweep.previous)
        sweep.routed.close()


@dataclass
class _Installed:
    previous: Any  # submitit's own watcher, put back by `uninstall`
    watcher: Any  # _squeue.QueueWatcher
    routed: "_RoutedLogs"
    timeout_min: int | None  # hydra.launcher.timeout_min: the jobs' time limit


def _sacct_answers() -> bool:
    """Whether `sacct` answers on this cluster (the question submitit will ask at every poll). Where
    it does not, that is the cluster's setting, not a fault: said in the log only."""
    try:
        done = subprocess.run(["sacct", "--noheader", "--parsable2", "--format=JobID", "--starttime=now"],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        why = done.stderr.strip() or f"exit code {done.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        done, why = None, str(e)
    if done is not None and done.returncode == 0:
        return True
    log.info(f"sacct does not answer ({why}): this sweep follows its Slurm jobs with squeue")
    return False


class _RoutedLogs:
    """The `ROUTED` loggers' records to `path` instead of their own handlers (submitit's write to
    stdout and stderr, and pass them on to Hydra's console); the first warning also to the console,
    once, with the file's name. `close` puts the handlers back."""

    def __init__(self, path: Path):
        self.path = path
        self.file = logging.FileHandler(path, delay=True)
        self.file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        self.console = logging.StreamHandler(sys.stderr)
        self.console.addFilter(self._first_warning)
        self.console.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self.warned = False
        self.saved = []
        for name in ROUTED:
            logger = logging.getLogger(name)
            self.saved.append((logger, logger.handlers[:], logger.propagate, logger.level))
            logger.handlers = [self.file, self.console]
            logger.propagate = False
            logger.setLevel(logging.INFO)

    def _first_warning(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or self.warned:
            return False
        self.warned = True
        record.msg, record.args = f"{record.getMessage()} (this and what follows: {self.path})", ()
        return True

    def close(self) -> None:
        for logger, handlers, propagate, level in self.saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
        self.file.close()


def settle(cancel: bool = False) -> None:
    """After a Slurm sweep's launcher stopped (it raises at the first job that ended without a
    result): wait for the sweep's jobs still on the cluster, so that their trials finish and the
    summary shows them as they ended, at most their time limit and 5 minutes more; with `cancel`
    (the sweep was stopped with Ctrl-C), or on Ctrl-C during the wait, cancel them instead. Then
    the sweep's settings are taken back. Nothing for other sweeps."""
    sweep = _SWEEP
    if sweep is None:
        return
    try:
        left = sweep.watcher.unfinished()
        if not left:
            return
        if cancel:
            _cancel(left)
            return
        limit_s = (sweep.timeout_min or 60) * 60 + 300
        print(f"waiting for the sweep's {len(left)} Slurm job(s) still on the cluster ({', '.join(left)}), at most "
              f"{limit_s} s; Ctrl-C cancels them", flush=True)
        deadline = time.monotonic() + limit_s
        try:
            while left and time.monotonic() < deadline:
                time.sleep(2)
                left = sweep.watcher.unfinished()
        except KeyboardInterrupt:
            _cancel(left)
            return
        if left:
            print(f"the sweep's Slurm job(s) {', '.join(left)} still on the cluster after {limit_s} s: left running",
                  flush=True)
    finally:
        uninstall()


@contextlib.contextmanager
def jobs_in_one_line() -> Iterator[None]:
    """A sweep's Slurm job that ended without its result, raised in the block, raised again as
    errors.Failed in one line (`ended_without_result`), with the original as its cause."""
    try:
        yield
    except Exception as e:
        line = ended_without_result(e)
        if line is None:
            raise
        raise errors.Failed(f"the sweep: {line}") from e


def ended_without_result(error: BaseException) -> str | None:
    """submitit's error for a job that ended without writing its result, in one line (its message
    spreads the job, its state and the job's whole stderr over many lines); None for other errors."""
    found = re.search(r"Job (\S+) \(task: \d+\) with path (\S+)\s+has not produced any output \(state: ([^)]*)\)",
                      str(error))
    if type(error).__name__ != "UncompletedJobError" or found is None:
        return None
    job, result, state = found.groups()
    return (f"Slurm job {job} ended {state} without its result (scancel, its time limit, its memory, a lost node); "
            f"its output: {Path(result).parent}")


def _cancel(jobs: list[str]) -> None:
    print(f"cancelling the sweep's Slurm job(s) still on the cluster: {', '.join(jobs)}", flush=True)
    subprocess.run(["scancel", *jobs], timeout=COMMAND_TIMEOUT_S)
