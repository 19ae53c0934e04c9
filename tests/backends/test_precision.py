"""trainer.precision and trainer.tf32 on the PyTorch loop (CPU here: bf16 autocast runs on CPU;
TF32 is a CUDA setting, so only the flag torch reads is checked), and the one line an ORT backend
gives for a precision it does not train in."""

import pytest
import torch

from orchestrate.config import load_config
from orchestrate.job import Job
from orchestrate.schema import ConfigError
from tests.helpers import DtypeMLP, fit_untracked

SMALL = ["data=synthetic", "trainer=quick", "trainer.max_steps=40", "optimizer.lr=0.01",
         "model._target_=tests.helpers.DtypeMLP", "model.hidden=[32]"]


def test_bf16_autocasts_the_forward_and_trains(tmp_path):
    DtypeMLP.seen.clear()
    job = fit_untracked(["backend=torch", "trainer.precision=bf16", *SMALL], tmp_path)
    assert {dtype for dtype, _ in DtypeMLP.seen} == {torch.bfloat16}  # every training step, under autocast
    losses = [v for _, v in job.meter.history["train/loss"]]
    assert losses[-1] < 0.7 * losses[0]
    assert (tmp_path / "model.onnx").is_file()  # exported in fp32, as every backend's


@pytest.mark.parametrize("tf32", [True, False])
def test_trainer_tf32_reaches_torch_and_is_put_back(tf32, tmp_path):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    try:
        DtypeMLP.seen.clear()
        fit_untracked(["backend=torch", f"trainer.tf32={tf32}", *SMALL], tmp_path)
        assert {flag for _, flag in DtypeMLP.seen} == {tf32}
        assert torch.backends.cuda.matmul.allow_tf32 is (not tf32)  # as the process had it
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("backend, takes", [("ortmodule", "fp32, fp16"), ("ondevice", "fp32")])
def test_an_ort_backend_refuses_bf16_naming_what_it_takes(backend, takes, tmp_path):
    cfg = load_config([f"backend={backend}", "trainer.precision=bf16", "data=synthetic", "trainer=quick"])
    with pytest.raises(ConfigError) as e:
        Job.prepare(cfg, tmp_path)
    assert str(e.value) == f"trainer.precision=bf16: backend={backend} trains in {takes}; bf16 with backend=compile, torch"


@pytest.mark.ort
def test_the_runner_trains_in_its_engines_precisions(tmp_path):
    torch_engine = load_config(["backend=runner", "backend.engine=torch", "trainer.precision=bf16", "data=synthetic",
                                "trainer=quick"])
    Job.prepare(torch_engine, tmp_path)  # accepted: the workers run the PyTorch loop
    with pytest.raises(ConfigError, match="^trainer.precision=bf16: backend=ondevice trains in fp32; "
                                                "bf16 with backend=compile, torch"):
        Job.prepare(load_config(["backend=runner", "backend.engine=ondevice", "trainer.precision=bf16",
                                 "data=synthetic", "trainer=quick"]), tmp_path)
