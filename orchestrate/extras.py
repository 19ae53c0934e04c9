"""The optional parts of orchestrate: each is an extra of its package (pyproject.toml), what needs
it, and the one line that installs it. The base install trains with torch and torch.compile, sweeps,
tracks and schedules; a config that needs a part this environment lacks (ORT's backends, a Hugging
Face model, `orchestrate server`) is refused with that line before anything is built.

    pip install 'orchestrate[ort]'      # backend=ortmodule, backend=ondevice (Python 3.11 or 3.12)
    pip install 'orchestrate[hf]'       # model=hf_causal_lm, model=hf_classifier
    pip install 'orchestrate[server]'   # orchestrate server (MLflow on PostgreSQL)
    pip install 'orchestrate[lamb]'     # optimizer=lamb

Asked without importing anything: ORT's import alone takes seconds and prints.
"""

import importlib.util
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Extra:
    name: str  # pip install 'orchestrate[<name>]'
    what: str  # what it brings, in words
    module: str  # the module whose presence means it is installed (dotted: a subpackage)
    below_python: tuple[int, int] | None = None  # its wheels stop before this Python

    @property
    def install(self) -> str:
        return f"pip install 'orchestrate[{self.name}]'"

    def present(self) -> bool:
        """Whether this environment has it: the module's files are there (nothing is imported)."""
        top, *rest = self.module.split(".")
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return False
        if spec is None:
            return False
        folders = spec.submodule_search_locations or []
        return not rest or any(os.path.isdir(os.path.join(folder, *rest)) for folder in folders)

    def missing(self, who: str, also: str = "") -> str | None:
        """None when present; else the one line refusing `who` (`backend=ondevice`), naming the
        install, where it installs and `also` what else it needs (`torch 2.6`)."""
        if self.present():
            return None
        where = []
        if self.below_python:  # from orchestrate's oldest Python (3.11) up to the last it has wheels for
            versions = [f"3.{minor}" for minor in range(11, self.below_python[1])]
            where = ([f"Python {', '.join(versions[:-1])} or {versions[-1]}"] if len(versions) > 1 else
                     [f"Python {v}" for v in versions])
        line = f"{who} needs {self.what}: {self.install}"
        if where or also:
            line += f" ({', '.join([*where, *([also] if also else [])])})"
        if self.below_python and sys.version_info[:2] >= self.below_python:
            line += f"; this is Python {sys.version_info[0]}.{sys.version_info[1]}, which it has no wheel for"
        elif self.name == "ort" and _inference_only():
            line += " (pip uninstall -y onnxruntime first: the inference package here shares its module)"
        return line


def _inference_only() -> bool:
    """An `onnxruntime` module without its training part (the maintained inference package)."""
    return Extra("", "", "onnxruntime").present()


ORT = Extra("ort", "ORT's training build", "onnxruntime.training", below_python=(3, 13))
HF = Extra("hf", "Hugging Face transformers", "transformers")
SERVER = Extra("server", "PostgreSQL's driver for MLflow (psycopg2)", "psycopg2")
LAMB = Extra("lamb", "pytorch-optimizer (its Lamb)", "pytorch_optimizer")
EXTRAS = (ORT, HF, SERVER, LAMB)


def for_module(name: str) -> Extra | None:
    """The extra that brings the top-level module `name` (`transformers`), if one does."""
    return next((e for e in EXTRAS if e.module.split(".")[0] == name), None)
