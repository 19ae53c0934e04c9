"""The config as a run records it: MLflow params (`flatten`, secrets hidden) and the key that tells
whether two configs train the same thing (`config_key`, which `trainer.resume` matches runs by)."""

import hashlib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orchestrate.tracking.redact import redact

# Keys that may differ between a run and its continuation; every other key must be the same.
RESUME_FREE = ("trainer.resume", "trainer.progress")


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as `a.b.c -> value`, the form MLflow params take, secrets hidden
    (orchestrate.tracking.redact)."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = str(node)[:6000]

    walk(redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)), "")
    return out


def training_keys(params: dict[str, str]) -> dict[str, str]:
    """The params that decide the training: tracking settings, the machine's CPU budget
    (`cpu.*`, orchestrate.cpu) and RESUME_FREE left out."""
    return {k: v for k, v in params.items() if not k.startswith(("tracking.", "cpu.")) and k not in RESUME_FREE}


def config_key(cfg: DictConfig) -> str:
    """A hash of the config that decides the training: a run is only continued by the same config."""
    return hashlib.sha1(repr(sorted(training_keys(flatten(cfg)).items())).encode()).hexdigest()[:16]
