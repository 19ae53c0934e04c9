"""Where a sweep's trials run and what they can reach (orchestrate.sweeps.remote): the settings
read, the address the sweep's servers listen on, and the refusals of what trials on other hosts
could not report to. The sweep on hosts that share nothing: tests/sweeps/test_sweeps_hosts.py."""

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from orchestrate.schema import ConfigError
from orchestrate.sweeps import remote

RAY = "hydra_plugins.orchestrate_ray_launcher.ray_launcher.OrchestrateRayLauncher"


def config(address=None, uri="sqlite:///mlflow.db", server=True, storage=None, experiment="exp"):
    return OmegaConf.create({"hydra": {
        "launcher": {"_target_": RAY, "address": address},
        "sweeper": {"storage": storage},
        "callbacks": {"sweep_tracking": {"tracking_uri": uri, "tracking_server": server, "experiment": experiment}}}})


def test_trials_are_elsewhere_only_on_a_cluster_at_another_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    slurm = OmegaConf.create({"hydra": {"launcher": {"_target_": "x.SlurmLauncher"}}})
    assert "cluster's nodes" in remote.elsewhere(slurm)
    assert "hydra.launcher.address=10.0.0.5:6379 runs" in remote.elsewhere(config("10.0.0.5:6379"))
    assert remote.cluster_head(config("ray://head.example:10001")) == ("head.example",
                                                                       "hydra.launcher.address=ray://head.example:10001")
    for local in (None, "local", "auto", "127.0.0.1:6379", "localhost:6379"):
        assert remote.elsewhere(config(local)) is None, local
        assert remote.server_host(config(local)) == "127.0.0.1"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    assert remote.cluster_head(config()) == ("10.0.0.7", "RAY_ADDRESS=10.0.0.7:6379")


def test_the_servers_listen_on_this_machines_address_toward_the_head(monkeypatch):
    # Toward this machine's own address the route is local, and the address is that one.
    assert remote.address_toward("127.0.0.1") == "127.0.0.1"

    def unreachable(host):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(remote, "address_toward", unreachable)
    with pytest.raises(ConfigError, match="hydra.launcher.address=192.0.2.1:6379: no route .* .Network is unreachable."):
        remote.server_host(config("192.0.2.1:6379"))


@pytest.mark.parametrize("settings, key", [
    ({"server": False}, "hydra.callbacks.sweep_tracking.tracking_server=false"),
    ({"uri": "./mlruns"}, "tracking.uri=./mlruns"),
    ({"uri": "http://127.0.0.1:5000"}, "tracking.uri=http://127.0.0.1:5000"),
    ({"storage": "postgresql://u:p@localhost:5432/optuna"}, "hydra.sweeper.storage=...@localhost"),
])
def test_what_trials_on_other_hosts_could_not_report_to_is_refused(settings, key):
    with pytest.raises(ConfigError) as e:
        remote.check_reporting(config("10.0.0.5:6379", **settings))
    assert str(e.value).startswith(key + ":") and "hydra.launcher.address=10.0.0.5:6379 runs" in str(e.value)
    remote.check_reporting(config(None, **settings))  # on one machine each of them works


def test_an_experiment_with_its_artifacts_in_a_folder_here_is_refused_and_a_new_one_is_not(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("earlier", artifact_location=str(tmp_path / "mlruns"))
    with pytest.raises(ConfigError, match="tracking.experiment=earlier: its artifacts are kept in .*name a new"):
        remote.check_reporting(config("10.0.0.5:6379", uri=uri, experiment="earlier"))
    remote.check_reporting(config("10.0.0.5:6379", uri=uri, experiment="new"))
    remote.check_reporting(config("10.0.0.5:6379", uri="http://mlflow.example:5000"))
