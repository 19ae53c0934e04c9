"""Joining Ray, for sweeps and for the runner: a new local instance bound to 127.0.0.1 by default,
or a running cluster.

Two Ray behaviours shape this (Ray 2.60, measured here):
- with no address, `ray.init()` joins whatever `ray start` last left in /tmp/ray/ray_current_cluster,
  even a cluster that has since gone (it then retries for minutes): no address means "local" here;
- a local Ray swaps 127.0.0.1 for the machine's network address (even when told
  `_node_ip_address="127.0.0.1"`) unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set before `import ray`;
  with it every port Ray opens is bound to 127.0.0.1.
`ray job submit` runs the command with RAY_ADDRESS set: that cluster is joined.
"""

import os

from orchestrate.schema import ConfigError

LOOPBACK = ("127.0.0.1", "localhost")


def init(address: str | None, key: str, **local_options) -> bool:
    """Start or join Ray unless this process already has (then return False); `key` names the
    config key that gave `address` (for the error when it cannot be reached). `local_options`
    (num_cpus, ...) apply to a new local instance only."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None or address.split("://")[-1].split(":")[0] in LOOPBACK:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    options = dict(include_dashboard=False, configure_logging=False, log_to_driver=True)
    try:
        if address is None:
            ray.init(address="local", **options, **local_options)
        else:
            ray.init(address=address, **options)
    except ConnectionError as e:
        raise ConfigError(f"{key}={address}: {str(e).splitlines()[0]}; allowed: null (a new local Ray), "
                          "auto, or the address of a running cluster") from None
    return True
