"""ORTModule's backend (orchestrate/backends/ortmodule.py): what it refuses before a run opens."""

import sys

import pytest
import torch

from orchestrate.backends.ortmodule import torch_too_new


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.5.1", "2.4.1+cpu"])
def test_torch_up_to_ortmodules_ceiling_is_taken(version):
    assert torch_too_new(version) is None


@pytest.mark.parametrize("version", ["2.7.0", "2.14.1+cu130", "2.15.0", "3.0.0"])
def test_a_newer_torch_is_refused_naming_what_trains_with_it(version):
    """ORT 1.19.2's C++ extensions fail to build above torch 2.6 (2.7: an undefined symbol;
    2.14 on Python 3.12: the build fails), inside the run: refused up front instead."""
    assert torch_too_new(version) == (
        f"backend=ortmodule needs torch 2.6 at most (ORT 1.19.2's ORTModule builds its C++ extensions against it), "
        f"and this environment has torch {version}: pip install 'orchestrate[ort]' torch==2.6.0 (the ORT stack: "
        "constraints.txt, Python 3.11), or train with backend=ondevice (ORT's on-device API, which runs with this "
        "torch), backend=torch or backend=compile")


@pytest.mark.ort
def test_this_environments_torch_is_taken():
    assert torch_too_new(torch.__version__) is None  # the ORT stack pins torch 2.6.0


@pytest.mark.ort
def test_a_shape_inference_failure_inside_the_run_is_named_in_its_error_line(tmp_path, monkeypatch, capfd):
    """Where the check does not foresee it (here: the check's inference skipped), ORTModule's own
    failure on its first step names the backend, the step of ORT that failed and what trains the
    model instead, not a bare `AssertionError at step 1`."""
    from orchestrate.backends.ortmodule import ORTModuleBackend
    from orchestrate.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ORTModuleBackend, "check_export", lambda self, job: None)
    monkeypatch.setattr(sys, "argv", ["orchestrate", "model=char_transformer", "data=python_source",
                                      "model._target_=tests.helpers.TiedEncoderLM", "model.n_embd=32",
                                      "trainer.max_steps=3", "trainer.progress=false"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    err = capfd.readouterr().err.strip().splitlines()[-1]  # capfd: ORTModule writes around the real stdout
    assert err.startswith("error: backend=ortmodule: ORT's symbolic shape inference of ORTModule's export failed on "
                          "this model (backend=ondevice, backend=torch or backend=compile train it instead); ORT said: "
                          "AssertionError at step 1; the MLflow run "), err
