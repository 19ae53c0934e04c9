"""What a run records about where it ran: the tags every run gets (code version, interpreter,
host and process, the versions of the stack) and the installed packages (an artifact)."""

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import orchestrate

VERSIONED = ["torch", "onnxruntime-training-cpu", "onnxruntime-training", "onnxruntime", "onnx", "mlflow", "ray",
             "hydra-core"]  # those installed: ORT's training build is an extra, the inference package another


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# Module state: the last listing and the folders it was read from, each with its modification time
# (installing or removing a package changes its folder's): a process that runs many trials (a
# reused Ray worker, the warm pool's forks) reads the metadata of the packages once, not per run.
_LISTED: tuple[tuple, str] | None = None


def installed_packages() -> str:
    """`name==version` of every installed distribution, as `pip freeze` lists them (read from the
    packages' metadata: a `pip freeze` subprocess cost 0.8 s of every run's start; the metadata,
    about 0.2 s, is read again only when a folder on the import path changed since)."""
    global _LISTED
    folders = tuple((p, _mtime_ns(p)) for p in sys.path)
    if _LISTED is None or _LISTED[0] != folders:
        found = {(d.metadata["Name"] or "").lower(): d.version for d in importlib.metadata.distributions()}
        _LISTED = folders, "".join(f"{name}=={version}\n" for name, version in sorted(found.items()) if name)
    return _LISTED[1]


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return None


def versions() -> dict[str, str]:
    found = {"orchestrate": orchestrate.__version__}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def run_tags(out_dir: Path) -> dict[str, str]:
    """The tags of a run started in this process, writing to `out_dir`. `host` and `pid` let
    `trainer.resume=auto` end a run whose process is gone (orchestrate.tracking.resume)."""
    return {"git_commit": git_commit(), "python": platform.python_version(), "host": platform.node(),
            "pid": str(os.getpid()), "out_dir": str(Path(out_dir).resolve()),
            **{f"version.{k}": v for k, v in versions().items()}}
