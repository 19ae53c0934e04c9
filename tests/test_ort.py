"""How loud ORT is (`backend.log_level`): by default the console shows orchestrate's own lines and
the progress bar; ORTModule's banner, ORT's C++ log lines, the exporter's and ORT's import
warnings go to the run's log file, and reach the console only when asked for. And what ORTModule
leaves behind in torch.onnx does not reach the models orchestrate exports."""

import io
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from orchestrate import ort, process
from orchestrate.backends.torch import export_for_training, export_onnx
from tests.helpers import prints_no_cuda_notice


@pytest.fixture
def console_and_file(tmp_path):
    """A console handler and a log file on the root logger, as Hydra's job logging sets them up."""
    console = logging.StreamHandler(io.StringIO())
    file = logging.FileHandler(tmp_path / "run.log")
    root = logging.getLogger()
    root.addHandler(console)
    root.addHandler(file)
    try:
        yield console.stream, tmp_path / "run.log"
    finally:
        root.removeHandler(console)
        root.removeHandler(file)
        file.close()


def emit_ort_output(tag: str) -> None:
    """One of each kind of output ORT makes, and one line of the user's own."""
    logging.getLogger("orttraining").warning(f"{tag} ***** ORTModule is accelerating your model *****")
    ort_file = os.path.join(ort._ort_sources()[0], "training", "utils", "hooks", "_zero_offload_subscriber.py")
    warnings.warn_explicit(f"{tag} DeepSpeed import error", UserWarning, ort_file, 173)
    with ort.stderr_logged():  # what ORT's C++ logger writes to file descriptor 2
        os.write(2, f"2026-01-01 [I:onnxruntime:Default, graph_transformer.cc:15 Apply] {tag} GraphTransformer\n"
                    f"2026-01-01 [W:onnxruntime:Default, session.cc:1 Run] {tag} careful\n".encode())
    logging.getLogger("orchestrate.mine").warning(f"{tag} my own warning")


def test_ort_output_goes_to_the_log_file_and_to_the_console_from_the_level_up(console_and_file):
    console, log_file = console_and_file
    with process.kept():
        ort.quiet("ERROR")
        emit_ort_output("quiet")
        logging.getLogger("orttraining").warning("Fallback to PyTorch due to exception <class 'RuntimeError'>")
        ort.quiet("WARNING")
        emit_ort_output("loud")
    shown, logged = console.getvalue(), log_file.read_text()
    assert "quiet my own warning" in shown
    assert "Fallback to PyTorch" in shown  # ORTModule stopped training through ORT: always on the console
    for what in ("quiet ***** ORTModule", "quiet DeepSpeed", "quiet GraphTransformer", "quiet careful"):
        assert what not in shown
        assert what in logged
    for what in ("loud ***** ORTModule", "loud DeepSpeed", "loud careful", "loud my own warning"):
        assert what in shown
    assert "loud GraphTransformer" not in shown  # an INFO line
    assert "loud GraphTransformer" in logged


class Rescaled(torch.nn.Module):
    """A model whose forward turns a tensor into a Python number, as the character transformer
    does with its attention scale: torch's tracer warns (TracerWarning) on every export."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) / float(x.abs().max())


def test_an_exports_warnings_go_to_the_log_file_and_to_the_console_from_the_level_up(console_and_file, tmp_path):
    console, log_file = console_and_file
    filters, handlers = list(warnings.filters), {h: list(h.filters) for h in ort.console_handlers()}
    model, sample = Rescaled(), torch.ones(3, 4)
    export_onnx(model, sample, tmp_path / "quiet.onnx")  # model.onnx at a checkpoint and at the end
    export_for_training(model, sample, opset=17)  # ORTModule's check and the on-device artifacts
    shown, logged = console.getvalue(), log_file.read_text()
    assert "Warning" not in shown, shown
    assert "TracerWarning: Converting a tensor to a Python float" in logged  # (torch 2.6's FutureWarning on
    # `training` too: "Warning" above is not on the console; torch 2.14 raises none)
    export_onnx(model, sample, tmp_path / "loud.onnx", log_level="WARNING")  # backend.log_level=WARNING
    assert "TracerWarning" in console.getvalue()
    # Python's warning filters and the console's filters are as they were.
    assert warnings.filters == filters
    assert {h: list(h.filters) for h in ort.console_handlers()} == handlers


@pytest.mark.slow
def test_what_orts_first_import_prints_goes_to_the_log_file(tmp_path):
    """torch's "No CUDA runtime is found" (on a machine with a CUDA toolkit and no GPU), printed
    while ORT is imported: where a job is built before its backend has set anything (a sweep
    trial's process, a runner worker), with a console and a log file as Hydra's job logging has."""
    code = ("import logging, sys; root = logging.getLogger(); root.setLevel(logging.INFO); "
            "root.addHandler(logging.StreamHandler(sys.stderr)); "
            f"root.addHandler(logging.FileHandler({str(tmp_path / 'run.log')!r})); "
            "from orchestrate import ort; ort.load(); print('imported', flush=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "imported\n", done.stderr[-3000:]
    assert done.stderr == ""
    if prints_no_cuda_notice():
        assert "No CUDA runtime is found" in (tmp_path / "run.log").read_text()


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "orchestrate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def full_log(printed: str) -> Path:
    """The log file the summary names."""
    found = re.search(r"^  full log +(\S+)$", printed, re.MULTILINE)
    assert found, printed[-2000:]
    return Path(found.group(1))


# What ORT printed before the first step before it was kept off the console.
ORT_MARKERS = ("****", "accelerating your model", "DeepSpeed", "Warning", "No CUDA runtime", "GraphTransformer",
               "[orttraining]", "[py.warnings]")


def short_run(tmp_path, backend: str, *more: str) -> tuple[str, str]:
    """A 5-step run of `backend`: (what it printed, its stdout)."""
    done = run_cli(f"backend={backend}", "trainer.max_steps=5", "trainer.progress=false", *more, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr, done.stdout


@pytest.mark.slow
def test_ortmodule_is_quiet_by_default_and_loud_when_asked(tmp_path):
    printed, stdout = short_run(tmp_path, "ortmodule")
    assert [m for m in ORT_MARKERS if m in printed] == [], printed
    log = full_log(stdout)
    assert log.is_file() and log.parent.parent.parent == tmp_path / "outputs"
    logged = log.read_text()
    for what in ("accelerating your model", "DeepSpeed import error", "FutureWarning"):
        assert what in logged

    printed, stdout = short_run(tmp_path, "ortmodule", "backend.log_level=WARNING")
    assert "accelerating your model" in printed and "DeepSpeed import error" in printed
    assert full_log(stdout).is_file()


@pytest.mark.slow
def test_ondevice_is_quiet_by_default(tmp_path):
    printed, stdout = short_run(tmp_path, "ondevice")
    assert [m for m in ORT_MARKERS if m in printed] == [], printed
    assert "[root][INFO]" not in printed  # the artifact builder's "Saved training model to ..."
    logged = full_log(stdout).read_text()
    for what in ("GraphTransformer", "Saved training model", "FutureWarning"):
        assert what in logged


@pytest.mark.slow
def test_the_exporters_tracer_warning_goes_to_the_log_file(tmp_path):
    """The README's character transformer on PyTorch: torch's tracer warns while model.onnx is
    exported (the attention scale is a Python number); the run's log file has it, the console not."""
    printed, stdout = short_run(tmp_path, "torch", "model=char_transformer", "data=python_source",
                                "trainer.batch_size=16")
    assert [m for m in ORT_MARKERS if m in printed] == [], printed
    assert "TracerWarning" in full_log(stdout).read_text()


def test_a_model_exported_after_an_ortmodule_loads_in_an_inference_session(tmp_path):
    """ORTModule registers ORT's symbolics with torch.onnx for the rest of the process (MaxPool2d
    as an `ATen` node, which inference sessions cannot run); the trained model exported after it
    (the same process: ORTModule's own run, backend=auto, a sweep's reused worker) is standard
    ONNX, and ORTModule's symbolics are back for the ORTModules still alive."""
    import onnxruntime
    from onnxruntime.training.ortmodule import ORTModule
    from torch.onnx._internal import registration

    from orchestrate.tasks.models import ConvNet

    torch.manual_seed(0)
    wrapped = ORTModule(ConvNet(64, 10))
    wrapped(torch.randn(4, 64)).sum().backward()  # its first step registers the symbolics
    registered = registration.registry.get_function_group("aten::max_pool2d")._functions
    assert any(registered.overridden(opset) for opset in range(1, 100))
    model = ConvNet(64, 10).eval()
    export_onnx(model, torch.randn(2, 64), tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x).numpy()
    assert session.run(None, {"input": x.numpy()})[0] == pytest.approx(expected, abs=1e-5)
    assert any(registered.overridden(opset) for opset in range(1, 100))
    wrapped(torch.randn(4, 64)).sum().backward()  # and ORTModule still trains
