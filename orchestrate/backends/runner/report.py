"""ray.train.report, off the training loop's path.

Measured with Ray 2.60 (2 workers, 2 cores; `benchmarks/runner.py --report-cost`): a report
costs about 5 ms (every worker meets at a barrier), and a report made before Ray's controller
took the previous one waits for its next poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by
default, 0.1 s as the driver sets it): 103 ms a call with 5 ms of work between reports. So the
loop hands reports to a thread (1-3 ms a call there, median). At display steps a report goes out
only when every worker's thread is idle: one MIN all-reduce decides, so that all workers skip
the same reports (Ray needs every worker to make the same calls). Checkpoint reports are never
skipped.
"""

import os
import queue
import shutil
import tempfile
import threading
from pathlib import Path

from orchestrate.backends.runner.collective import Workers

# The name a reported checkpoint has inside Ray's copy, whatever the engine's format (its
# `load_checkpoint` reads it back).
CHECKPOINT_FILE = "checkpoint"


class Reporter:
    def __init__(self, workers: Workers):
        self.workers, self.pending, self.error = workers, 0, None
        self.lock, self.queue = threading.Condition(), queue.Queue()
        self.thread = threading.Thread(target=self._run, name="ray-train-report", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import ray.train

        while (item := self.queue.get()) is not None:
            metrics, folder = item
            try:
                checkpoint = ray.train.Checkpoint.from_directory(folder) if folder else None
                ray.train.report(metrics, checkpoint=checkpoint)
            except Exception as e:  # raised again on the training thread (close, or a checkpoint's wait)
                with self.lock:
                    self.error = e
                    self.lock.notify_all()
                return
            finally:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
            with self.lock:
                self.pending -= 1
                self.lock.notify_all()

    def _put(self, metrics: dict, folder: str | None = None) -> None:
        with self.lock:
            self.pending += 1
        self.queue.put((metrics, folder))

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        """At a display step, on every worker (the meter's `on_display`)."""
        if self.workers.agree(not self.pending):
            self._put({"step": step, "train/loss": metrics.get("train/loss")})

    def checkpoint(self, step: int, path: Path | None) -> None:
        """At a checkpoint step, on every worker (the checkpoints' `on_save`); `path` is rank 0's
        checkpoint file, None on the others."""
        folder = None
        if path is not None:  # a folder holding just this file, for Ray to copy to its storage
            folder = tempfile.mkdtemp(prefix=".report_", dir=path.parent)
            os.link(path, Path(folder) / CHECKPOINT_FILE)  # same file system: no second copy
        self._put({"step": step}, folder)
        # Training goes on only once Ray's controller holds the checkpoint: a worker that dies a
        # few steps later must restart from it, not from the one before. A report returns when it
        # is in the worker's one-place result queue, that is once the controller took the report
        # before it; so a second report (every worker makes it: Ray needs the same calls on all)
        # returns once the checkpoint's was taken. About one controller poll (0.1 s) a checkpoint.
        self._put({"step": step})
        with self.lock:
            self.lock.wait_for(lambda: self.pending == 0 or self.error is not None)
        if self.error is not None:
            raise self.error

    def close(self, raise_error: bool = True) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None and raise_error:
            raise self.error
