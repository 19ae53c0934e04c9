"""torch.compile: the PyTorch loop with the model compiled by TorchInductor, what a PyTorch user
picks instead of an ORT path today.

    python -m orchestrate backend=compile
    python -m orchestrate backend=compile backend.mode=max-autotune

Like ORTModule, this backend *is* the PyTorch loop (`TorchBackend.fit`) with the model wrapped:
`torch.compile(model)` returns a module that shares the model's parameters, traces its forward on
the first call (TorchDynamo) and compiles the forward and, at the first backward, the backward
graph (TorchInductor: C++/OpenMP kernels on a CPU, Triton kernels on a GPU). Evaluation,
checkpoints and the ONNX export use the plain model, so they are the torch backend's, byte for byte.

Compiling is paid on the first step: `perf/compile_s` (logged once, at step 1) is that step's
time, and the meter already leaves the first display window out of the step-time figures, so the
samples/s a run reports are the compiled kernels' own. A run shorter than its compile pays back
never: `backend=auto` counts that (orchestrate/backends/auto.py).
"""

import os
import shutil
import time
from dataclasses import dataclass
from typing import Optional

import torch

from orchestrate.backends.torch import TorchBackend
from orchestrate.schema import ConfigError
from orchestrate.thirdparty import inductor_kernel_threads

# torch.compile's modes (torch/__init__.py, torch 2.6): "reduce-overhead" adds CUDA graphs,
# "max-autotune" benchmarks kernel choices at compile time (longer to compile).
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileBackend(TorchBackend):
    mode: str  # one of MODES
    dynamic: Optional[bool]  # torch.compile's: None lets it decide after a shape changes; False compiles per shape
    fullgraph: bool  # true: a graph break (code TorchDynamo cannot trace) is an error, not a fallback to eager
    # A two-layer MLP's forward and backward compiled again in a warm process, Inductor's FX graph
    # cache hit: 0.33-0.44 s on 2 busy cores (torch 2.6); the first compile in a process, 8-31 s.
    warmup_floor_s = 0.25

    def check(self, job) -> None:
        super().check(job)
        if self.mode not in MODES:
            raise ConfigError(f"backend.mode={self.mode!r}: allowed: {', '.join(MODES)}")
        if job.device.type == "cpu" and not shutil.which("g++") and not shutil.which(os.environ.get("CXX", "g++")):
            # Inductor writes C++ for a CPU and compiles it with the system's compiler, at the first step.
            raise ConfigError("backend=compile on a CPU needs a C++ compiler (g++), and none is on PATH: install one "
                              "(Debian/Ubuntu: apt-get install g++), or choose backend=torch")

    def fit(self, job) -> None:
        # Inductor's kernels run the budget's threads, whatever a cached kernel was compiled for.
        with inductor_kernel_threads(job.use_cores(self).threads):
            super().fit(job)

    def wrap(self, model: torch.nn.Module, job) -> torch.nn.Module:
        # TorchDynamo keeps what it compiled per code object, up to a limit of recompilations,
        # then runs that code eagerly: a sweep's trials and auto's probes in one process each
        # compile their own model, so each run starts with its caches empty.
        torch.compiler.reset()
        self._clock = None
        return torch.compile(model, mode=self.mode, dynamic=self.dynamic, fullgraph=self.fullgraph)

    def seed_step(self, step: int, job) -> None:
        # The run's first step in this process compiles: its time, from the call before it to the
        # call before the next step, is the compile time (and one step's compute).
        now = time.perf_counter()
        if self._clock is None:
            self._clock = step, now
        elif self._clock:
            first, began = self._clock
            job.meter.log({"perf/compile_s": now - began}, first)
            job.meter.final["compile_s"] = now - began
            self._clock = ()  # logged once
