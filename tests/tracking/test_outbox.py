"""The run's outbox: a tracking server that goes away mid-run gets every step exactly once when it
is back; one that never comes back gets the kept points in a file, and training never waits."""

import json
import logging
import os
import threading
import time

from orchestrate import app
from orchestrate.tasks.data import Synthetic
from orchestrate.tracking.logger import RunLogger
from orchestrate.tracking.outbox import UNSENT_FILE
from tests.conftest import client_for, metric_steps

OUTAGE: dict = {}  # the outage test's server, and the batches at which it goes away and comes back


class OutageData(Synthetic):
    """The synthetic data set, which stops the test's MLflow server when training asks for batch
    `stop_at`, and at batch `restart_at`, once the run has said the server is away, starts it
    again on the same port and store."""

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if OUTAGE and position == OUTAGE["stop_at"]:
            OUTAGE["server"].stop()
        if OUTAGE and position == OUTAGE["restart_at"]:
            assert OUTAGE["away"].wait(60), "the run never said that the server went away"
            OUTAGE["server"] = OUTAGE["start"]()
        return super().train_batch(position, batch_size, seed, rank, world_size)


class Said(logging.Handler):
    """Sets `event` when a log record says `words`."""

    def __init__(self, words: str, event: threading.Event):
        super().__init__()
        self.words, self.event = words, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


def test_a_server_that_goes_away_mid_run_gets_every_step_exactly_once(make_cfg, tmp_path, caplog):
    from orchestrate.cluster.mlflow_server import MlflowServer

    store, artifacts = f"sqlite:///{tmp_path}/server.db", tmp_path / "artifacts"
    log = open(tmp_path / "server.log", "w")
    first = MlflowServer(store, artifacts, log=log)
    away = threading.Event()
    said = Said("does not answer", away)
    logging.getLogger("orchestrate.tracking.outbox").addHandler(said)
    OUTAGE.update(server=first, stop_at=60, restart_at=170, away=away,
                  start=lambda: MlflowServer(store, artifacts, port=first.port, log=log))
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrate"):
            result = app.train(make_cfg("data._target_=tests.tracking.test_outbox.OutageData", "trainer.max_steps=200",
                                        "trainer.display_loss_steps=1", "trainer.evaluation_period=50",
                                        "trainer.checkpoint_period=50", "trainer.max_num_checkpoints=1",
                                        uri=first.uri), tmp_path / "out")
        client = client_for(first.uri)
        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED"
        for key in ("train/loss", "lr", "perf/step_time_ms", "perf/samples_per_sec"):
            assert [s for s, _ in metric_steps(client, result.run_id, key)] == list(range(1, 201)), key
        assert [s for s, _ in metric_steps(client, result.run_id, "eval/loss")] == [50, 100, 150, 200]
        # Logged while the server was away (steps 61 to 170): the values the run computed.
        assert metric_steps(client, result.run_id, "train/loss") == result.history["train/loss"]
        # The checkpoints saved during the outage were uploaded once the server was back, step 100's
        # too, though it was rotated away on disk at step 150 (one kept) while the server was away.
        uploaded = [a.path for a in client.list_artifacts(result.run_id, "checkpoints")]
        assert uploaded == [f"checkpoints/step_{s:07d}.pt" for s in (50, 100, 150, 200)]
        # So was the checkpoint's model: every checkpoint a LoggedModel at its step, the last the run's.
        models = {o.step: client.get_logged_model(o.model_id).name for o in run.outputs.model_outputs}
        assert models == {50: "checkpoint-50", 100: "checkpoint-100", 150: "checkpoint-150", 200: "model"}
        said_away = [r for r in caplog.records if "does not answer" in r.getMessage()]
        said_back = [r for r in caplog.records if "answers again" in r.getMessage()]
        assert len(said_away) == 1 and len(said_back) == 1, caplog.text
        assert first.uri in said_away[0].getMessage() and not (tmp_path / "out" / UNSENT_FILE).exists()
        # Nothing else about it but, if the run ended first, that its end waits for the server: no
        # retries of urllib3, no model "not logged" (the outbox waited).
        others = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r not in said_away + said_back
                  and "is still away at the end of the run" not in r.getMessage()]
        assert others == [], others
        assert not any((tmp_path / "out").glob(".mlflow_outbox*"))  # every staged file sent and removed
    finally:
        logging.getLogger("orchestrate.tracking.outbox").removeHandler(said)
        OUTAGE.pop("server").stop()
        OUTAGE.clear()
        log.close()


def test_a_run_left_without_its_server_writes_what_it_kept_to_a_file(tmp_path, caplog):
    """The server is gone and does not come back: logging never waits for it, and the end of the
    run waits a bounded time, then writes the kept points and tags to the output folder and says so."""
    from tests.helpers import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens: a server that went away for good
    retries = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    logger = RunLogger(uri, "0123456789abcdef", tmp_path / "out")
    began = time.monotonic()
    for step in range(1, 11):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    logger.set_tags({"after": "outage"})
    assert time.monotonic() - began < 1  # the training loop did not wait for the server
    with caplog.at_level(logging.WARNING, logger="orchestrate"):
        assert not logger.close(wait_s=3)
    rows = [json.loads(line) for line in (tmp_path / "out" / UNSENT_FILE).read_text().splitlines()]
    assert [(r["metric"], r["step"], r["value"]) for r in rows if "metric" in r] == [
        ("train/loss", step, 1.0 / step) for step in range(1, 11)]
    assert {"run_id": "0123456789abcdef", "tag": "after", "value": "outage"} in rows
    assert "did not take 11 item(s) of run 0123456789abcdef" in caplog.text
    assert os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") == retries  # MLflow's settings given back
