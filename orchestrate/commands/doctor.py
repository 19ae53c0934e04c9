"""`orchestrate doctor`: will this stack train? One line per check, each OK or the problem and the
command that fixes it; exit code 0 only when every check passes (1 otherwise, 2 for bad arguments).

    orchestrate doctor                                # everything, smoke runs included (about 1-2 minutes)
    orchestrate doctor --no-smoke                     # seconds: everything but the smoke runs
    orchestrate doctor --tracking-uri http://127.0.0.1:5000 --ray-address 127.0.0.1:6379
    orchestrate doctor tracking=server trainer.device=cuda   # Hydra overrides: the config that is checked

The checks, in order:
- Python and every dependency against what orchestrate declares (pyproject.toml in a checkout,
  the installed package's metadata otherwise), so there is one table, not two; where ORT's training
  build is installed, the `ort` extra's pins too;
- which backends train here: those whose packages are missing (an extra: orchestrate.extras) are
  named with the line that installs them, a note, not a failure (the base install is whole);
- where ORT is installed: its build (CPU or GPU package, its execution providers, and for a GPU
  build whether its CUDA matches torch's and the driver's), and ORTModule's C++ extensions: built
  (the check ORTModule itself makes) and loadable by this torch;
- the tracking URI answers; the Ray cluster answers (when an address is set), with its resources;
- a smoke run per backend that trains here (every conf/backend/*.yaml): a few steps of
  `data=synthetic trainer=quick` through `orchestrate.app.train`, tracked in a temporary SQLite store.
"""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from orchestrate import extras
from orchestrate.errors import first_line

EXTENSIONS_INSTALL = "python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install"
# Both packages install the one `onnxruntime` module (training included); the inference-only
# `onnxruntime` package installs it too and would replace the training build's files.
ORT_BUILDS = ("onnxruntime-training-cpu", "onnxruntime-training")
SMOKE = ["data=synthetic", "trainer=quick", "trainer.num_workers=1"]


class Report:
    """Prints each check's line as soon as it is known (the smoke runs take a while) and counts."""

    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, ok: bool, line: str) -> bool:
        """`OK    line`, or `FAIL  line` (a failure's line ends with `-> the command that fixes it`)."""
        self.passed, self.failed = self.passed + ok, self.failed + (not ok)
        print(f"{'OK' if ok else 'FAIL':<6}{line}", flush=True)
        return ok


# ---- the tested stack --------------------------------------------------------------------------

def tested_stack(extra: str = "") -> tuple[str, list[Requirement]]:
    """(requires-python, the dependencies) as orchestrate declares them, the base install's or
    `extra`'s: the checkout's pyproject.toml when this code runs from one (an editable install's
    metadata is only as new as its last `pip install -e .`), else the installed distribution's
    metadata. Requirements whose markers leave them out of this environment are left out."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"  # orchestrate/commands/ -> the checkout
    if pyproject.is_file() and tomllib.loads(pyproject.read_text()).get("project", {}).get("name") == "orchestrate":
        project = tomllib.loads(pyproject.read_text())["project"]
        python = project["requires-python"]
        listed = project["optional-dependencies"][extra] if extra else project["dependencies"]
        requirements = [Requirement(r) for r in listed]
        return python, [r for r in requirements if r.marker is None or r.marker.evaluate()]
    python = importlib.metadata.metadata("orchestrate")["Requires-Python"]
    requirements = [Requirement(r) for r in importlib.metadata.requires("orchestrate") or []]
    if not extra:
        return python, [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    return python, [r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})
                    and not r.marker.evaluate({"extra": ""})]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_install(req: Requirement) -> str:
    """The pip command that installs `req` as declared (its marker, which chose it, left out)."""
    text = f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}"
    return f"pip install '{text}'" if any(c in text for c in "[<>,;") else f"pip install {text}"


def tested(req: Requirement) -> str:
    """`1.16.2` for an exact pin, else the specifier (`<2.4,>=2.3`)."""
    pins = list(req.specifier)
    return pins[0].version if len(pins) == 1 and pins[0].operator == "==" else str(req.specifier)


def check_python(requires: str) -> tuple[bool, str]:
    version = platform.python_version()
    if version in SpecifierSet(requires):
        return True, f"python {version}"
    return False, f"python {version} (orchestrate installs on {requires}) -> make setup PYTHON=python3.11"


def check_requirement(req: Requirement) -> tuple[bool, str]:
    if req.name in ORT_BUILDS:  # either build meets the pin (the GPU machine's image has the GPU one)
        return check_ort_package(req)
    version = installed(req.name)
    if version is None:
        return False, f"{req.name} not installed -> {pip_install(req)}"
    if req.specifier and version not in req.specifier:
        return False, f"{req.name} {version} (tested: {tested(req)}) -> {pip_install(req)}"
    return True, f"{req.name} {version}"


def check_ort_package(req: Requirement) -> tuple[bool, str]:
    found = {name: installed(name) for name in [*ORT_BUILDS, "onnxruntime"]}
    present = {name: v for name, v in found.items() if v is not None}
    if not present:
        return False, f"{req.name} not installed -> {pip_install(req)}"
    if len(present) > 1:  # they overwrite each other's files in site-packages/onnxruntime
        return False, (f"{', '.join(f'{n} {v}' for n, v in present.items())} all installed, one `onnxruntime` "
                       f"module between them -> pip uninstall -y {' '.join(present)} && {pip_install(req)}")
    name, version = next(iter(present.items()))
    if name == "onnxruntime":
        return False, (f"onnxruntime {version}: the inference-only build (no training) -> "
                       f"pip uninstall -y onnxruntime && {pip_install(req)}")
    if version not in req.specifier:
        fix = pip_install(Requirement(name + str(req.specifier)))
        return False, f"{name} {version} (tested: {tested(req)}) -> {fix}"
    return True, f"{name} {version}"


# ---- the ONNX Runtime build --------------------------------------------------------------------

def ort_folder() -> Path | None:
    spec = importlib.util.find_spec("onnxruntime")
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (Python's prints, ORT's C++ logger, Ray's forwarded worker output)
    go to `path` meanwhile: the doctor's own output stays one line per check."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def driver_cuda() -> str | None:
    """The newest CUDA the NVIDIA driver supports ("CUDA Version: 12.4" in nvidia-smi's header),
    or None without a driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return found.group(1) if found else None


def gpu_build_problem(ort_cuda: str, providers: list[str], torch_cuda: str | None, driver: str | None) -> str | None:
    """Why a GPU build of ORT training cannot run here, or None. ORT's CUDA libraries and torch's
    must share a major version (one process loads both), and the driver must support it."""
    major = ort_cuda.split(".")[0]
    if driver is None:
        return ("GPU build but no NVIDIA driver (nvidia-smi not found) -> install the driver, or use the CPU "
                "build: pip uninstall -y onnxruntime-training && pip install onnxruntime-training-cpu==1.19.2")
    if int(driver.split(".")[0]) < int(major):
        return f"built for CUDA {ort_cuda}, the driver supports CUDA {driver} -> upgrade the NVIDIA driver"
    if torch_cuda is None:
        return (f"built for CUDA {ort_cuda}, torch is a CPU build -> pip install torch==2.6.0 "
                f"--index-url https://download.pytorch.org/whl/cu{ort_cuda.replace('.', '')}")
    if torch_cuda.split(".")[0] != major:
        return (f"built for CUDA {ort_cuda}, torch for CUDA {torch_cuda} -> pip install torch==2.6.0 "
                f"--index-url https://download.pytorch.org/whl/cu{ort_cuda.replace('.', '')}")
    if "CUDAExecutionProvider" not in providers:
        return (f"built for CUDA {ort_cuda} but its CUDA provider does not load (providers: {', '.join(providers)}) "
                f"-> install the CUDA {ort_cuda} and cuDNN 8 libraries (see Dockerfile, target gpu)")
    return None


def check_ort_build(scratch: Path) -> tuple[bool, str]:
    folder = ort_folder()
    if folder is None:
        return False, "onnxruntime build: none installed -> pip install onnxruntime-training-cpu==1.19.2"
    try:
        # Its first import prints (torch's cpp_extension on a machine without CUDA).
        with output_to(scratch / "onnxruntime-import.log"):
            import onnxruntime
            import torch
            from onnxruntime.capi import build_and_package_info as info  # what the package says it is

            providers = onnxruntime.get_available_providers()
    except Exception as e:
        return False, (f"onnxruntime build: import onnxruntime fails ({first_line(e, typed=True)}) -> pip install "
                       f"--force-reinstall onnxruntime-training-cpu==1.19.2")
    package, cuda = getattr(info, "package_name", "?"), getattr(info, "cuda_version", "")
    if not (folder / "training").is_dir():
        return False, ("onnxruntime build: no onnxruntime.training module (an inference-only build) -> "
                       "pip uninstall -y onnxruntime && pip install onnxruntime-training-cpu==1.19.2")
    what = f"onnxruntime build: {'GPU' if cuda else 'CPU'} ({package}; providers {', '.join(providers)})"
    if not cuda:
        gpu = torch.cuda.is_available()
        return True, what + ("; this machine has a GPU: onnxruntime-training==1.19.2 would use it" if gpu
                             else "; no GPU")
    what += f", CUDA {cuda}; torch CUDA {torch.version.cuda}"
    problem = gpu_build_problem(cuda, providers, torch.version.cuda, driver_cuda())
    return problem is None, what if problem is None else f"{what}: {problem}"


def check_extensions(scratch: Path) -> tuple[bool, str]:
    """Built: the check ORTModule makes on import (orchestrate.backends.ortmodule.extensions_built).
    Loadable: each compiled extension imports against this torch (a torch upgraded after the build
    leaves them with undefined symbols)."""
    from orchestrate.backends.ortmodule import extensions_built

    what = "ORTModule's C++ extensions"
    fix = f"-> {EXTENSIONS_INSTALL} (or make setup; about 2 minutes)"
    try:
        if not extensions_built():
            return False, f"{what} not built (none in {ort_folder() / 'training/ortmodule/torch_cpp_extensions'}) {fix}"
    except RuntimeError as e:  # onnxruntime is not installed: its own line says so
        return False, f"{what}: {e}"
    folder = ort_folder() / "training" / "ortmodule" / "torch_cpp_extensions"
    names = []
    with output_to(scratch / "extensions.log"):
        for path in sorted(p for p in folder.iterdir() if p.suffix in (".so", ".dll", ".dylib")):
            name = path.name.split(".")[0]
            try:  # by the name ORT imports them with (a second name would load the library twice)
                importlib.import_module(f"onnxruntime.training.ortmodule.torch_cpp_extensions.{name}")
            except Exception as e:
                return False, f"{what}: {name} does not load ({first_line(e, typed=True)}): built for another torch? {fix}"
            names.append(name)
    return True, f"{what} built and loadable ({', '.join(names)})"


# ---- services ----------------------------------------------------------------------------------

def check_tracking(uri: str, source: str, timeout_s: float) -> tuple[bool, str]:
    from orchestrate.tracking.redact import redact_text
    from orchestrate.tracking.stores import unreachable

    problem = unreachable(uri, timeout_s)  # None, or a sentence that names the URI and the cause
    if problem is None:
        return True, f"tracking {redact_text(uri)} ({source}) answers"
    return False, (f"tracking ({source}): {problem} -> start the server (orchestrate server), or point "
                   "--tracking-uri / tracking.uri at one that answers")


# Joins the cluster the way a run does (orchestrate.cluster.ray_cluster.init), in a child process: a Ray
# that half-answers can block ray.init for minutes, and a child can be given up on.
RAY_PROBE = """
import json, sys
from orchestrate.cluster import ray_cluster
ray_cluster.init(sys.argv[1], sys.argv[2])
import ray
nodes = [n for n in ray.nodes() if n["Alive"]]
resources = ray.cluster_resources()
print(json.dumps({"nodes": len(nodes), "CPU": resources.get("CPU", 0), "GPU": resources.get("GPU", 0)}))
"""


def check_ray(address: str | None, key: str, timeout_s: float) -> tuple[bool, str]:
    if not address:
        from orchestrate.cluster import warm as warm_stack

        warm = warm_stack.found()
        if warm is not None:
            return True, f"ray: no cluster address; runs join the warm head at {warm.ray_address} (orchestrate up)"
        return True, "ray: no cluster address; runs start a local Ray"
    from orchestrate.cluster import ray_cluster

    fix = f"-> start the cluster (ray start --head --node-ip-address=...), or correct or unset {key}"
    try:  # nothing listening: known within seconds, without Ray's own retries
        ray_cluster.check_listening(address, key, timeout_s=min(timeout_s, 5))
    except ray_cluster.RayUnavailable as e:
        return False, f"ray {address}: {str(e).split('; allowed')[0]} {fix}"
    try:
        done = subprocess.run([sys.executable, "-c", RAY_PROBE, address, key], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"ray {address} ({key}): no answer from Ray within {timeout_s:g} s {fix}"
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return False, f"ray {address} ({key}): {lines[-1] if lines else f'exit code {done.returncode}'} {fix}"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return True, f"ray {address} ({key}): {found['nodes']} node(s), {found['CPU']:g} CPUs, {found['GPU']:g} GPUs"


# ---- smoke runs --------------------------------------------------------------------------------

def needs_extensions(cfg) -> bool:
    """Whether the backend runs ORTModule (itself, or as the runner's `backend.engine`), or may
    (backend=auto probes it where ORT is installed)."""
    return extras.ORT.present() and not {"ortmodule", "auto"}.isdisjoint({cfg.backend.get("name"),
                                                                          cfg.backend.get("engine")})


def smoke(name: str, overrides: list[str], scratch: Path, extensions_ok: bool) -> tuple[bool, str]:
    """A few steps of `name` through orchestrate.app.train, tracked in a SQLite store in `scratch`;
    its output goes to `scratch/smoke-NAME.log`. The process is left as it was (app.train keeps its
    settings; the working folder is put back)."""
    from orchestrate import app
    from orchestrate.config import load_config

    what = f"smoke run backend={name}"
    log = scratch / f"smoke-{name}.log"
    store = f"sqlite:///{scratch / 'mlflow.db'}"
    began = time.perf_counter()
    try:
        cfg = load_config([*overrides, f"backend={name}", *SMOKE, f"tracking.uri={store}",
                               "tracking.experiment=doctor"])
        if needs_extensions(cfg) and not extensions_ok:
            # app.train would build them (minutes): the extensions' line above says how.
            return False, f"{what}: not run: ORTModule's C++ extensions are not built (see above)"
        # In the scratch folder: MLflow puts a SQLite store's artifacts in ./mlruns. Checked as the
        # command line checks a run (app.check), which then trains the job it checked.
        with output_to(log), contextlib.chdir(scratch):
            result = app.train(cfg, scratch / name, app.check(cfg))
    except BaseException as e:  # a smoke run's failure is this check's result, whatever it is
        if isinstance(e, KeyboardInterrupt):
            raise
        return False, f"{what}: {first_line(e, typed=True)} (full output: {log})"
    m = result.metrics
    return True, (f"{what}: {cfg.trainer.max_steps} steps, train loss {m['train_loss']:.4f}, "
                  f"{m.get('wall_time_s', 0):.1f} s training, {time.perf_counter() - began:.1f} s in all")


def backends_here(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The backends (conf/backend names) this environment trains with, and why each other one
    does not (its `unavailable` line: the extra that would bring it). A runner whose default
    engine is missing trains here with another: it is here, and its smoke run names one."""
    from orchestrate import schema
    from orchestrate.backends.base import backend_config
    from orchestrate.config import group_options

    here, missing = [], {}
    for name in group_options("backend"):
        why = schema.build(backend_config(name), "backend").unavailable()
        if why and why.startswith("backend.engine="):  # the runner: here, with the engines it names
            here.append(name)
            missing[name] = why
        elif why:
            missing[name] = why
        else:
            here.append(name)
    return here, missing


# ---- the command -------------------------------------------------------------------------------

def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="orchestrate doctor", usage="%(prog)s [options] [OVERRIDE ...]",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="OVERRIDE: Hydra overrides of the config that is checked and smoke-run, "
                                            "e.g. tracking=server trainer.device=cuda")
    parser.add_argument("--tracking-uri", help="the MLflow store to check (default: the config's tracking.uri)")
    parser.add_argument("--ray-address", help="the Ray cluster to check (default: RAY_ADDRESS; none: a local Ray)")
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke runs (seconds instead of minutes)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the tracking server and the Ray cluster (default 10; Ray gets 3x)")
    args, rest = parser.parse_known_args(argv)
    unknown = [word for word in rest if word.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, rest  # the rest: Hydra overrides of the config checked and the smoke runs' configs


# Where ORT training stands upstream, said once beside the ORT checks (docs/configuration.md, "Backend notes").
UPSTREAM = ("ORT training is frozen upstream: onnxruntime-training 1.19.2 (2024-09) is its last release (the CPU "
            "build for Python 3.11 and 3.12, the GPU build for 3.11); ORTModule is deprecated there "
            "(microsoft/onnxruntime #24905), the on-device training API and onnxblock remain; backend=compile "
            "(torch.compile) is PyTorch's own alternative, measured beside them")


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    from orchestrate.boundary import CHECK, TOOL, Where, boundary
    from orchestrate.config import load_config

    with boundary(Where(CHECK, overrides=overrides)):  # a wrong override: the run's own words
        cfg = load_config(overrides)
    with boundary(Where(TOOL)):
        return diagnose(args, overrides, cfg)


def diagnose(args: argparse.Namespace, overrides: list[str], cfg) -> int:
    """Every check, one line each, then the count: 0 when all passed, 1 otherwise."""
    report = Report()
    scratch = Path(tempfile.mkdtemp(prefix="orchestrate-doctor-"))
    keep_scratch = False
    try:
        requires_python, requirements = tested_stack()
        report(*check_python(requires_python))
        for extra in extras.EXTRAS:  # each installed extra's pins in place of the base install's ranges
            if extra.present():  # (the `ort` extra's onnx: the release ORT 1.19 reads)
                pinned = tested_stack(extra.name)[1]
                requirements = [r for r in requirements if r.name not in {p.name for p in pinned}] + pinned
        ort = extras.ORT.present()
        for req in requirements:
            report(*check_requirement(req))
        extensions_ok = False
        if ort:
            report(*check_ort_build(scratch))
            print(f"note  {UPSTREAM}", flush=True)
            extensions_ok = report(*check_extensions(scratch))
        here, missing = backends_here(overrides)
        print(f"note  backends that train here: {', '.join(here)}", flush=True)
        for why in dict.fromkeys(missing.values()):
            print(f"note  not here: {why}", flush=True)
        uri, source = (args.tracking_uri, "--tracking-uri") if args.tracking_uri else (cfg.tracking.uri, "tracking.uri")
        report(*check_tracking(uri, source, args.timeout))
        address, key = ((args.ray_address, "--ray-address") if args.ray_address
                        else (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"))
        report(*check_ray(address, key, 3 * args.timeout))
        if args.no_smoke:
            print("(smoke runs skipped: --no-smoke)", flush=True)
        else:
            user = [o for o in overrides if o.lstrip("+~").split("=")[0] != "backend"]  # each backend in turn
            for name in here:
                engine = ["backend.engine=torch"] if name in missing else []  # its default engine is not here
                keep_scratch |= not report(*smoke(name, [*user, *engine], scratch, extensions_ok))
    finally:
        if not keep_scratch:  # a failed smoke run's output stays for the user to read
            shutil.rmtree(scratch, ignore_errors=True)
    total = report.passed + report.failed
    print(f"{total} checks: {report.passed} OK, {report.failed} FAIL" if report.failed else f"{total} checks: all OK",
          flush=True)
    return 1 if report.failed else 0
