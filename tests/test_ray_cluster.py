"""What Ray prints on the driver that says nothing to act on (orchestrate.ray_cluster): lines its
own processes relay that RAY_NOISE names are skipped by Ray's log deduplicator, through the
variable Ray reads when it is imported; the variable is put back afterwards."""

import json
import os
import subprocess
import sys

import pytest

# In a fresh process: import ray through ray_cluster, then hand a batch of relayed lines to the
# deduplicator that prints the workers' stderr on the driver; print what it would print, and
# the variable as the process has it afterwards.
RELAY = """
import json, os
from orchestrate import ray_cluster
ray_cluster._quiet_import()
from ray._private import ray_logging
lines = ["Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.",
         "[runner/ondevice] step 15: eval loss 0.9691", "mine: a line to keep"]
kept = [line for batch in ray_logging.stderr_deduplicator.deduplicate(
    {"ip": "127.0.0.1", "pid": 7, "is_err": True, "lines": lines}) for line in batch["lines"]]
print(json.dumps({"kept": kept, "variable": os.environ.get("RAY_DEDUP_LOGS_SKIP_REGEX")}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("users", [None, "^mine: "])
def test_ray_noise_is_skipped_on_the_driver_and_the_variable_put_back(users):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_DEDUP_LOGS_SKIP_REGEX", "RAY_DEDUP_LOGS")}
    if users is not None:
        env["RAY_DEDUP_LOGS_SKIP_REGEX"] = users
    done = subprocess.run([sys.executable, "-c", RELAY], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    relayed = ["[runner/ondevice] step 15: eval loss 0.9691"] + ([] if users else ["mine: a line to keep"])
    assert got == {"kept": relayed, "variable": users}

