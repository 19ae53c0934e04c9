"""The on-device backend's own behaviour: BatchNorm trains and exports as in torch, and a model
ORT cannot differentiate is refused before the run."""

import numpy as np
import onnx
import onnxruntime
import pytest

from orchestrate import app, schema
from orchestrate.job import Job
from tests.helpers import fit_untracked


def test_batchnorm_trains_and_exports_its_running_statistics_like_torch(tmp_path):
    """model=cnn on digits, 60 steps from the same weights and batches (no dropout: its masks come
    from each backend's own generator). Tolerances: eval accuracy within 0.01 (3 of the 359 eval
    images); running statistics within 1% (ORT updates the running variance with the batch's
    population variance, torch with the unbiased one: a factor n/(n-1), n = 512 to 2048 here)."""
    steps = ["model=cnn", "model.dropout=0", "trainer=quick", "trainer.max_steps=60", "trainer.evaluation_period=0",
             "trainer.checkpoint_period=0"]
    torch_job = fit_untracked(["backend=torch", *steps, "backend.intra_op_threads=1"], tmp_path / "torch")
    ondevice_job = fit_untracked(["backend=ondevice", *steps], tmp_path / "ondevice")
    accuracy = ondevice_job.meter.final["eval_accuracy"]
    assert accuracy == pytest.approx(torch_job.meter.final["eval_accuracy"], abs=0.01)
    assert accuracy > 0.6  # 10 classes: learning, not chance

    # The exported model normalizes with the trained statistics, in inference mode.
    exported = onnx.load(str(ondevice_job.out_dir / "model.onnx"))
    norms = [n for n in exported.graph.node if n.op_type == "BatchNormalization"]
    assert len(norms) == 2 and all(len(n.output) == 1 for n in norms)
    assert all(a.i == 0 for n in norms for a in n.attribute if a.name == "training_mode")
    stats = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer if "running_" in t.name}
    trained = {n: b.numpy() for n, b in torch_job.model.named_buffers() if "running_" in n}
    assert sorted(stats) == sorted(trained)
    for name, value in stats.items():
        start = 0.0 if name.endswith("mean") else 1.0
        assert not np.allclose(value, start), f"{name} never moved"
        np.testing.assert_allclose(value, trained[name], rtol=0.01, atol=1e-4, err_msg=name)
    data = ondevice_job.data
    session = onnxruntime.InferenceSession(str(ondevice_job.out_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": data.x_eval.numpy()})[0]
    assert (logits.argmax(-1) == data.y_eval.numpy()).mean() == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.parametrize("backend", [["backend=ondevice"], ["backend=runner", "backend.engine=ondevice"]])
def test_a_model_ort_cannot_differentiate_is_refused_before_the_run(backend, make_cfg, tmp_path):
    cfg = make_cfg(*backend, "model._target_=tests.helpers.CumulativeMLP", "~model.hidden")
    with pytest.raises(schema.ConfigError, match=r"^model=tests.helpers.CumulativeMLP cannot train with "
                                                 r"backend=ondevice: ORT 1\.19\.2 has no gradient for the ONNX op "
                                                 r"CumSum \(node /CumSum of the exported model\)"):
        app.train(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()  # no run was opened


def test_batchnorm_without_a_momentum_is_refused(make_cfg, tmp_path):
    job = Job.prepare(make_cfg("backend=ondevice", "model=cnn", "data=digits"), tmp_path)
    job.model.features[1].momentum = None  # a cumulative average: torch's export traces one fixed momentum
    with pytest.raises(schema.ConfigError, match="its BatchNorm features.1 has momentum=None"):
        job.backend.check(job)


def test_a_language_model_checkpoint_names_the_models_own_parameters(tmp_path):
    """Its (B, T, V) logits reach the loss as the model gives them: no wrapper module, no prefix."""
    job = fit_untracked(["backend=ondevice", "model=char_transformer", "data=python_source", "model.n_layer=1",
                         "model.n_embd=32", "trainer=quick", "trainer.max_steps=1", "trainer.batch_size=4",
                         "trainer.evaluation_period=0", "trainer.checkpoint_period=1"], tmp_path)
    (checkpoint,) = (tmp_path / "checkpoints").glob("step_*")
    backend = schema.build(job.cfg.backend, "backend")  # as read later, by another process
    assert sorted(backend.read_checkpoint(checkpoint)) == sorted(n for n, _ in job.model.named_parameters())


@pytest.mark.parametrize("dropout, draws", [(True, True), (False, False)])
def test_the_loop_reseeds_ort_only_for_a_graph_that_draws_random_numbers(dropout, draws, tmp_path):
    """set_seed before every step keeps dropout's masks the same after a resume; a graph without
    a random op skips it (2% of a small model's step)."""
    import torch

    from orchestrate.backends.ondevice import draws_random
    from orchestrate.tasks.models import MLP
    from tests.helpers import DropoutMLP

    model = DropoutMLP(8, 3, hidden=[16]) if dropout else MLP(8, 3, hidden=[16])
    model.train()
    torch.onnx.export(model, (torch.randn(2, 8),), str(tmp_path / "m.onnx"), do_constant_folding=False,
                      training=torch.onnx.TrainingMode.TRAINING)
    assert draws_random(tmp_path / "m.onnx") is draws
