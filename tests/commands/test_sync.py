"""`orchestrate sync RUN_FOLDER`: what a run kept for a server that was away goes into its run, once."""

import logging

import numpy as np

from orchestrate.tracking.logger import RunLogger
from orchestrate.tracking.outbox import UNSENT_FILE
from tests.conftest import client_for
from tests.helpers import command_exit


def tiny_onnx(path) -> None:
    """A 4-in, 3-out linear model in ONNX, made without torch's exporter."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_what_a_run_kept_for_a_server_that_never_came_back_is_synced_into_its_run_once(tmp_path, capsys, caplog):
    """The server goes away before the run's end and is still away when the run ends (the kept
    points, the trained model and the run's end go to mlflow_unsent.jsonl); it comes back;
    `orchestrate sync RUN_FOLDER` logs them into the same run, each point once, the model as its
    LoggedModel, and ends the run FINISHED, as the run itself would have; a second sync sends nothing."""
    from orchestrate.cluster.mlflow_server import MlflowServer
    from orchestrate.commands import sync
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
        tiny_onnx(tmp_path / "model.onnx")
        logger.log_model(tmp_path / "model.onnx", np.ones((2, 4), np.float32), step=20)  # the trained model
        (tmp_path / "model.onnx").unlink()  # the outbox staged its own link
        assert not logger.close(wait_s=2)
        logger.outbox.keep_end("FINISHED", 1_700_000_000_000)  # what Run does when the end is not taken
        assert (tmp_path / "out" / UNSENT_FILE).is_file()

        # Still away: kept; the command says so in one line, and urllib3's "Retrying" warnings for
        # each failed try reach no handler (the console's, here pytest's).
        capsys.readouterr()  # what the run's logger said before
        with caplog.at_level(logging.WARNING):
            assert command_exit(sync.main, [str(tmp_path / "out"), "--tracking-uri", away]) == 1
        assert not [r for r in caplog.records if r.name.startswith("urllib3")], caplog.records
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: {tmp_path / 'out'}: MLflow at {away} did not take it"), line
        assert (tmp_path / "out" / UNSENT_FILE).is_file()

        server = MlflowServer(store, artifacts, port=port, log=log)
        try:
            assert command_exit(sync.main, [str(tmp_path / "out"), "--tracking-uri", server.uri]) == 0
            assert "sent 23 item(s)" in capsys.readouterr().out
            assert command_exit(sync.main, [str(tmp_path / "out"), "--tracking-uri", server.uri]) == 0
            assert "nothing to send (sent already)" in capsys.readouterr().out
            history = client_for(server.uri).get_metric_history(run_id, "train/loss")
            assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in range(1, 21)]
            run = client_for(server.uri).get_run(run_id)
            assert run.data.tags["after"] == "outage"
            assert (run.info.status, run.info.end_time) == ("FINISHED", 1_700_000_000_000)
            (model,) = client_for(server.uri).search_logged_models([run.info.experiment_id])
            assert (model.name, model.source_run_id, str(model.status)) == ("model", run_id, "READY")
        finally:
            server.stop()


def test_sync_refuses_what_it_cannot_place_with_one_line(tmp_path, capsys, monkeypatch):
    from orchestrate.commands import sync

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert command_exit(sync.main, [str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nowhere'}: no such folder"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / UNSENT_FILE).write_text("{}\n")
    assert command_exit(sync.main, [str(tmp_path / "run")]) == 2
    assert "Give --tracking-uri" in capsys.readouterr().err
    (tmp_path / "run" / UNSENT_FILE).write_text('{"run_id": "x", "metric": "loss"}\n')
    assert command_exit(sync.main, [str(tmp_path / "run"), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'run' / UNSENT_FILE}:1: not a line the outbox writes")
    assert not (tmp_path / "m.db").exists()  # refused before any store was opened
