"""How loud ORT is (`backend.log_level`): by default the console shows orchestrate's own lines and
the progress bar; ORTModule's banner, ORT's C++ log lines, the exporter's and ORT's import
warnings go to the run's log file, and reach the console only when asked for."""

import io
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from orchestrate import ort, process


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
