"""ORTModule: the PyTorch model wrapped by ONNX Runtime, inside the unchanged PyTorch loop.

    python -m orchestrate backend=ortmodule

ORTModule exports the model to ONNX on its first forward, builds the gradient graph, and runs
forward and backward through ORT; the optimizer stays a torch optimizer (or ORT's FusedAdam on
CUDA). So this backend *is* the PyTorch loop (`TorchBackend.fit`) with two hooks changed: how the
model is wrapped and which optimizer steps it.
"""

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from orchestrate import errors, extras, ort, thirdparty
from orchestrate.backends.torch import TorchBackend, export_for_training
from orchestrate.job import model_key
from orchestrate.schema import ConfigError, shown
from orchestrate.thirdparty import ortmodule_session_options

# The environment options ORT 1.19.2 reads each time an ORTModule is built or exports its graph:
# _RuntimeOptions._override_from_env_vars in onnxruntime/training/ortmodule/options.py, plus
# ORTMODULE_FALLBACK_RETRY (_fallback.py) and ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT (the export).
# int: ORT parses the value with int(); a tuple: the names ORT looks up; str: any text (a path).
# Options ORT reads once, on import (ORTMODULE_USE_FLASH_ATTENTION, ...), are left out: a second
# run in the same process (a sweep's trial) would silently go without them.
ORTMODULE_OPTIONS = {
    "ORTMODULE_ONNX_OPSET_VERSION": int,
    "ORTMODULE_CONV_ALGO_SEARCH": ("HEURISTIC", "EXHAUSTIVE"),
    "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": int,
    "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": int,
    "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER": int,
    "ORTMODULE_MEMORY_OPT_LEVEL": int,
    "ORTMODULE_MEMORY_OPT_CONFIG": str,
    "ORTMODULE_PRINT_INPUT_DENSITY": int,
    "ORTMODULE_PRINT_MEMORY_STATS": int,
    "ORTMODULE_FALLBACK_POLICY": ("FALLBACK_DISABLE", "FALLBACK_FORCE_TORCH_FORWARD", "FALLBACK_FORCE_TORCH_BACKWARD",
                                  "FALLBACK_UNSUPPORTED_DEVICE", "FALLBACK_UNSUPPORTED_DATA",
                                  "FALLBACK_UNSUPPORTED_TORCH_MODEL", "FALLBACK_UNSUPPORTED_ONNX_MODEL",
                                  "FALLBACK_BAD_INITIALIZATION"),
    "ORTMODULE_SKIPCHECK_POLICY": ("SKIP_CHECK_DISABLED", "SKIP_CHECK_DEVICE", "SKIP_CHECK_BUILD_GRADIENT",
                                   "SKIP_CHECK_EXECUTION_AGENT"),  # several joined by |
    "ORTMODULE_USE_TRITON": int,
    "ORTMODULE_ENABLE_TUNING": int,
    "ORTMODULE_MAX_TUNING_DURATION_MS": int,
    "ORTMODULE_TUNING_RESULTS_PATH": str,
    "ORTMODULE_CACHE_DIR": str,
    "ORTMODULE_ENABLE_ZERO_STAGE3": int,
    "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": int,
    "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT": int,
    "ORTMODULE_FALLBACK_RETRY": str,  # on when "true", "1" or "yes"
    "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": int,
}
# Options ORT also reads that this backend sets from its own keys.
SET_FROM_KEYS = {"ORTMODULE_LOG_LEVEL": "backend.log_level", "ORTMODULE_SAVE_ONNX_PATH": "backend.save_onnx"}


def check_options(options: dict) -> None:
    """`backend.options`: names ORTModule reads, with values it can parse (a bad one fails only
    when ORTModule is built, inside the run)."""
    for name, value in options.items():
        key = f"backend.options.{name}"
        if name in SET_FROM_KEYS:
            raise ConfigError(f"{key}: set {SET_FROM_KEYS[name]} instead (this backend sets {name} from it)")
        if name not in ORTMODULE_OPTIONS:
            raise ConfigError(f"{key}: not an option ORTModule (onnxruntime-training 1.19.2) reads; allowed: "
                              f"{', '.join(ORTMODULE_OPTIONS)}")
        # The value becomes an environment variable: text, or a whole number written as text.
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigError(f"{key}={shown(value)}: allowed: a string (or a whole number), e.g. {name}: \"1\"")
        kind, text = ORTMODULE_OPTIONS[name], str(value)
        if kind is int and not text.strip().lstrip("+-").isdigit():
            raise ConfigError(f"{key}={text}: ORT reads it with int(); allowed: a whole number, e.g. \"1\"")
        if isinstance(kind, tuple):
            names = text.split("|") if name == "ORTMODULE_SKIPCHECK_POLICY" else [text]
            if not set(names) <= set(kind):
                raise ConfigError(f"{key}={text}: allowed: {', '.join(kind)}")


def extensions_folder() -> Path:
    """onnxruntime/training/ortmodule/torch_cpp_extensions, found without importing onnxruntime
    (importing it alone already imports ORTModule, which then decides the extensions are missing)."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("onnxruntime is not installed: pip install onnxruntime-training-cpu==1.19.2")
    return Path(spec.submodule_search_locations[0]) / "training" / "ortmodule" / "torch_cpp_extensions"


def extensions_built(folder: Path | None = None) -> bool:
    """The check ORTModule makes when it is imported: a compiled extension in its folder."""
    folder = folder or extensions_folder()
    return any(folder.glob("*.so")) or any(folder.glob("*.dll")) or any(folder.glob("*.dylib"))


def build_cpu_extensions(folder: Path) -> tuple[bool, str]:
    """What `python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install` does for a
    CPU build, with the extensions compiled side by side instead of one after the other (each in
    a build folder of its own): `setup.py build` of each cpu/*/setup.py in `folder`, then the
    libraries copied next to them. (whether every build succeeded, what the builds printed); the
    first that fails stops the others."""
    env = {**os.environ, "ONNXRUNTIME_CUDA_VERSION": "", "ONNXRUNTIME_ROCM_VERSION": ""}  # as the installer sets them
    builds = []
    for setup in sorted((folder / "cpu").glob("*/setup.py")):
        log = tempfile.TemporaryFile("w+")  # a pipe left unread would stall the build that fills it
        # A process group of its own: stopping the build stops the compilers it started too.
        builds.append((subprocess.Popen([sys.executable, str(setup), "build", f"--build-temp=build/temp-{setup.parent.name}"],
                                        cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True), log))
    try:
        # Whichever build ends first is seen first: one that fails stops those still compiling.
        while (codes := [proc.poll() for proc, _ in builds]) and None in codes and not any(codes):
            time.sleep(0.2)
        built = not any(codes)
    finally:  # a failed build, or an interrupted wait: no compiler is left running
        for proc, _ in builds:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    printed = ""
    for _, log in builds:
        with log:
            log.seek(0)
            printed += log.read()
    if built:
        for library in folder.glob("build/lib.*/*.so"):
            shutil.copyfile(library, folder / library.name)
    return built, printed


def installed_build_has_cuda() -> bool:
    """The installer's own test for the CUDA extensions: a torch and an onnxruntime built for a GPU."""
    info = (extensions_folder().parents[2] / "capi" / "build_and_package_info.py").read_text()
    gpu_ort = "cuda_version" in info or "rocm_version" in info
    return bool(os.environ.get("ONNXRUNTIME_FORCE_CUDA")) or (
        gpu_ort and (torch.version.cuda is not None or torch.version.hip is not None))


def ensure_extensions() -> None:
    """ORTModule refuses to start without its C++ extensions, which are compiled against the
    installed torch. Build them once, the first time they are needed (a few minutes on 2 cores;
    a CPU build's two side by side)."""
    if extensions_built():
        return
    print("ORTModule's C++ extensions are not built yet: building them once now, as "
          "`python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install` does (a few minutes on 2 cores)...",
          file=sys.stderr, flush=True)
    began = time.perf_counter()
    if installed_build_has_cuda():  # the installer's own way: the CUDA extensions too, one after another
        done = subprocess.run([sys.executable, "-m", "onnxruntime.training.ortmodule.torch_cpp_extensions.install"],
                              capture_output=True, text=True)
        built, printed = done.returncode == 0, done.stdout + done.stderr
    else:
        built, printed = build_cpu_extensions(extensions_folder())
    if not built or not extensions_built():
        raise RuntimeError(
            "building ORTModule's C++ extensions failed. They need a C++ compiler (gcc, g++), ninja and "
            "the Python headers: on Debian/Ubuntu `apt-get install build-essential python3.11-dev` and "
            "`pip install ninja`, then run `python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install`."
            f"\nLast lines of the build:\n{printed[-3000:]}")
    print(f"ORTModule's C++ extensions built in {time.perf_counter() - began:.0f} s.", file=sys.stderr, flush=True)
    if "onnxruntime.training.ortmodule" in sys.modules:
        # ORTModule decides at import time whether the extensions exist.
        raise RuntimeError("ORTModule was imported before its extensions were built: run the command again.")


# ORTModule's C++ extensions (onnxruntime-training 1.19.2, its last release) build against torch
# 2.6 at most; with a newer torch they fail to compile on the first step. The on-device API has no
# extension: it trains with the newest torch (docs/compatibility.md).
TORCH_CEILING = (2, 6)
CEILING = ".".join(map(str, TORCH_CEILING))


def torch_too_new(version: str, key: str = "backend") -> str | None:
    """Why ORTModule cannot run beside torch `version` (newer than its ceiling), or None."""
    from packaging.version import Version

    if Version(version).release[:2] <= TORCH_CEILING:
        return None
    return (f"{key}=ortmodule needs torch {CEILING} at most (ORT 1.19.2's ORTModule builds its C++ extensions "
            f"against it), and this environment has torch {version}: pip install 'orchestrate[ort]' torch=={CEILING}.0 "
            "(the ORT stack: constraints.txt, Python 3.11), or train with backend=ondevice (ORT's on-device API, which "
            "runs with this torch), backend=torch or backend=compile")


ORTMODULE_OPSET = 17  # onnxruntime-training 1.19.2's ORTModule exports at this opset (ORTMODULE_ONNX_OPSET_VERSION)
# Module state: (model config, opset) -> why it does not export, or None. Asked once per process
# (an export takes seconds, and a sweep checks every trial's config); answers that change no run.
_EXPORTS: dict[tuple[str, int], str | None] = {}


def export_refused(model: torch.nn.Module, sample: torch.Tensor, opset: int, log_level: str) -> str | None:
    """Why ORTModule's first step would fail on `model` (its export at `opset`, or ORT's shape
    inference on that export), in words for the check's line; None if both pass."""
    try:
        exported, _ = export_for_training(model, sample, opset, log_level)
    except Exception as e:  # noqa: BLE001 - whatever the exporter says is the reason
        return f"cannot be exported by ORTModule at opset {opset}: {errors.first_line(e, typed=True)}"
    try:
        thirdparty.ortmodule_shape_inference(exported)
    except Exception as e:  # noqa: BLE001 - whatever ORT's inference says is the reason
        # ORT's inference fails with bare assertions: the node type it was at is its function's name (_infer_Reshape).
        at = traceback.extract_tb(e.__traceback__)[-1].name
        node = f" at a {at.removeprefix('_infer_')} node" if at.startswith("_infer_") else ""
        return (f"cannot be trained by ORTModule: ORT's symbolic shape inference, which ORTModule runs on its export, "
                f"fails{node} ({errors.first_line(e, typed=True)})")
    return None


def ort_stage(error: BaseException) -> str | None:
    """Which of ORTModule's steps `error` came out of, by the files its traceback passes through
    (ORT's shape inference, the export ORTModule runs), or None when not out of ORTModule."""
    files = [frame.filename.replace(os.sep, "/") for frame in traceback.extract_tb(error.__traceback__)]
    if not any("/onnxruntime/training/ortmodule/" in f for f in files):
        return None
    if any(f.endswith("/onnxruntime/tools/symbolic_shape_infer.py") for f in files):
        return "ORT's symbolic shape inference of ORTModule's export"
    if any("/torch/onnx/" in f for f in files):
        return "ORTModule's export of the model"
    return None


@dataclass
class ORTModuleBackend(TorchBackend):
    # ORT's own default sizes the session's thread pool to the physical cores and spins, which made
    # ORTModule 3x slower than eager on a 2-core machine; conf/backend/ortmodule.yaml sets one thread.
    allow_spinning: bool
    log_level: str  # ORTModule's DebugOptions log level: one of ort.LEVELS
    save_onnx: bool  # save the exported, pre-grad and execution graphs into the run's folder
    options: dict[str, str]  # ORTMODULE_* environment options, for example ORTMODULE_MEMORY_OPT_LEVEL: 1
    fp16_optimizer: bool  # wrap the optimizer with ORT's FP16_Optimizer (CUDA only)
    mapped_dimensions: dict[str, int]  # symbolic dimension -> size, for ORT's sessions
    precisions = ("fp32", "fp16")  # ORT's graph is exported in fp32; bf16 autocast is PyTorch's alone
    extra = extras.ORT

    def unavailable(self, key: str = "backend") -> str | None:
        return self.extra.missing(f"{key}={self.name}", also=f"torch {CEILING}") or torch_too_new(torch.__version__, key)

    def check(self, job) -> None:
        super().check(job)
        if self.log_level not in ort.LEVELS:
            raise ConfigError(f"backend.log_level={self.log_level!r}: allowed: {', '.join(ort.LEVELS)}")
        check_options(self.options)
        if self.fp16_optimizer and not torch.cuda.is_available():
            raise ConfigError("backend.fp16_optimizer=true (FP16_Optimizer) needs CUDA, and this machine has none; "
                              "allowed here: backend.fp16_optimizer=false")
        self.check_export(job)

    def check_export(self, job) -> None:
        """ORTModule exports the model on its first step, at its opset, and runs ORT's symbolic
        shape inference on the export, inside the run: a model it cannot export (an operator ONNX
        lacks) or whose shapes ORT cannot infer (a mask sliced to the sequence length) is refused
        here instead, before the run opens (the export: about a second; the inference: tens of
        milliseconds). The answer is kept per model config and opset: a sweep's trials share their model."""
        opset = int(self.options.get("ORTMODULE_ONNX_OPSET_VERSION", ORTMODULE_OPSET))
        key = (model_key(job.cfg), opset)
        if key not in _EXPORTS:
            _EXPORTS[key] = export_refused(job.model, job.data.sample_input(), opset, self.log_level)
        if _EXPORTS[key]:
            raise ConfigError(f"model ({job.cfg.model._target_}) {_EXPORTS[key]}; backend=ondevice (ORT's on-device "
                              "API), backend=torch or backend=compile train it instead")

    def fit(self, job) -> None:
        """The PyTorch loop (TorchBackend.fit) on the wrapped model; a failure inside ORTModule's
        export or ORT's shape inference that the check did not foresee says so in the run's
        error line (`ort_stage`), with what trains the model instead."""
        try:
            super().fit(job)
        except Exception as e:
            stage = ort_stage(e)
            if stage:
                errors.mark(e, what=f"backend=ortmodule: {stage} failed on this model (backend=ondevice, backend=torch "
                                    "or backend=compile train it instead); ORT said")
            raise

    def wrap(self, model: torch.nn.Module, job) -> torch.nn.Module:
        # ORTModule reads its ORTMODULE_* options from the environment when it is constructed (the
        # environment is restored when the run ends: orchestrate.process).
        os.environ.update({k: str(v) for k, v in self.options.items()})
        ensure_extensions()
        ort.quiet(self.log_level)  # ORT's output below backend.log_level: the run's log file only
        from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule

        debug = DebugOptions(log_level=getattr(LogLevel, self.log_level), save_onnx=self.save_onnx,
                             onnx_prefix="ortmodule", save_path=str(job.out_dir / "ortmodule_graphs"))
        if self.save_onnx:
            (job.out_dir / "ortmodule_graphs").mkdir(parents=True, exist_ok=True)
        wrapped = ORTModule(model, debug)
        # Its logger at WARNING at most: the banner and the exporter's warnings (which ORTModule
        # collects from the export and logs at WARNING) reach the log file whatever backend.log_level.
        logger = thirdparty.ortmodule_logger(wrapped)
        logger.setLevel(min(logger.level, logging.WARNING))
        self._set_threads(wrapped, job.cpu.threads)
        return wrapped

    def _set_threads(self, wrapped, threads: int) -> None:
        """The thread pool (the run's CPU budget's `threads`), spinning and mapped dimensions on
        each session ORTModule builds (it has no public option for them: orchestrate.thirdparty)."""
        ortmodule_session_options(wrapped, lambda options: ort.configure(
            options, threads, self.allow_spinning, self.mapped_dimensions))

    def seed_step(self, step: int, job) -> None:
        # ORTModule's Dropout runs inside ORT and draws from ORT's one process-wide generator,
        # whose position no checkpoint holds: a resumed run drew other masks. Seeded from (seed,
        # step) before every step, as the on-device loop does, a step draws the same masks in a
        # resumed run as in one that never stopped.
        from onnxruntime import set_seed

        set_seed((job.trainer.seed * 2**32 + step) % 2**63)

    def make_optimizer(self, model: torch.nn.Module, job) -> torch.optim.Optimizer:
        optimizer = job.make_optimizer(model.parameters(), fused=self.fused_optimizer)
        if self.fp16_optimizer:
            from onnxruntime.training.optim.fp16_optimizer import FP16_Optimizer

            optimizer = FP16_Optimizer(optimizer)
        return optimizer
