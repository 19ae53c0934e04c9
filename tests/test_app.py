"""A run's life in MLflow: failures marked FAILED with the error, Ctrl-C marked KILLED, the last
finished checkpoint intact either way; the character transformer trains on every backend."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from orchestrate import app, schema
from orchestrate.backends.ondevice import OnDeviceBackend
from orchestrate.job import Job
from orchestrate.tasks.data import Synthetic
from orchestrate.tracking.params import config_key
from tests.conftest import BACKENDS, ROOT, client_for, long, metric_steps
from tests.helpers import served_twice


def fail_at(position: int, error: BaseException):
    real = Synthetic.train_batch

    def train_batch(self, pos, *args, **kwargs):
        if pos == position:
            raise error
        return real(self, pos, *args, **kwargs)

    return train_batch


@pytest.mark.parametrize("error,status", [(RuntimeError("disk on fire"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_a_crash_marks_the_run_and_keeps_the_last_checkpoint(error, status, make_cfg, tmp_path, monkeypatch):
    cfg = make_cfg("backend=torch", "trainer.checkpoint_period=10", "trainer.max_steps=30")
    monkeypatch.setattr(Synthetic, "train_batch", fail_at(24, error))  # step 25 never starts
    with pytest.raises(type(error)):
        app.train(cfg, tmp_path / "out")
    client = client_for(cfg.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.info.status == status
    assert ("disk on fire" if status == "FAILED" else "KeyboardInterrupt") in run.data.tags["error"]
    # Metrics up to the crash were flushed, checkpoints 10 and 20 are whole and loadable.
    assert [s for s, _ in metric_steps(client, run.info.run_id, "train/loss")][-1] == 20
    folder = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_0000010.pt", "step_0000020.pt"]
    state = torch.load(folder / "step_0000020.pt", weights_only=True)
    assert state["step"] == 20
    model = schema.build(cfg.model, "model")
    model.load_state_dict(state["model"])
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == [
        "checkpoints/step_0000010.pt", "checkpoints/step_0000020.pt"]


def test_only_max_num_checkpoints_stay_on_disk(make_cfg, tmp_path):
    cfg = make_cfg("backend=torch", "trainer.checkpoint_period=5", "trainer.max_steps=30", "trainer.max_num_checkpoints=2")
    app.train(cfg, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step_0000025.pt", "step_0000030.pt"]


def test_a_run_logs_every_metric_a_sweep_may_name(make_cfg, tmp_path):
    """schema.SWEEP_METRICS are what sweep.metric may name: a classifier's run on CPU logs each
    (peak_cuda_mb: CUDA runs only), and its memory peak is this run's, not the process's before."""
    from orchestrate.meter import peak_rss_mb
    from orchestrate.schema import SWEEP_METRICS

    hog = bytearray(2**30)  # this process held 1 GiB more before the run
    hog[:: 4096] = b"x" * len(hog[:: 4096])
    del hog
    before = peak_rss_mb()
    cfg = make_cfg("backend=torch", "trainer.max_steps=30", "trainer.display_loss_steps=10")
    result = app.train(cfg, tmp_path / "out")
    logged = client_for(cfg.tracking.uri).get_run(result.run_id).data.metrics
    assert {f"final/{m}" for m in SWEEP_METRICS if m != "peak_cuda_mb"} <= set(logged)
    assert logged["final/warmup_s"] >= 0 and logged["final/wall_time_s"] > 0
    assert logged["final/peak_rss_mb"] < before - 500  # the GiB held before the run is not its peak


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_char_transformer_learns_on_every_backend(backend, make_cfg, tmp_path):
    cfg = make_cfg(f"backend={backend}", "model=char_transformer", "data=python_source", "model.n_layer=1",
                   "model.n_embd=64", "trainer.batch_size=16", "trainer.max_steps=40", "trainer.display_loss_steps=10",
                   "trainer.evaluation_period=40", "optimizer.lr=0.003")
    result = app.train(cfg, tmp_path / "out")
    losses = [v for _, v in metric_steps(client_for(cfg.tracking.uri), result.run_id, "train/loss")]
    assert losses[0] > 3.5  # about ln(96) = 4.56 at the start
    assert losses[-1] < 0.8 * losses[0]
    assert (tmp_path / "out" / "model.onnx").is_file()


def test_ondevice_frozen_parameters_do_not_move(make_cfg, tmp_path):
    cfg = make_cfg("backend=ondevice", "backend.frozen_params=[net.0.*]", "trainer.max_steps=20")
    result = app.train(cfg, tmp_path / "out")
    backend = schema.build(cfg.backend, "backend")
    trained = backend.read_checkpoint(sorted((result.out_dir / "checkpoints").glob("*.ckpt"))[-1])
    torch.manual_seed(cfg.trainer.seed)
    initial = dict(schema.build(cfg.model, "model").named_parameters())
    assert torch.equal(torch.from_numpy(trained["net.0.weight"]), initial["net.0.weight"].detach())
    assert not torch.equal(torch.from_numpy(trained["net.2.weight"]), initial["net.2.weight"].detach())


# lr=0.01 for 30 steps drove ORT's own BCEWithLogitsLoss block to NaN; the stable block stays finite.
@pytest.mark.parametrize("target,loss", [("regression", "mse"), ("regression", "l1"), ("multilabel", "bce_with_logits")])
def test_ondevice_losses(target, loss, make_cfg, tmp_path):
    cfg = make_cfg("backend=ondevice", f"data.target={target}", f"data.loss={loss}", "trainer.max_steps=30",
                   "optimizer.lr=0.01")
    result = app.train(cfg, tmp_path / "out")
    losses = [v for _, v in result.history["train/loss"]]
    assert losses[-1] < losses[0]
    assert ("eval/accuracy" in result.history) == (loss == "bce_with_logits")


@pytest.mark.parametrize("backend", ["torch", pytest.param("compile", marks=pytest.mark.slow),
                                     pytest.param("ortmodule", marks=pytest.mark.slow),
                                     pytest.param("ondevice", marks=pytest.mark.slow), pytest.param(
    "runner", marks=long("tests/test_signals.py::test_a_signal_kills_the_run_and_resume_finishes_it[runner-SIGTERM]")),
    pytest.param("stages", marks=long("tests/backends/test_pipeline.py::test_a_killed_stage_restarts_the_group_from_"
                                      "the_checkpoint_to_the_same_losses (the same checkpoint, each stage's RNG)"))])
def test_resume_auto_continues_the_same_run_to_the_same_result(backend, make_cfg, tmp_path, capfd, request):
    """A run is killed with SIGKILL in step 27, after checkpoints at 10 and 20 (its data set kills
    the process: an on-device model runs inside ORT); the same command with trainer.resume=auto
    goes on from step 20 in the same MLflow run: every step logged once, and the losses and
    weights of a run that never stopped, through a linear warm-up and decay and dropout's masks.
    (capfd: ORTModule redirects the process's file descriptors while it exports.)"""
    marker = tmp_path / "kill_while_this_exists"
    marker.touch()
    overrides = [f"backend={backend}", "trainer.max_steps=40", "trainer.checkpoint_period=10",
                 "trainer.display_loss_steps=1", "trainer.evaluation_period=0", "trainer.lr_schedule=linear",
                 "trainer.warmup_steps=25", "model._target_=tests.helpers.DropoutMLP", "model.hidden=[32]",
                 "data._target_=tests.helpers.KillingData", "+data.kill_at=26", f"+data.marker={marker}"]
    readers = 2 if backend == "stages" else 1  # each stage reads every batch (the first its inputs, the last its targets)
    if backend == "stages":  # the runner with the model cut in 2 stages, the dropout in the second: each stage its own RNG
        backend, overrides = "runner", [*overrides, "trainer.pipeline_parallel_size=2", "model.hidden=[32,32]"]
        overrides[0] = "backend=runner"
    if backend == "runner":
        overrides += ["backend.engine=torch", "backend.max_failures=0", "trainer.num_workers=2", "trainer.batch_size=16"]
        request.getfixturevalue("ray_shared")  # the runs in this process; the killed command starts its own
    uri = make_cfg().tracking.uri
    # The first attempt is a command of its own, the process the data set kills: make_cfg's
    # settings on its command line, its outputs in tmp_path, tests.helpers importable (Ray's workers too).
    command = [sys.executable, "-m", "orchestrate", "data=synthetic", "trainer=quick", f"tracking.uri={uri}",
               *overrides, f"hydra.run.dir={tmp_path / 'first'}"]
    killed = subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                            text=True, timeout=600)
    assert not marker.exists(), killed.stderr[-2000:]
    # One process dies with its run; the runner's driver outlives its killed worker and fails the run.
    assert killed.returncode == (1 if backend == "runner" else -signal.SIGKILL), killed.stderr[-2000:]
    # The uninterrupted run (its own config: no marker), then the resume, both in this process (the
    # resume makes its run's experiment the active one, whatever an earlier run here set).
    reference = app.train(make_cfg(*overrides, "data.marker="), tmp_path / "reference")
    resumed = app.train(make_cfg(*overrides, "trainer.resume=auto"), tmp_path / "second")
    printed = capfd.readouterr().out
    assert f"resuming MLflow run {resumed.run_id} after step 20" in printed
    assert f"backend {backend}: steps 21 to 40 (20 in this process, resumed) in " in printed  # not "40 steps"
    assert served_twice(marker, readers) == list(range(20, 26))  # steps 21-26 ran again, none before

    client = client_for(uri)
    runs = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted([resumed.run_id, reference.run_id])  # the killed one went on
    # The summary's way into the UI ends on the experiment's runs table.
    assert f"\n  then open          http://127.0.0.1:5000/#/experiments/{runs[0].info.experiment_id}/runs\n" in printed
    assert client.get_run(resumed.run_id).info.status == "FINISHED"
    steps = metric_steps(client, resumed.run_id, "train/loss")
    assert [s for s, _ in steps] == list(range(1, 41))
    reference_steps = metric_steps(client, reference.run_id, "train/loss")
    assert [v for _, v in steps] == pytest.approx([v for _, v in reference_steps], abs=1e-6)
    backend_ = schema.build(make_cfg(*overrides).backend, "backend")
    last, expected = (next((tmp_path / name / "checkpoints").glob("step_0000040*")) for name in ("second", "reference"))
    state = backend_.load_checkpoint(last)
    assert (state["step"], state["micro_steps"], state["world_size"]) == (40, 40, 2 if backend == "runner" else 1)
    trained, uninterrupted = backend_.read_checkpoint(last), backend_.read_checkpoint(expected)
    assert trained.keys() == uninterrupted.keys()
    for k in uninterrupted:
        np.testing.assert_allclose(trained[k], uninterrupted[k], atol=1e-6, rtol=0, err_msg=k)


@pytest.mark.ort
def test_a_backend_that_cannot_resume_is_refused_naming_those_that_can(make_cfg, monkeypatch):
    """The backends and engines a refusal offers are found from their `resumable` flags."""
    monkeypatch.setattr(OnDeviceBackend, "resumable", False)
    with pytest.raises(schema.ConfigError, match="^trainer.resume=auto: backend=ondevice cannot load its checkpoints "
                                                 "to continue; allowed with backend=compile, ortmodule, runner, torch$"):
        Job.prepare(make_cfg("backend=ondevice", "trainer.resume=auto"))
    with pytest.raises(schema.ConfigError, match="^trainer.resume=auto: backend.engine=ondevice cannot continue from "
                                                 "a checkpoint; allowed engines: compile, ortmodule, torch$"):
        Job.prepare(make_cfg("backend=runner", "backend.engine=ondevice", "trainer.resume=auto"))


def test_resume_of_a_finished_config_starts_a_new_run(make_cfg, tmp_path):
    first = app.train(make_cfg("backend=torch"), tmp_path / "first")
    again = app.train(make_cfg("backend=torch", "trainer.resume=auto"), tmp_path / "again")
    assert again.run_id != first.run_id


def test_resume_auto_ends_runs_whose_process_is_gone_and_leaves_live_ones(make_cfg, tmp_path):
    """A run SIGKILLed before its first checkpoint has nothing to resume and would stay RUNNING;
    the next `trainer.resume=auto` of its config ends it KILLED. One whose process lives may be
    training: it is left alone."""
    import platform

    cfg = make_cfg("backend=torch", "trainer.resume=auto")
    client = client_for(cfg.tracking.uri)
    experiment = client.create_experiment(cfg.tracking.experiment)
    dead = subprocess.Popen(["true"])
    dead.wait()
    runs = {}
    for name, pid in (("dead", dead.pid), ("live", os.getpid())):
        runs[name] = client.create_run(experiment, tags={"config_key": config_key(cfg), "host": platform.node(),
                                                         "pid": str(pid)}).info.run_id
    result = app.train(cfg, tmp_path / "out")
    assert client.get_run(runs["dead"]).info.status == "KILLED"
    assert f"went on in run {result.run_id}" in client.get_run(runs["dead"]).data.tags["error"]
    assert client.get_run(runs["live"]).info.status == "RUNNING"
    assert client.get_run(result.run_id).info.status == "FINISHED"


def test_tensorboard_event_files_hold_the_logged_scalars(make_cfg, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = app.train(make_cfg("backend=torch", "trainer.tensorboard=true"), tmp_path / "out")
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    in_mlflow = metric_steps(client_for(make_cfg().tracking.uri), result.run_id, "train/loss")
    assert [s for s, _ in logged] == [s for s, _ in in_mlflow] == [5, 10, 15, 20, 25, 30]
    assert [v for _, v in logged] == pytest.approx([v for _, v in in_mlflow], rel=1e-6)
    artifacts = client_for(make_cfg().tracking.uri).list_artifacts(result.run_id, "tensorboard")
    assert len(artifacts) == 1 and "tfevents" in artifacts[0].path
    # The histogram and norm summaries, at the display steps alone: weights and gradients of every parameter.
    params = [name for name, _ in schema.build(make_cfg().model, "model").named_parameters()]
    assert sorted(events.Tags()["histograms"]) == sorted(f"{k}/{n}" for k in ("weights", "gradients") for n in params)
    assert [e.step for e in events.Histograms(f"gradients/{params[0]}")] == [5, 10, 15, 20, 25, 30]
    assert all(e.value > 0 for e in events.Scalars(f"norms/gradients/{params[0]}"))


def test_a_diverged_run_goes_on_from_its_last_checkpoint_with_a_lower_learning_rate(make_cfg, tmp_path):
    """The way out the error line names: the same command with a lower optimizer.lr (here also
    trainer.on_nonfinite=skip, the data being nan from step 7 whatever the rate) and
    trainer.resume=auto continues the FAILED run from its checkpoint before the nan."""
    from orchestrate.meter import Diverged

    same = ("backend=torch", "data._target_=tests.helpers.NanFrom", "+data.start=6", "trainer.max_steps=10",
            "trainer.display_loss_steps=1", "trainer.checkpoint_period=3", "trainer.evaluation_period=0")
    with pytest.raises(Diverged):
        app.train(make_cfg(*same, "optimizer.lr=0.01"), tmp_path / "first")
    client = client_for(make_cfg().tracking.uri)
    [first] = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert first.data.tags["diverged_at"] == "7"
    with pytest.raises(schema.ConfigError, match="a run that diverged may change optimizer.lr and "
                                                 "trainer.on_nonfinite only"):
        app.train(make_cfg(*same, "trainer.batch_size=8", f"trainer.resume={first.info.run_id}"), tmp_path / "x")

    result = app.train(make_cfg(*same, "optimizer.lr=0.001", "trainer.on_nonfinite=skip", "trainer.resume=auto"),
                       tmp_path / "second")
    assert result.run_id == first.info.run_id
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and not {"error", "diverged_at"} & set(run.data.tags)
    assert "optimizer.lr=0.001 (was 0.01)" in run.data.tags["resumed_at_6"]
    assert metric_steps(client, result.run_id, "lr") == [(s, 0.01) for s in range(1, 7)] + [
        (s, 0.001) for s in range(7, 11)]
    assert [s for s, _ in metric_steps(client, result.run_id, "train/skipped_steps")] == [7, 8, 9, 10]
