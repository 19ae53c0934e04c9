"""The runner's tracking across hosts: rank 0 may run on any host of a Ray cluster, and whatever it
logs reaches the MLflow run the driver opened through the driver's own machine, as Ray Tune's
`MLflowLoggerCallback` logs from the driver. The workers need no access to the tracking store:
a SQLite file beside the driver, or a server on the driver's 127.0.0.1, is as good as a team's
server that every host reaches.

    driver's node:  RunRelay (a Ray actor, no CPUs)  ->  RunLogger -> outbox -> MLflow
    any node:       rank 0's RelayedLogger  ->  RunRelay   (Ray's own connection)

The actor is placed on the driver's node (where the store is) and lives as long as the driver's
`fit`: a worker group restarted after a failure, or resized, logs into the same relay. Calls from
one worker run in the order it made them (Ray runs one caller's calls to an actor in order), and
the actor keeps the outbox's promises (in order, exactly once, nothing lost while the server is
away: what it never took is written to `mlflow_unsent.jsonl` in the driver's output folder).
Files (checkpoints, ONNX models, TensorBoard's folder) travel as bytes in Ray's object store,
read and sent from a thread of rank 0's, and are written beside the driver before they are
logged. Training waits only where it waited before: a checkpoint's flush, the history a
restarted rank 0 carries on, and the end.

A sweep's trials on other hosts report back another way (orchestrate.sweeps.remote: the sweep
serves its MLflow store and Optuna study on the network), for reasons both ways state in
docs/cluster.md ("How results get back to the driver"): the runner always has Ray's connection
and one run whose store may be a server-less SQLite file; a sweep's trials may run without Ray
(Slurm jobs) and each is a run of its own.
"""

import logging
import queue
import shutil
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

from orchestrate.tracking.logger import stage

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 300.0  # a relay call that answers (flush, history); the end waits as long as the outbox's close
GONE = "the run's tracking relay on the driver's node"
RELAY_STAGING = ".mlflow_relay"  # rank 0's files waiting to go to the relay, in its output folder on its host


def start(uri: str, run_id: str, out_dir: Path, eval_dataset: tuple[str, str] | None):
    """The relay for run `run_id` of the store at `uri`, on this process's own Ray node (the
    driver's), taking no CPU from the workers. `eval_dataset`: the eval split's (name, digest) as
    the driver logged the run's inputs (the models' metrics name it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0, max_concurrency=1)(RunRelay)  # one call at a time: in the order made
    return actor.options(scheduling_strategy=here).remote(uri, run_id, str(out_dir), eval_dataset)


def stop(relay) -> None:
    """The relay's end (after the workers' own, or after they failed): what was left is sent or
    kept, then the actor goes."""
    import ray

    try:
        ray.get(relay.close.remote(), timeout=CALL_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as e:  # gone with its node, or stuck: what it kept is its file
        log.warning(f"{GONE} did not end in time ({type(e).__name__})")
    finally:
        ray.kill(relay)


class RunRelay:
    """On the driver's node: one RunLogger into the driver's run, fed by rank 0's calls."""

    def __init__(self, uri: str, run_id: str, out_dir: str, eval_dataset: tuple[str, str] | None):
        from orchestrate import ort
        from orchestrate.tracking.logger import RunLogger

        ort.load()  # what ORT's import prints (a model's logging imports it) stays off the console

        self.logger = RunLogger(uri, run_id, out_dir=Path(out_dir))
        self.logger.eval_dataset = eval_dataset
        self.files = Path(tempfile.mkdtemp(prefix=f"relay-{run_id[:8]}-"))
        self.count, self.closed, self.refused = 0, False, []

    def _written(self, name: str, content: bytes | dict[str, bytes]) -> Path:
        """A file (bytes) or folder (relative path -> bytes) sent by rank 0, written here."""
        self.count += 1
        path = self.files / f"{self.count:06d}" / name
        if isinstance(content, dict):
            for relative, data in content.items():
                (path / relative).parent.mkdir(parents=True, exist_ok=True)
                (path / relative).write_bytes(data)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        return path

    def _done_with(self, path: Path) -> None:
        shutil.rmtree(path.parent, ignore_errors=True)  # the logger staged its own link or copy

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.logger.set_tags(tags)

    def log_artifact(self, name: str, content, artifact_path: str | None) -> None:
        path = self._written(name, content)
        (self.logger.log_artifacts if isinstance(content, dict) else self.logger.log_artifact)(path, artifact_path)
        self._done_with(path)

    def log_model(self, name: str, content: bytes, sample, step: int, register, model_name: str) -> None:
        path = self._written(name, content)
        self.logger.log_model(path, sample, step, register, name=model_name)
        self._done_with(path)

    def flush(self) -> bool:
        return self.logger.flush()

    def logged_history(self) -> dict[str, list[tuple[int, float]]]:
        self.logger.flush()  # what earlier calls logged is in the store before the store is read
        return self.logger.logged_history()

    def close(self) -> list[str]:
        if not self.closed:
            self.closed = True
            self.logger.close()
            self.refused = list(self.logger.not_registered)
            shutil.rmtree(self.files, ignore_errors=True)
        return self.refused


class RelayedLogger:
    """Rank 0's logger on any host: RunLogger's calls, made on the driver's node by the relay.
    The calls go out from one thread of their own, in the order they were made: a file is staged
    (a hard link, as RunLogger stages it) and read and sent from there, so that a checkpoint step
    does not wait for its file's bytes (measured: 117 ms for a 100 MB file on the calling thread)."""

    def __init__(self, relay, run_id: str, staging: Path):
        self.relay, self.run_id, self.staging, self.staged = relay, run_id, staging, 0
        self.not_registered: list[str] = []
        self.calls: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._send, name=f"run-relay-{run_id[:8]}", daemon=True)
        self.thread.start()

    def _send(self) -> None:
        while (call := self.calls.get()) is not None:
            try:
                call()
            except Exception as e:  # noqa: BLE001 - one item lost, said; the run trains on
                log.warning(f"a call to {GONE} was not made ({type(e).__name__}: {e})")

    def _ask(self, method: str, what: str):
        """A relay call whose answer is waited for, after every call made before it."""
        import ray

        sent: Future = Future()
        self.calls.put(lambda: sent.set_result(getattr(self.relay, method).remote()))
        try:
            return ray.get(sent.result(timeout=CALL_TIMEOUT_S), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, TimeoutError):
            raise TimeoutError(f"{GONE} did not answer ({what}) within {CALL_TIMEOUT_S:g} s") from None

    def _file(self, method: str, path: Path, *args) -> None:
        """A file or folder, sent as bytes from the thread: `method(name, content, *args)`."""
        self.staged += 1
        staged = stage(Path(path), self.staging / f"{self.staged:06d}")

        def send() -> None:
            try:
                content = staged.read_bytes() if staged.is_file() else \
                    {str(p.relative_to(staged)): p.read_bytes() for p in sorted(staged.rglob("*")) if p.is_file()}
                getattr(self.relay, method).remote(staged.name, content, *args)
            finally:
                shutil.rmtree(staged.parent, ignore_errors=True)

        self.calls.put(send)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        self.calls.put(lambda: self.relay.log_metrics.remote(metrics, step))

    def set_tags(self, tags: dict[str, str]) -> None:
        tags = {k: str(v) for k, v in tags.items()}
        self.calls.put(lambda: self.relay.set_tags.remote(tags))

    def log_datasets(self, data, name: str, record: bool = True) -> None:
        """Nothing to do: the driver logged the splits as the run's inputs, and handed the relay
        the eval split's name and digest (RunLogger.log_datasets with record=False notes them)."""

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._file("log_artifact", path, artifact_path)

    def log_artifacts(self, folder: Path, artifact_path: str | None = None) -> None:
        self._file("log_artifact", folder, artifact_path)

    def log_model(self, path: Path, sample, step: int, register=None, name: str = "model") -> None:
        self._file("log_model", path, sample, step, register, name)

    def flush(self) -> bool:
        return self._ask("flush", "a flush before a checkpoint")

    def logged_history(self) -> dict[str, list[tuple[int, float]]]:
        return self._ask("logged_history", "the run's logged history")

    def close(self) -> bool:
        """Everything logged so far sent (or kept by the relay's outbox), before the driver ends the run."""
        try:
            self.not_registered = self._ask("close", "the end of the run's logging")
        finally:
            self.calls.put(None)
            self.thread.join(timeout=CALL_TIMEOUT_S)
            shutil.rmtree(self.staging, ignore_errors=True)
        return True
