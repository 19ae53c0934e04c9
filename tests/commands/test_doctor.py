"""`orchestrate doctor` (orchestrate/doctor.py), run as a user runs it: a child process of this
environment's Python. The broken stacks are made through the environment that child starts in
(PYTHONPATH), so the real installation is never changed:
- a wrong onnx: a folder holding `onnx-1.17.0.dist-info` ahead of site-packages, which is what
  importlib.metadata (and pip) then report as installed;
- ORTModule's extensions not built: the installed onnxruntime package mirrored by symbolic links,
  all but the compiled extensions, ahead of site-packages (ORT itself then finds none: checked);
- a tracking server and a Ray cluster that do not answer: free ports on 127.0.0.1.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.commands import doctor
from tests import guide
from tests.helpers import command_exit, free_port, loopback_cluster

BACKENDS = sorted(p.stem for p in (Path(doctor.__file__).parent / "conf" / "backend").glob("*.yaml"))


def run_doctor(*args: str, cwd: Path, env: dict | None = None, timeout: int = 600) -> tuple[int, list[str], float]:
    """(exit code, stdout's lines, seconds) of `python -m orchestrate doctor ARGS`."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrate", "doctor", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return done.returncode, done.stdout.splitlines(), time.monotonic() - began


def check_name(line: str) -> str:
    """What a check is, without what it found: `smoke run backend=torch`, else its first word
    (`torch` of `OK    torch 2.6.0`, `tracking`, `ray:`)."""
    text = line[6:]
    return text.split(":")[0] if text.startswith("smoke run ") else text.split()[0]


def readme_sample() -> list[str]:
    """The lines of the guide's sample `orchestrate doctor` output (docs/doctor.md: the healthy
    machine's), found wherever the guide now shows it (tests/guide.py)."""
    readme = guide.text()
    block = readme[readme.index("On this project's machine (2 cores, no GPU):"):]
    block = block[block.index("```text\n") + len("```text\n"):]
    return block[:block.index("```")].strip().splitlines()


def status(lines: list[str]) -> dict[str, str]:
    """Each check's line (without its status word) -> "OK" or "FAIL"."""
    return {line[6:]: line[:6].strip() for line in lines if line.startswith(("OK    ", "FAIL  "))}


def ort_without_extensions(dest: Path) -> Path:
    """A folder to put ahead of site-packages: the installed `onnxruntime` package as symbolic
    links, except the compiled ORTModule extensions (the state of a fresh install). Its
    __pycache__ folders are the real ones: use it with PYTHONDONTWRITEBYTECODE=1."""
    real = doctor.ort_folder()
    rebuilt = {"training", "training/ortmodule", "training/ortmodule/torch_cpp_extensions"}

    def mirror(folder: Path, into: Path) -> None:
        into.mkdir(parents=True)
        extensions = folder == real / "training" / "ortmodule" / "torch_cpp_extensions"
        for child in folder.iterdir():
            if child.relative_to(real).as_posix() in rebuilt:
                mirror(child, into / child.name)
            elif not (extensions and child.suffix == ".so"):
                (into / child.name).symlink_to(child)

    mirror(real, dest / "onnxruntime")
    return dest


def fake_onnx(dest: Path, version: str = "1.17.0") -> Path:
    """A folder whose dist-info says onnx `version` is installed."""
    info = dest / f"onnx-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: onnx\nVersion: {version}\n")
    return dest


@pytest.mark.slow
def test_healthy_stack_passes_every_check_and_trains_every_backend(tmp_path):
    code, lines, seconds = run_doctor(cwd=tmp_path)
    print("\n".join(lines), f"\n({seconds:.0f} s)")
    checks = status(lines)
    assert code == 0, lines
    assert set(checks.values()) == {"OK"}
    for expected in ["python 3.11.", "torch 2.6.0", "onnx 1.16.2", "onnxruntime-training-cpu 1.19.2",
                     "onnxruntime build: CPU", "ORTModule's C++ extensions built and loadable",
                     "tracking sqlite:///mlflow.db (tracking.uri) answers", "ray: no cluster address"]:
        assert any(line.startswith(expected) for line in checks), (expected, lines)
    for backend in BACKENDS:
        assert any(line.startswith(f"smoke run backend={backend}: 30 steps, train loss ") for line in checks), lines
    assert lines[-1] == f"{len(checks)} checks: all OK"
    assert not list(tmp_path.iterdir())  # the smoke runs wrote in their own temporary folder
    # The guide (docs/doctor.md) shows this output: the same checks in the same order, and the same count.
    sample = readme_sample()
    assert [check_name(line) for line in sample if line.startswith("OK    ")] == [check_name(line) for line in lines
                                                                                if line.startswith("OK    ")]
    assert sample[-1] == lines[-1]


@pytest.mark.slow
def test_ray_cluster_at_the_address_is_joined_and_its_resources_shown(tmp_path):
    with loopback_cluster(nodes=1, cpus_per_node=1) as (address, env):
        code, lines, seconds = run_doctor("--no-smoke", cwd=tmp_path, env={**env, "RAY_ADDRESS": address})
    print("\n".join(lines), f"\n({seconds:.0f} s)")
    assert code == 0, lines
    assert f"OK    ray {address} (RAY_ADDRESS): 1 node(s), 1 CPUs, 0 GPUs" in lines


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """One doctor run on a stack broken four ways at once (each check is independent of the
    others, and one child process is cheaper than four): a wrong onnx, ORTModule's extensions
    missing, a tracking server and a Ray cluster that do not answer."""
    tmp = tmp_path_factory.mktemp("broken")
    hooks = [str(fake_onnx(tmp / "onnx")), str(ort_without_extensions(tmp / "ort"))]
    env = {"PYTHONPATH": os.pathsep.join([*hooks, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONDONTWRITEBYTECODE": "1"}  # the hooks ahead of everything, site-packages included
    tracking, ray = f"http://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    code, lines, seconds = run_doctor("--no-smoke", "--tracking-uri", tracking, "--ray-address", ray, cwd=tmp,
                                      env=env, timeout=300)
    print("\n".join(lines), f"\n({seconds:.0f} s)")
    return dict(code=code, lines=lines, seconds=seconds, env=env, tracking=tracking, ray=ray)


def failures(broken) -> list[str]:
    return [line for line, state in status(broken["lines"]).items() if state == "FAIL"]


@pytest.mark.ort  # two of its four failures are ORT's
def test_broken_stack_exits_1_and_counts_the_failures(broken):
    assert broken["code"] == 1
    assert len(failures(broken)) == 4, broken["lines"]
    assert broken["lines"][-1].endswith("OK, 4 FAIL")
    assert "(smoke runs skipped: --no-smoke)" in broken["lines"]
    # The checks that were not broken still pass.
    assert {"python", "torch", "onnxruntime-training-cpu", "onnxruntime"} <= {
        line.split()[0] for line, state in status(broken["lines"]).items() if state == "OK"}


@pytest.mark.ort  # the `ort` extra's onnx pin and ORTModule's extensions
def test_wrong_onnx_version_names_both_versions_and_the_fix(broken):
    assert "onnx 1.17.0 (tested: 1.16.2) -> pip install onnx==1.16.2" in failures(broken)


@pytest.mark.ort  # the `ort` extra's onnx pin and ORTModule's extensions
def test_missing_extension_build_names_the_build_command(broken):
    (line,) = [f for f in failures(broken) if f.startswith("ORTModule's C++ extensions")]
    assert "not built" in line and "python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install" in line
    # The hook is what ORTModule itself sees: it would refuse to start for want of its extensions.
    code = "from onnxruntime.training import ortmodule; print(ortmodule._FALLBACK_INIT_EXCEPTION)"
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **broken["env"]}).stdout
    assert "ORTModule's extensions were not detected" in seen


def test_unreachable_tracking_uri_fails_within_seconds(broken):
    (line,) = [f for f in failures(broken) if f.startswith("tracking")]
    assert broken["tracking"] in line and "-> " in line
    # The whole run (imports included) is bounded by the checks' timeouts, not MLflow's retries.
    assert broken["seconds"] < 120


def test_unreachable_ray_address_fails_without_hanging(broken):
    (line,) = [f for f in failures(broken) if f.startswith("ray")]
    assert broken["ray"] in line and "nothing answers" in line and "-> " in line
    assert broken["seconds"] < 120  # a TCP check first: Ray's own connect would retry for minutes


def test_bad_override_is_refused_with_exit_code_2(capsys):
    assert command_exit(doctor.main, ["tracking=nope", "--no-smoke"]) == 2
    assert "tracking=nope: no such choice" in capsys.readouterr().err


@pytest.mark.parametrize("ort_cuda, providers, torch_cuda, driver, expected", [
    ("11.8", ["CUDAExecutionProvider", "CPUExecutionProvider"], "11.8", "12.4", None),
    ("11.8", ["CUDAExecutionProvider"], "12.4", "12.4", "torch for CUDA 12.4"),
    ("11.8", ["CUDAExecutionProvider"], "11.8", "10.2", "the driver supports CUDA 10.2"),
    ("11.8", ["CUDAExecutionProvider"], "11.8", None, "no NVIDIA driver"),
    ("11.8", ["CPUExecutionProvider"], "11.8", "12.4", "CUDA provider does not load"),
])
def test_gpu_build_checks_cuda_against_torch_and_the_driver(ort_cuda, providers, torch_cuda, driver, expected):
    """The GPU branch cannot run on this machine: its decisions, one by one."""
    problem = doctor.gpu_build_problem(ort_cuda, providers, torch_cuda, driver)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and "-> " in problem
