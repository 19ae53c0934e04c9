"""ORTModule: the PyTorch model wrapped by ONNX Runtime, inside the unchanged PyTorch loop.

    python -m orchestrate backend=ortmodule

ORTModule exports the model to ONNX on its first forward, builds the gradient graph, and runs
forward and backward through ORT; the optimizer stays a torch optimizer (or ORT's FusedAdam on
CUDA). So this backend *is* the PyTorch loop (`TorchBackend.fit`) with two hooks changed: how the
model is wrapped and which optimizer steps it.
"""

import importlib.util
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from dataclasses import dataclass

import torch

from orchestrate import ort
from orchestrate.backends.torch import TorchBackend
from orchestrate.schema import ConfigError


LOG_LEVELS = ("VERBOSE", "INFO", "WARNING", "ERROR", "FATAL")


def extensions_built() -> bool:
    """The check ORTModule makes when it is imported, made without importing it (importing
    `onnxruntime` alone already imports ORTModule, which then decides the extensions are missing)."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("onnxruntime is not installed: pip install onnxruntime-training-cpu==1.19.2")
    folder = Path(spec.submodule_search_locations[0]) / "training" / "ortmodule" / "torch_cpp_extensions"
    return any(folder.glob("*.so")) or any(folder.glob("*.dll")) or any(folder.glob("*.dylib"))


def ensure_extensions() -> None:
    """ORTModule refuses to start without its C++ extensions, which are compiled against the
    installed torch. Build them once, the first time they are needed (about 2 minutes on 2 cores)."""
    if extensions_built():
        return
    print("ORTModule's C++ extensions are not built yet: building them once now with "
          "`python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install` (about 2 minutes on 2 cores)...",
          file=sys.stderr, flush=True)
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "onnxruntime.training.ortmodule.torch_cpp_extensions.install"],
                          capture_output=True, text=True)
    if done.returncode != 0 or not extensions_built():
        raise RuntimeError(
            "building ORTModule's C++ extensions failed. They need a C++ compiler (gcc, g++), ninja and "
            "the Python headers: on Debian/Ubuntu `apt-get install build-essential python3.11-dev` and "
            "`pip install ninja`, then run `python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install`."
            f"\nLast lines of the build:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    print(f"ORTModule's C++ extensions built in {time.perf_counter() - began:.0f} s.", file=sys.stderr, flush=True)
    if "onnxruntime.training.ortmodule" in sys.modules:
        # ORTModule decides at import time whether the extensions exist.
        raise RuntimeError("ORTModule was imported before its extensions were built: run the command again.")


@dataclass
class ORTModuleBackend(TorchBackend):
    # ORT's own default sizes the session's thread pool to the physical cores and spins, which made
    # ORTModule 3x slower than eager on a 2-core machine; conf/backend/ortmodule.yaml sets one thread.
    allow_spinning: bool
    log_level: str  # ORTModule's DebugOptions log level: one of LOG_LEVELS
    save_onnx: bool  # save the exported, pre-grad and execution graphs into the run's folder
    options: dict[str, str]  # ORTMODULE_* environment options, for example ORTMODULE_MEMORY_OPT_LEVEL: 1
    fp16_optimizer: bool  # wrap the optimizer with ORT's FP16_Optimizer (CUDA only)
    mapped_dimensions: dict[str, int]  # symbolic dimension -> size, for ORT's sessions

    def check(self, job) -> None:
        super().check(job)
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"backend.log_level={self.log_level!r}: allowed: {', '.join(LOG_LEVELS)}")
        bad = [k for k in self.options if not k.startswith("ORTMODULE_")]
        if bad:
            raise ConfigError(f"backend.options.{bad[0]}: only ORTMODULE_* options are read by ORTModule")
        if self.fp16_optimizer and not torch.cuda.is_available():
            raise ConfigError("backend.fp16_optimizer=true (FP16_Optimizer) needs CUDA, and this machine has none; "
                              "allowed here: backend.fp16_optimizer=false")

    def wrap(self, model: torch.nn.Module, job) -> torch.nn.Module:
        # ORTModule reads its ORTMODULE_* options from the environment when it is constructed (the
        # environment is restored when the run ends: orchestrate.process).
        os.environ.update({k: str(v) for k, v in self.options.items()})
        ensure_extensions()
        from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule

        debug = DebugOptions(log_level=getattr(LogLevel, self.log_level), save_onnx=self.save_onnx,
                             onnx_prefix="ortmodule", save_path=str(job.out_dir / "ortmodule_graphs"))
        if self.save_onnx:
            (job.out_dir / "ortmodule_graphs").mkdir(parents=True, exist_ok=True)
        wrapped = ORTModule(model, debug)
        self._set_threads(wrapped)
        return wrapped

    def _set_threads(self, wrapped) -> None:
        """ORTModule has no public option for its session's threads: extend the session options
        that each of its graph managers (training and inference) builds."""
        factory = wrapped._torch_module._execution_manager
        for manager in (factory._training_manager, factory._inference_manager):
            original = manager._get_session_config

            def with_threads(self_, original=original):
                options, providers, provider_options = original()
                ort.configure(options, self.intra_op_threads, self.allow_spinning, self.mapped_dimensions)
                return options, providers, provider_options

            manager._get_session_config = types.MethodType(with_threads, manager)

    def make_optimizer(self, model: torch.nn.Module, job) -> torch.optim.Optimizer:
        optimizer = job.make_optimizer(model.parameters())
        if self.fp16_optimizer:
            from onnxruntime.training.optim.fp16_optimizer import FP16_Optimizer

            optimizer = FP16_Optimizer(optimizer)
        return optimizer
