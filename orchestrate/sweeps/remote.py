"""Where a sweep's trials run, and how they reach what the sweep serves them.

On one machine (a local Ray, the basic launcher) the sweep's MLflow server listens on 127.0.0.1
and its Optuna study is a SQLite file beside the store. When orchestrate's Ray launcher joins a
cluster at another address, the trials run on hosts that share neither this machine's disk nor
its 127.0.0.1: the sweep's server then listens on this machine's address toward the cluster's
head (`server_host`), which every host of the cluster reaches (it reaches the head); a SQLite
study is served to the trials by Optuna's gRPC storage proxy on the same address
(orchestrate.sweeps._optuna); and a store the trials could not write is refused before anything
starts (`check_reporting`). Neither server asks for credentials: they listen on the cluster's
network only, as Ray itself does.

The runner's rank 0 on another host reports back another way (orchestrate.backends.runner.relay:
a Ray actor on the driver's node), for reasons both ways state in docs/cluster.md ("How results
get back to the driver"): a sweep's trials may run without Ray (Slurm jobs) and each is a run of
its own, where the runner always has Ray's connection and one run the driver owns.
"""

import os
import socket

from omegaconf import DictConfig, OmegaConf

from orchestrate.cluster.ray_cluster import host_of, on_loopback
from orchestrate.schema import ConfigError


def _ray_address(config: DictConfig) -> tuple[str, str] | None:
    """(the address orchestrate's Ray launcher joins, the setting that gives it), or None."""
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    if not launcher.endswith("OrchestrateRayLauncher"):
        return None
    address = OmegaConf.select(config, "hydra.launcher.address", default=None)
    if address:
        return str(address), "hydra.launcher.address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return None


def cluster_head(config: DictConfig) -> tuple[str, str] | None:
    """(the host of the Ray cluster's head the trials run on, the setting that names it, as
    `key=value`) when it is not this machine's loopback; None for a local Ray or another launcher."""
    found = _ray_address(config)
    if found is None or found[0] in ("local", "auto") or on_loopback(found[0]):
        return None
    return host_of(found[0]), f"{found[1]}={found[0]}"


def elsewhere(config: DictConfig) -> str | None:
    """Why the trials may run on other machines (so this machine's disk and 127.0.0.1 are out of
    their reach), or None."""
    from orchestrate.sweeps.slurm import is_slurm

    if is_slurm(config):
        return "hydra/launcher=submitit_slurm runs the trials on the cluster's nodes"
    head = cluster_head(config)
    if head is not None:
        return f"{head[1]} runs the trials on the Ray cluster's hosts"
    return None


def address_toward(host: str) -> str:
    """This machine's address on the route to `host`: the one a host of that network reaches it by."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: picks the route and the source address, sends nothing
        return s.getsockname()[0]


def server_host(config: DictConfig) -> str:
    """Where the sweep's own servers listen: 127.0.0.1, or this machine's address toward the Ray
    cluster's head when the trials run on its hosts."""
    head = cluster_head(config)
    if head is None:
        return "127.0.0.1"
    try:
        return address_toward(head[0])
    except OSError as e:
        raise ConfigError(f"{head[1]}: no route from this machine to the Ray head ({e.strerror}); "
                          "the trials' hosts could not reach the sweep's MLflow server here") from None


def check_reporting(config: DictConfig) -> None:
    """Refuse, before anything starts, a Ray sweep on other hosts whose trials could not report
    back: a tracking store or a study on this machine's disk or loopback."""
    head = cluster_head(config)
    if head is None:
        return
    server_host(config)  # a head this machine has no route to: refused here, not once the sweep started
    where = f"{head[1]} runs the trials on the Ray cluster's hosts, which share neither this machine's disk nor its 127.0.0.1"
    tracking = OmegaConf.select(config, "hydra.callbacks.sweep_tracking")
    if tracking is not None:
        from orchestrate.tracking.stores import absolute_uri

        uri = absolute_uri(str(tracking.tracking_uri))
        if uri.startswith("sqlite:") and not tracking.get("tracking_server", True):
            raise ConfigError(f"hydra.callbacks.sweep_tracking.tracking_server=false: {where}, and the trials would "
                              f"write {uri} on their own disks; leave it true (the sweep serves the store to the "
                              "hosts), or set tracking.uri=http://HOST:PORT (an MLflow server every host reaches)")
        if "://" not in uri or uri.startswith("file:"):
            raise ConfigError(f"tracking.uri={tracking.tracking_uri}: {where}, and the trials would write this folder "
                              "on their own disks; set tracking.uri=sqlite:///mlflow.db (the sweep serves it to the "
                              "hosts) or http://HOST:PORT (an MLflow server every host reaches)")
        if uri.startswith("sqlite:"):
            _check_served_artifacts(uri, str(tracking.experiment), where)
        elif on_loopback(uri):
            raise ConfigError(f"tracking.uri={tracking.tracking_uri}: {where}; set tracking.uri to an address every "
                              "host reaches, or sqlite:///mlflow.db (the sweep serves it to the hosts)")
    storage = str(OmegaConf.select(config, "hydra.sweeper.storage", default=None) or "")
    if storage and not storage.startswith("sqlite") and on_loopback(storage):
        raise ConfigError(f"hydra.sweeper.storage=...@{host_of(storage)}: {where}; set it to a database "
                          "every host reaches, or leave it null (the sweep serves its study to the hosts)")


def _check_served_artifacts(sqlite_uri: str, experiment: str, where: str) -> None:
    """An experiment made before, by a run on this machine, keeps its artifacts in a folder here
    (./mlruns), where the trials on other hosts cannot write; one the sweep's server makes keeps
    them behind the server (mlflow-artifacts:/)."""
    from pathlib import Path

    if not Path(sqlite_uri.removeprefix("sqlite:///")).is_file():
        return
    from mlflow.tracking import MlflowClient

    from orchestrate.tracking.stores import artifacts_on_this_disk

    found = MlflowClient(tracking_uri=sqlite_uri).get_experiment_by_name(experiment)
    if found is not None and artifacts_on_this_disk(found.artifact_location):
        raise ConfigError(f"tracking.experiment={experiment}: its artifacts are kept in {found.artifact_location}, a "
                          f"folder of this machine, and {where}; name a new experiment (tracking.experiment=NAME), "
                          "whose artifacts the sweep's server then takes from every host")
