"""The run's outbox: what a run logs to MLflow while it trains (metrics, tags, checkpoint files and
their models) is sent by one background thread, in the order it was logged, so that training never
waits for the tracking server, nor for an upload. Points wait up to a second (LINGER_S) for others,
so that one request carries many display steps; flushing (before a checkpoint counts) and the end
of the run send at once.

While the server is away (stopped, restarting, the network down) the outbox keeps everything in
memory, says so once, tries again every few seconds, and says once more when the server is back.
At the end of the run it waits a bounded time for a server that is still away; whatever could
not be sent then is written to `mlflow_unsent.jsonl` in the run's output folder, and it says so.

Each point is sent with the timestamp it was logged with: a batch sent again after an answer was
lost on the way (the server went away while it was writing) is the same rows, which MLflow's SQL
store recognises and does not store twice. MLflow's own asynchronous logging
(`log_batch(synchronous=False)`) is not used: on an error it logs one line per batch and drops it.
"""

import atexit
import collections
import json
import logging
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RETRY_S = 2.0  # between two attempts while the server is away
# Metrics and tags wait up to this long for more before a request goes out. Against a SQLite
# store the request runs in this process, and each one costs about 7 ms of CPU on top of about
# 0.6 ms a metric (MLflow's SQL store, measured on 2 cores): sent as logged, every 25 steps, the
# requests alone took 15-25% of the digits MLP's training time. `flush` and `close` do not wait.
LINGER_S = 1.0
END_WAIT_S = 60.0  # how long the end of a run waits for a server that is away
KEPT_LIMIT = 200_000  # items kept in memory during an outage (about 60 MB); later ones go to the file
MAX_METRICS, MAX_TAGS = 1000, 100  # MLflow's limits for one log_batch request
UNSENT_FILE = "mlflow_unsent.jsonl"


@dataclass(frozen=True)
class Artifact:
    """A file (or folder) to upload to the run's `artifact_path`. `staged`: a link made for the
    outbox (RunLogger.stage), removed once sent."""

    path: str
    artifact_path: str | None
    staged: bool = False


@dataclass(frozen=True)
class Model:
    """A model to log as a LoggedModel (orchestrate.tracking.models.log_model): its ONNX file
    (staged), the sample batch for its signature, its step and name, the evaluation points at that
    step to link to it as they were when it was exported, and where to register it (or None)."""

    path: str
    sample: Any
    step: int
    name: str
    evaluation: tuple = ()
    eval_dataset: tuple[str, str] | None = None
    register: Any = None  # orchestrate.tracking.models.Registration


@dataclass(frozen=True)
class RunEnd:
    """The run's end as the run reached it (FINISHED, FAILED, KILLED), which the server did not
    take: `orchestrate sync` ends the run so once the rest is in."""

    status: str
    end_time: int  # ms since the epoch


FINAL_MODEL = "model"  # the trained model's LoggedModel name; a checkpoint's is checkpoint-<step>


def cause(error: BaseException) -> str:
    """The short reason inside a client error ("Connection refused"), not its whole chain."""
    text = str(error)
    found = re.findall(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found[-1].strip()
    for short in ("timed out", "Read timed out", "Connection reset", "Connection aborted"):
        if short in text:
            return short.lower()
    return text.splitlines()[0][:300] if text else type(error).__name__


def server_away(error: BaseException) -> bool:
    """Whether an error means "try again later" (no answer, or the server is restarting or
    overloaded: HTTP 5xx, 429) rather than "this request is refused" (HTTP 4xx: a bad value, a
    run that is no longer active), which sending again would not change."""
    from mlflow.exceptions import MlflowException

    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return status >= 500 or status == 429
    return isinstance(error, OSError) or "connection" in type(error).__name__.lower()


class Outbox:
    """Sends one run's metrics, tags and postponed artifacts from one thread, in order."""

    def __init__(self, client, run_id: str, uri: str, unsent_file: Path):
        self.client, self.run_id, self.uri, self.unsent_file = client, run_id, uri, Path(unsent_file)
        # Two queues, each in the order logged: metrics and tags go first whenever some wait (a
        # checkpoint waits for them: Outbox.flush); files and models when none do. A model is thus
        # logged after the evaluation points it links (logged before it), and a backlog of models
        # (an outage's) never holds the metrics back.
        self.records: collections.deque = collections.deque()  # Metric, RunTag
        self.files: collections.deque = collections.deque()  # Artifact, Model
        self.cond = threading.Condition()
        self.away_since: float | None = None  # when the server stopped answering; None: it answers
        self.stopped = False
        self.done = threading.Event()  # set with `stopped`: the thread's pause between attempts ends
        self.urgent = 0  # callers of flush() or close() waiting: send without lingering
        self.spilled = 0  # items written straight to the file (the memory limit was reached)
        self.refused = 0  # items the server answered with an error (HTTP 4xx): not sent again
        self.sent = 0  # items done with (taken or refused): the end of the run waits while this grows
        self.not_registered: list[str] = []  # models logged whose registration failed: the run fails
        self.thread = threading.Thread(target=self._run, name=f"mlflow-outbox-{run_id[:8]}", daemon=True)
        # urllib3 says "Retrying ..." for each failed try of each request: not from this thread,
        # which says once that the server is away and once that it is back.
        self.quiet = ThreadFilter(self.thread)
        logging.getLogger("urllib3.connectionpool").addFilter(self.quiet)
        self.thread.start()
        # A process that ends without closing its logger (a runner worker, a script) still waits
        # its bounded time and writes the file: nothing logged is dropped silently.
        atexit.register(self.close)

    @property
    def away(self) -> bool:
        return self.away_since is not None

    @property
    def waiting(self) -> int:
        """Items not sent yet."""
        return len(self.records) + len(self.files)

    def put(self, items: list) -> None:
        with self.cond:
            if self.waiting + len(items) > KEPT_LIMIT:
                if not self.spilled:
                    log.warning(f"MLflow at {self.uri} has been away too long: more than {KEPT_LIMIT} items are "
                                f"kept; later ones are written to {self.unsent_file} only")
                self._write(items)
                self.spilled += len(items)
                return
            for item in items:
                (self.files if isinstance(item, (Artifact, Model)) else self.records).append(item)
            self.cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every metric and tag put so far has been sent (not the files and models,
        which go after them anyway), unless the server is away: then return at once (training
        does not wait for it; the items stay kept). True when they were all sent."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            self.urgent += 1
            self.cond.notify_all()
            try:
                while self.records and not self.away and not self.stopped:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self.cond.wait(left)
                return not self.records
            finally:
                self.urgent -= 1

    def close(self, wait_s: float = END_WAIT_S) -> bool:
        """The end of the run: send what is left, waiting up to `wait_s` for a server that is away
        (or for as long as the server keeps taking items, `wait_s` at a time); write what is still
        unsent to the file, and say so. True when everything was sent."""
        atexit.unregister(self.close)
        deadline = time.monotonic() + wait_s
        with self.cond:
            if self.stopped:
                return not self.waiting and not self.spilled
            self.urgent += 1  # never decremented: nothing lingers after the end
            self.cond.notify_all()
            if self.away and self.waiting:
                log.warning(f"MLflow at {self.uri} is still away at the end of the run: waiting up to "
                            f"{wait_s:.0f} s for it to take the {self.waiting} kept item(s)")
            sent_before = self.sent
            while self.waiting:
                left = deadline - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                if self.away or self.sent == sent_before:
                    break  # nothing went out for `wait_s`: the server is away, or stuck
                # The server takes them, more slowly than they came (a LoggedModel is a dozen
                # requests): wait on, as long again, for as long as it takes some.
                models = sum(isinstance(item, Model) for item in self.files)
                log.warning(f"MLflow at {self.uri} is still taking run {self.run_id}'s last {self.waiting} item(s)"
                            f"{f' ({models} LoggedModel(s))' if models else ''}: waiting on while it does")
                sent_before, deadline = self.sent, time.monotonic() + wait_s
            self.stopped = True
            self.done.set()
            self.cond.notify_all()
            unsent = [*self.records, *self.files]
            self.records.clear()
            self.files.clear()
        self.thread.join(timeout=1.0)  # a request in flight may take its own timeout: not waited for
        logging.getLogger("urllib3.connectionpool").removeFilter(self.quiet)
        # The trained model is kept for `orchestrate sync` (a line and its staged file); a
        # checkpoint's model is not (its checkpoint file is, and is the model at that step).
        models = [item for item in unsent if isinstance(item, Model) and item.name != FINAL_MODEL]
        unsent = [item for item in unsent if not (isinstance(item, Model) and item.name != FINAL_MODEL)]
        for model in models:
            release(model)
        if unsent:
            self._write(unsent)
        if unsent or self.spilled:
            log.warning(f"MLflow at {self.uri} did not take {len(unsent) + self.spilled} item(s) of run {self.run_id} "
                        f"(metrics, tags, artifacts to upload, the trained model): they are in {self.unsent_file}, "
                        "one JSON object a line")
        if models:
            names = [m.name for m in models]
            named = ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]}"
            log.warning(f"MLflow at {self.uri} did not take {len(models)} checkpoint LoggedModel(s) of run "
                        f"{self.run_id} ({named}); their checkpoint files stay in the output folder")
        return not unsent and not self.spilled and not models

    def keep_end(self, status: str, end_time: int) -> None:
        """(After close.) The run's end, which the server did not take, for `orchestrate sync`."""
        self._write([RunEnd(status, end_time)])

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.stopped:
                    self.cond.wait()
                self._linger()
                if self.stopped:
                    return
                batch = self._next_batch()  # left at the front until sent: flush() waits for it too
            error = self._send(batch)
            with self.cond:
                if self.stopped:
                    return  # close() has taken the items over (the last batch may have arrived too)
                if error is None or not server_away(error):
                    queue = self.files if isinstance(batch[0], (Artifact, Model)) else self.records
                    for _ in batch:
                        release(queue.popleft())
                    self.sent += len(batch)
                    if error is not None:
                        if not self.refused:  # once: sending it again would not change the answer
                            log.warning(f"MLflow at {self.uri} refused {len(batch)} item(s) of run {self.run_id}:"
                                        f" {cause(error)}")
                        self.refused += len(batch)
                    elif self.away:
                        log.warning(f"MLflow at {self.uri} answers again after {time.time() - self.away_since:.0f} s:"
                                    f" sending the {self.waiting + len(batch)} item(s) kept meanwhile")
                        self.away_since = None
                elif not self.away:
                    self.away_since = time.time()
                    log.warning(f"MLflow at {self.uri} does not answer ({cause(error)}): training goes on; its "
                                f"metrics are kept and sent when the server is back")
                self.cond.notify_all()
            if error is not None and server_away(error):
                self.done.wait(RETRY_S)

    def _linger(self) -> None:
        """(Holding the lock, with items waiting.) Give more items LINGER_S to arrive, unless
        someone waits for them to be sent, one request's worth is there already, or the server is
        away (the pause between attempts is RETRY_S)."""
        until = time.monotonic() + LINGER_S
        while (not self.stopped and not self.urgent and not self.away and not self.files
               and len(self.records) < MAX_METRICS and (left := until - time.monotonic()) > 0):
            self.cond.wait(left)

    def _next_batch(self) -> list:
        """What one request takes, left at the front of its queue until sent: metrics and tags up
        to MLflow's limits for a batch whenever some wait, else the first file or model."""
        if not self.records:
            return [self.files[0]]
        from mlflow.entities import Metric

        batch, metrics, tags = [], 0, 0
        for item in self.records:
            is_metric = isinstance(item, Metric)
            if (metrics + is_metric > MAX_METRICS) or (tags + (not is_metric) > MAX_TAGS):
                break
            metrics, tags = metrics + is_metric, tags + (not is_metric)
            batch.append(item)
        return batch

    def _send(self, batch: list) -> BaseException | None:
        from mlflow.entities import Metric

        try:
            if isinstance(batch[0], Artifact):
                upload(self.client, self.run_id, batch[0])
            elif isinstance(batch[0], Model):
                from orchestrate.tracking import models

                item = batch[0]
                try:
                    models.log_model(self.client, self.run_id, Path(item.path), item.sample, item.step, item.register,
                                     item.name, item.evaluation, item.eval_dataset)
                except models.NotRegistered as e:  # logged: sending it again would log it twice
                    log.warning(str(e))
                    self.not_registered.append(str(e))
            else:
                self.client.log_batch(self.run_id, metrics=[m for m in batch if isinstance(m, Metric)],
                                      tags=[t for t in batch if not isinstance(t, Metric)], synchronous=True)
        except Exception as e:  # noqa: BLE001 - any failure is either "later" or "refused", never fatal
            return e
        return None

    def _write(self, items: list) -> None:
        """Append `items` to the unsent file; a checkpoint's model has no line there (its
        checkpoint file has), and its staged file goes."""
        self.unsent_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.unsent_file, "a") as f:
            for item in items:
                if isinstance(item, Model) and item.name != FINAL_MODEL:
                    release(item)
                    continue
                f.write(json.dumps(to_row(self.run_id, item)) + "\n")


# The unsent file, one JSON object a line: written by the outbox, read back by `orchestrate sync`.
def to_row(run_id: str, item) -> dict:
    from mlflow.entities import Metric

    if isinstance(item, Metric):
        return {"run_id": run_id, "metric": item.key, "value": item.value, "timestamp": item.timestamp,
                "step": item.step}
    if isinstance(item, Artifact):
        return {"run_id": run_id, "artifact": item.path, "artifact_path": item.artifact_path}
    if isinstance(item, RunEnd):
        return {"run_id": run_id, "status": item.status, "end_time": item.end_time}
    if isinstance(item, Model):  # its sample batch beside its staged file, as numpy writes it
        import numpy as np

        sample = Path(item.path).with_name("sample.npy")
        np.save(sample, item.sample)
        register = item.register
        return {"run_id": run_id, "model": item.path, "sample": str(sample), "step": item.step, "name": item.name,
                "evaluation": [[m.key, m.value, m.timestamp, m.step] for m in item.evaluation],
                "eval_dataset": list(item.eval_dataset) if item.eval_dataset else None,
                "register": [register.name, register.metric, register.minimize] if register else None}
    return {"run_id": run_id, "tag": item.key, "value": item.value}


def read_unsent(path: Path) -> dict[str, list]:
    """An unsent file's items (Metric, RunTag, Artifact, Model, RunEnd), in the order written, by
    run id; a ValueError naming the line that is not one of them."""
    from mlflow.entities import Metric, RunTag

    by_run: dict[str, list] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "metric" in row:
                item = Metric(row["metric"], row["value"], row["timestamp"], row["step"])
            elif "tag" in row:
                item = RunTag(row["tag"], row["value"])
            elif "status" in row:
                item = RunEnd(row["status"], int(row["end_time"]))
            elif "model" in row:
                item = model_of(row)
            else:
                item = Artifact(row["artifact"], row.get("artifact_path"))
            by_run.setdefault(row["run_id"], []).append(item)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise ValueError(f"{path}:{number}: not a line the outbox writes ({type(e).__name__}: {e})") from None
    return by_run


def model_of(row: dict) -> Model:
    """A Model from its line (to_row), its sample batch read back."""
    import numpy as np
    from mlflow.entities import Metric

    from orchestrate.tracking.models import Registration

    return Model(row["model"], np.load(row["sample"]), int(row["step"]), row["name"],
                 tuple(Metric(*point) for point in row["evaluation"]),
                 tuple(row["eval_dataset"]) if row["eval_dataset"] else None,
                 Registration(*row["register"]) if row["register"] else None)


def release(item) -> None:
    """Remove a sent item's staged file (its folder of its own, RunLogger.stage)."""
    if isinstance(item, Model) or (isinstance(item, Artifact) and item.staged):
        shutil.rmtree(Path(item.path).parent, ignore_errors=True)


class ThreadFilter(logging.Filter):
    """Drops the records that one thread logs."""

    def __init__(self, thread: threading.Thread):
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread.ident


def upload(client, run_id: str, artifact: Artifact) -> None:
    """Upload a file or a folder; one that is gone by now (an older checkpoint rotated away while
    the server was down) is skipped: a newer one replaced it."""
    path = Path(artifact.path)
    if path.is_dir():
        client.log_artifacts(run_id, str(path), artifact.artifact_path)
    elif path.exists():
        client.log_artifact(run_id, str(path), artifact.artifact_path)
    else:
        log.warning(f"{path} was not uploaded to MLflow while the server was away, and is gone now")


SENT_SUFFIX = ".sent"


def send_unsent(client, path: Path, by_run: dict[str, list] | None = None) -> int:
    """Send the rows of an unsent file (`path`; `by_run`: read already) through `client`, batch by
    batch, then rename it `*.sent`; returns how many items went out. Any error of the client
    propagates: the file stays."""
    from mlflow.entities import Metric, RunTag

    by_run = read_unsent(path) if by_run is None else by_run
    for run_id, items in by_run.items():
        metrics = [i for i in items if isinstance(i, Metric)]
        tags = [i for i in items if isinstance(i, RunTag)]
        for start in range(0, len(metrics), MAX_METRICS):
            client.log_batch(run_id, metrics=metrics[start:start + MAX_METRICS], synchronous=True)
        for start in range(0, len(tags), MAX_TAGS):
            client.log_batch(run_id, tags=tags[start:start + MAX_TAGS], synchronous=True)
        for artifact in (i for i in items if isinstance(i, Artifact)):
            upload(client, run_id, artifact)
        for model in (i for i in items if isinstance(i, Model)):  # the trained model, as the run would have
            send_model(client, run_id, model)
        for end in (i for i in items if isinstance(i, RunEnd)):  # last: the run ends once all of it is in
            client.set_terminated(run_id, end.status, end.end_time)
    path.rename(path.with_name(path.name + SENT_SUFFIX))
    return sum(len(items) for items in by_run.values())


def send_model(client, run_id: str, model: Model) -> None:
    """The run's trained model as its LoggedModel (orchestrate.tracking.models), registered if the
    run was to register it; a registry that refuses does not make the model be logged twice."""
    from orchestrate.tracking import models

    try:
        models.log_model(client, run_id, Path(model.path), model.sample, model.step, model.register, model.name,
                         model.evaluation, model.eval_dataset)
    except models.NotRegistered as e:
        print(f"warning: {e}", file=sys.stderr, flush=True)
