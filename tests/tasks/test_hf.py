"""The Hugging Face models (orchestrate/tasks/hf.py): built offline, silent, and trained alike by
every backend: torch, ORTModule and the on-device API agree on the first steps' losses, and the
runner's workers train the classifier well above chance."""

import socket
import subprocess
import sys
import warnings

import pytest
import torch

from orchestrate import app
from orchestrate.config import load_config
from tests.conftest import ROOT, long

TASKS = {"hf_causal_lm": "python_source", "hf_classifier": "python_files"}  # model -> the data it goes with


def test_models_build_offline_and_export_without_a_word(monkeypatch, tmp_path, capfd):
    """Nothing is downloaded (no socket connects while building), the loops get one tensor of
    logits, `model.dropout` sets every HF dropout, and exporting to ONNX as the on-device API does
    (ORTModule and the final model.onnx trace the same forward) raises no warning from the model's
    code and prints nothing."""
    from orchestrate.tasks.hf import CausalLM, Classifier

    def refuse(self, address):
        raise AssertionError(f"network call to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    x = torch.randint(0, 96, (2, 16))
    for model, logits in [(CausalLM(96, 16, n_layer=1, n_embd=32, dropout=0.2), (2, 16, 96)),
                          (Classifier(96, 16, num_classes=4, n_layer=1, n_embd=32, dropout=0.2), (2, 4))]:
        assert model(x).shape == logits
        dropouts = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
        assert dropouts == {0.2}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.onnx.export(model, (x,), str(tmp_path / "model.onnx"), opset_version=15,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
        # torch's own FutureWarning about the `training` argument is not the model's.
        assert [str(w.message) for w in caught
                if issubclass(w.category, torch.jit.TracerWarning) or "transformers" in w.filename] == []
    out, err = capfd.readouterr()
    assert out == err == ""


def test_transformers_is_imported_only_when_an_hf_model_is_chosen(tmp_path):
    """transformers takes seconds to import: the default run's objects are built without it."""
    code = ("import sys; from orchestrate.config import load_config; from orchestrate.job import Job; "
            f"Job.prepare(load_config(['backend=torch', 'tracking.uri=sqlite:///{tmp_path}/m.db']), '{tmp_path}'); "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def first_losses(backend: str, model: str, tmp_path) -> list[float]:
    # A tenth of the usual text: ten batches of 8 need little, and the final evaluation reads it all.
    overrides = [f"backend={backend}", f"model={model}", f"data={TASKS[model]}", "data.max_chars=30000",
                 "model.dropout=0", "trainer=quick", "trainer.max_steps=10", "trainer.batch_size=8",
                 "trainer.display_loss_steps=1", "trainer.evaluation_period=0", "trainer.checkpoint_period=0",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    if backend == "ortmodule":
        # A model ORTModule cannot export would otherwise train on in PyTorch, with a warning:
        # without the fallback, the losses below are ORT's.
        overrides.append("+backend.options.ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE")
    result = app.train(load_config(overrides), tmp_path / backend)
    return [v for _, v in result.history["train/loss"]]


# Dropout off: torch and ORT draw different random masks. Same seed, same weights, same batches:
# measured on a 2-core x86 CPU, the first losses differed by at most 9e-8 relative (one float32
# rounding) and the first ten by at most 1.9e-7 (the on-device API on GPT-2). The tolerances, 10x
# and 50x that, leave room for other CPUs' kernels, which sum in another order, and stay far below
# the loss's change per step (about 1e-2): a missing mask or a wrong gradient would fail.
@pytest.mark.slow  # about 25 s each: three short runs, ORTModule's export and the on-device artifacts
@pytest.mark.parametrize("model", TASKS)
def test_torch_ortmodule_and_ondevice_agree_on_the_first_steps(model, tmp_path):
    runs = {b: first_losses(b, model, tmp_path) for b in ["torch", "ortmodule", "ondevice"]}
    reference = runs["torch"]
    assert len(reference) == 10
    for backend in ("ortmodule", "ondevice"):
        assert runs[backend][0] == pytest.approx(reference[0], rel=1e-6), backend
        assert runs[backend] == pytest.approx(reference, rel=1e-5), backend


@pytest.mark.slow  # about a minute: Ray starts two workers
@long("test_torch_ortmodule_and_ondevice_agree_on_the_first_steps; "
      "tests/backends/test_runner.py::test_two_workers_with_batch_b_equal_one_worker_with_batch_2b_and_stay_identical")
def test_runner_workers_train_the_classifier_well_above_chance(tmp_path):
    cfg = load_config(["backend=runner", "backend.engine=ortmodule", "trainer.num_workers=2", "model=hf_classifier",
                           "data=python_files", "trainer=quick", "trainer.max_steps=100", "trainer.batch_size=16",
                           "trainer.evaluation_period=0", "trainer.checkpoint_period=0", "optimizer.lr=1e-3",
                           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])
    result = app.train(cfg, tmp_path / "out")
    losses = [v for _, v in result.history["train/loss"]]
    assert losses[-1] < 0.7 * losses[0]  # from about ln(4) = 1.39
    (_, accuracy), = result.history["eval/accuracy"]
    assert accuracy > 0.5  # four balanced classes: chance is 0.25
    assert (tmp_path / "out" / "model.onnx").is_file()
