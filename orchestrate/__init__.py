"""orchestrate: declarative experiment orchestration for ONNX Runtime training (Hydra configs,
Ray scheduling, MLflow tracking). `python -m orchestrate --help`; the README has the rest."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("orchestrate")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
