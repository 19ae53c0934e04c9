"""`orchestrate sync RUN_FOLDER`: what a run kept for a server that was away goes into its run, once."""

from orchestrate.tracking.logger import RunLogger
from orchestrate.tracking.outbox import UNSENT_FILE
from tests.conftest import client_for


def test_what_a_run_kept_for_a_server_that_never_came_back_is_synced_into_its_run_once(tmp_path, capsys):
    """The server goes away before the run's end and is still away when the run ends (the kept
    points go to mlflow_unsent.jsonl); it comes back; `orchestrate sync RUN_FOLDER` logs them into
    the same run, each point once, and a second sync sends nothing."""
    from orchestrate import sync
    from orchestrate.server import MlflowServer
    from tests.helpers import free_port

    # The run is made in the server's store directly (one server start, not two); the server's
    # port answers nothing until the server starts, after the run and the first sync.
    store, artifacts, port = f"sqlite:///{tmp_path}/server.db", tmp_path / "artifacts", free_port()
    client = client_for(store)
    run_id = client.create_run(client.create_experiment("sync")).info.run_id
    away = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        logger = RunLogger(away, run_id, tmp_path / "out")
        for step in range(1, 21):
            logger.log_metrics({"train/loss": 1.0 / step}, step=step)
        logger.set_tags({"after": "outage"})
        assert not logger.close(wait_s=2)
        assert (tmp_path / "out" / UNSENT_FILE).is_file()

        assert sync.main([str(tmp_path / "out"), "--tracking-uri", away]) == 1  # still away: kept
        assert "did not take it" in capsys.readouterr().err and (tmp_path / "out" / UNSENT_FILE).is_file()

        server = MlflowServer(store, artifacts, port=port, log=log)
        try:
            assert sync.main([str(tmp_path / "out"), "--tracking-uri", server.uri]) == 0
            assert "sent 21 item(s)" in capsys.readouterr().out
            assert sync.main([str(tmp_path / "out"), "--tracking-uri", server.uri]) == 0
            assert "nothing to send (sent already)" in capsys.readouterr().out
            history = client_for(server.uri).get_metric_history(run_id, "train/loss")
            assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in range(1, 21)]
            assert client_for(server.uri).get_run(run_id).data.tags["after"] == "outage"
        finally:
            server.stop()


def test_sync_refuses_what_it_cannot_place_with_one_line(tmp_path, capsys, monkeypatch):
    from orchestrate import sync

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert sync.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nowhere'}: no such folder"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / UNSENT_FILE).write_text("{}\n")
    assert sync.main([str(tmp_path / "run")]) == 2
    assert "Give --tracking-uri" in capsys.readouterr().err
    (tmp_path / "run" / UNSENT_FILE).write_text('{"run_id": "x", "metric": "loss"}\n')
    assert sync.main([str(tmp_path / "run"), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'run' / UNSENT_FILE}:1: not a line the outbox writes")
    assert not (tmp_path / "m.db").exists()  # refused before any store was opened
