"""The sweep callbacks' pieces, each on its own: the callback pickled to a job with what
on_multirun_start gave it, a job's child run and environment, the registry that closes sweeps
Hydra left open, and the summary table's speed columns and tie verdict."""

import os
import threading

import cloudpickle
import pytest
from hydra._internal.callbacks import Callbacks
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext
from hydra.utils import instantiate
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from orchestrate.config import load_config
from orchestrate.sweeps import _summary, callbacks
from orchestrate.sweeps.callbacks import SweepTracking
from orchestrate.tracking.handover import ParentRun
from tests.conftest import multirun_config

MLFLOW_VARIABLES = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "ORCHESTRATE_TRACKING_URI", "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE",
                    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")


def test_conf_turns_the_callback_on_with_the_main_configs_settings():
    cfg = multirun_config(["tracking.experiment=x", "sweep=lr_grid"])
    cb = instantiate(cfg.hydra.callbacks.sweep_tracking)
    assert isinstance(cb, SweepTracking)
    assert (cb.tracking_uri, cb.experiment, cb.metric, cb.name) == ("sqlite:///mlflow.db", "x", "eval_loss", "lr_grid")
    assert cb.resume and cb.tracking_server and cb.tie_tolerance == 1e-3
    assert cb.lower  # sweep.direction: minimize


@pytest.mark.parametrize("overrides, lower", [
    (["sweep=lr_grid", "sweep.metric=eval_accuracy", "sweep.direction=maximize"], False),  # a grid: sweep.direction
    (["sweep=lr_optuna", "hydra.sweeper.direction=maximize"], False),  # the sweeper's own direction wins
    (["sweep=lr_optuna"], True),
])
def test_the_summary_ranks_by_the_sweeps_direction(overrides, lower):
    assert instantiate(multirun_config(overrides).hydra.callbacks.sweep_tracking).lower is lower


def test_the_callback_reaches_a_remote_job_with_what_on_multirun_start_set():
    """Launchers pickle the HydraContext (which holds the callbacks) to run a job elsewhere."""
    cb = SweepTracking("sqlite:///mlflow.db", "orchestrate")
    cb.parent = ParentRun(uri="http://127.0.0.1:5001", experiment_id="1", run_id="p", command=["a=1"],
                           finished={"b=2": "r"})
    cb._sweep = threading.Lock()  # the launching process's server and clients: not picklable, not needed
    hooks = Callbacks()
    hooks.callbacks.append(cb)
    remote = cloudpickle.loads(cloudpickle.dumps(HydraContext(config_loader=None, callbacks=hooks)))
    (copy,) = remote.callbacks.callbacks
    assert copy.parent == cb.parent and copy._sweep is None


def test_a_single_run_is_not_touched(monkeypatch):
    cfg = load_config(["backend=torch"])
    before = dict(os.environ)
    cb = SweepTracking("sqlite:///mlflow.db", "orchestrate")
    cb.on_run_start(cfg)
    cb.on_job_start(cfg, task_function=None)
    cb.on_job_end(cfg, JobReturn(status=JobStatus.COMPLETED))
    cb.on_run_end(cfg)
    assert dict(os.environ) == before and cb.parent is None


@pytest.fixture
def parent(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("e")
    run_id = client.create_run(experiment_id, run_name="sweep-x").info.run_id
    return client, ParentRun(uri=uri, experiment_id=experiment_id, run_id=run_id, command=["backend=torch"])


def job_config(*overrides: str, num: int):
    cfg = multirun_config(list(overrides))
    with open_dict(cfg):
        cfg.hydra.job.num = num
    return cfg


def test_a_job_gets_a_nested_child_run_and_its_environment_back(parent, monkeypatch):
    client, handover = parent
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")  # the job's own value comes back
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    before = {k: os.environ.get(k) for k in MLFLOW_VARIABLES}
    cb = SweepTracking(handover.uri, "e")
    cb.parent = handover
    cfg = job_config("backend=torch", "optimizer.lr=0.5", num=3)
    cb.on_job_start(cfg, task_function=None)
    child = client.get_run(os.environ["MLFLOW_RUN_ID"])
    assert os.environ["MLFLOW_TRACKING_URI"] == handover.uri
    assert os.environ["MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"] == "1"
    assert child.info.run_name == "optimizer.lr=0.5" and child.info.status == "RUNNING"
    assert child.data.tags["mlflow.parentRunId"] == handover.run_id
    assert child.data.tags["orchestrate.trial_index"] == "3"
    assert child.data.tags["mlflow.source.type"] == "LOCAL" and child.data.tags["mlflow.user"]  # the UI's Source, User
    # The job failed before the app opened its tracker: the callback closes the run as FAILED.
    cb.on_job_end(cfg, JobReturn(status=JobStatus.FAILED, _return_value=ValueError("bad lr")))
    child = client.get_run(child.info.run_id)
    assert child.info.status == "FAILED" and child.data.tags["error"] == "ValueError: bad lr"
    assert {k: os.environ.get(k) for k in MLFLOW_VARIABLES} == before


def test_a_resumed_sweep_hands_a_finished_trial_its_old_run(parent):
    client, handover = parent
    handover.finished = {"optimizer.lr=0.5": "0123"}
    cb = SweepTracking(handover.uri, "e")
    cb.parent = handover
    cb.on_job_start(job_config("backend=torch", "optimizer.lr=0.5", num=0), task_function=None)
    try:
        assert os.environ["MLFLOW_RUN_ID"] == "0123"
        assert len(client.search_runs([handover.experiment_id])) == 1  # no new child: only the parent
    finally:
        cb._restore()


def test_open_sweeps_are_closed_once(monkeypatch):
    closed = []

    class Sweep:
        def close(self):
            closed.append(1)

    cb = SweepTracking("sqlite:///mlflow.db", "orchestrate")
    cb._sweep = Sweep()
    monkeypatch.setattr(callbacks, "_OPEN", [cb])
    callbacks.close_open_sweeps()  # the entry point's `finally`, after the sweeper raised
    callbacks.close_open_sweeps()  # at exit
    cb.on_multirun_end(config=None)
    assert closed == [1] and callbacks._OPEN == []


def row(index, name, best_at, rate, status="FINISHED"):
    """A trial whose eval loss reaches `best_at` = (seconds after its start, value) last."""
    seconds, value = best_at
    return _summary.Row(index, name, status, run_id=f"r{index}", start_ms=1_000, end_ms=1_000 + 9_000,
                        metrics={"final/train_loss": 0.5, "final/samples_per_sec": rate, "final/step_time_ms": 1.25},
                        params={"cpu.cores": "2", "cpu.threads": "2", "cpu.loader_processes": "0"},
                        curve=[(1_000 + 500, 0.9), (1_000 + int(seconds * 1000), value)])


def test_a_tie_is_called_a_tie_and_told_apart_by_speed():
    rows = [row(0, "backend=torch", (4.0, 0.30005), 58_000), row(1, "backend=ondevice", (3.1, 0.3000), 71_942),
            row(2, "backend=ortmodule", (5.2, 0.3002), 54_000),
            _summary.Row(3, "backend=runner", "FAILED", error="RuntimeError: boom")]
    text = _summary.table(rows, "eval_loss", tolerance=1e-3)
    assert text.splitlines()[0] == ("| trial | overrides | status | final train loss | best eval_loss | "
                                    "s to eval_loss <= 0.3002 | samples/s | step time (ms) | CPU: threads + loader of cores | "
                                    "wall time (s) | error |")
    assert "| 1 | backend=ondevice | FINISHED | 0.5000 | 0.3000 | 3.1 | 71,942 | 1.25 | 2 + 0 of 2 | 9.0 |  |" in text
    assert "| 3 | backend=runner | FAILED |  |  |  |  |  |  |  | RuntimeError: boom |" in text
    assert text.splitlines()[-1] == ("tie: trials 0, 1, 2 reach eval_loss 0.3002 within 0.1%; "
                                     "fastest to it: trial 1 (backend=ondevice, 3.1 s); "
                                     "highest throughput: trial 1 (71,942 samples/s)")


def test_a_clear_winner_is_named_and_the_target_is_a_level_every_finished_trial_reached():
    rows = [row(0, "optimizer.lr=0.001", (4.0, 0.9), 60_000), row(1, "optimizer.lr=0.01", (2.0, 0.3), 60_000),
            row(2, "optimizer.lr=0.1", (3.0, 0.5), 60_000, status="SKIPPED")]
    text = _summary.table(rows, "eval_loss", tolerance=1e-3)
    assert "s to eval_loss <= 0.9000" in text.splitlines()[0]
    # every trial's first point (0.9 after 0.5 s) is already at the target
    assert [line.split("|")[6].strip() for line in text.splitlines()[2:5]] == ["0.5", "0.5", "0.5"]
    assert text.splitlines()[-1] == "best: trial 1 (optimizer.lr=0.01), eval_loss = 0.3000"


def test_a_pruning_sweep_that_pruned_nothing_says_so():
    rows = [row(0, "optimizer.lr=0.001", (4.0, 0.9), 60_000), row(1, "optimizer.lr=0.01", (2.0, 0.3), 60_000)]
    for r in rows:
        r.max_steps = 100
    assert "pruned:" not in _summary.table(rows, "eval_loss", tolerance=1e-3)  # no pruner: no line
    text = _summary.table(rows, "eval_loss", tolerance=1e-3, pruner=True)
    assert text.splitlines()[-1] == ("pruned: 0 of 2 trials; trial-steps run: 200 of 200 without pruning "
                                     "(100% of the budget)")
