"""orchestrate: declarative experiment orchestration for ONNX Runtime training (Hydra configs,
Ray scheduling, MLflow tracking). `python -m orchestrate --help`; the README has the rest."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("orchestrate")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

# MLflow's usage telemetry is off unless the environment says otherwise (before MLflow is imported:
# it starts its telemetry thread on import). Without a network that thread gives up and deletes an
# environment variable it set (_MLFLOW_TELEMETRY_SESSION_ID) while another thread may be reading
# the environment (requests looks for proxy settings on every call): a KeyError that failed one
# trial of 16 writing at once. Set MLFLOW_DISABLE_TELEMETRY=false to keep it on.
import os as _os

_os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
