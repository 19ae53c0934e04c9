"""What Ray prints on the driver that says nothing to act on (orchestrate.cluster.ray_cluster): lines its
own processes relay that RAY_NOISE names are skipped by Ray's log deduplicator, through the
variable Ray reads when it is imported; the variable is put back afterwards. And the guide's
step that makes a Ray token: the file it leaves is its owner's alone."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

# In a fresh process: import ray through ray_cluster, then hand a batch of relayed lines to the
# deduplicator that prints the workers' stderr on the driver; print what it would print, and
# the variable as the process has it afterwards.
RELAY = """
import json, os
from orchestrate.cluster import ray_cluster
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



@pytest.mark.slow
def test_the_readmes_token_step_writes_a_file_only_its_owner_reads(tmp_path):
    """`(umask 077; ray get-auth-token --generate)`, the guide's step (docs/runner.md), writes
    ~/.ray/auth_token with mode 0600; under the usual umask 022 Ray writes it 0644, `chmod 600`
    makes it private, and a token generated again into it keeps that mode. Offline: the token is
    made on this machine."""
    ray = Path(sys.executable).with_name("ray")

    def generate(home: Path, umask: str) -> int:
        env = {**os.environ, "HOME": str(home)}
        done = subprocess.run(["sh", "-c", f'umask {umask}; "{ray}" get-auth-token --generate'], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
        return stat.S_IMODE((home / ".ray" / "auth_token").stat().st_mode)

    assert generate(tmp_path / "private", "077") == 0o600
    assert stat.S_IMODE((tmp_path / "private" / ".ray").stat().st_mode) == 0o700
    assert generate(tmp_path / "usual", "022") == 0o644
    (tmp_path / "usual" / ".ray" / "auth_token").chmod(0o600)
    assert generate(tmp_path / "usual", "022") == 0o600


def test_a_working_folder_past_rays_limit_is_one_line_naming_the_folder(monkeypatch, tmp_path):
    """Ray's own refusal (its package upload, with its limit lowered to 10 bytes) as the command says it."""
    from ray._private.runtime_env import packaging

    from orchestrate.cluster import ray_cluster

    monkeypatch.setattr(packaging, "GCS_STORAGE_MAX_SIZE", 10)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as raised:
        packaging._store_package_in_gcs("gcs://_ray_pkg_test.zip", b"x" * 100)
    refused = ray_cluster.too_large(raised.value, "backend.ray_address", "10.0.0.1:6379")
    assert "\n" not in str(refused)
    assert str(refused).startswith(f"backend.ray_address=10.0.0.1:6379: this folder ({tmp_path}) is shipped")
    assert "(Package size (0.00MiB) exceeds the maximum size of 0.00MiB)" in str(refused)
    assert ".gitignore or .rayignore" in str(refused)
    assert ray_cluster.too_large(ValueError("another"), "k", "a") is None


def test_auto_is_checked_as_the_address_it_names(monkeypatch):
    """`backend.ray_address=auto` names the cluster Ray would join (here RAY_ADDRESS's): refused in
    seconds when nothing answers there, in the words an address gets, `auto` named."""
    import time

    from orchestrate.cluster import ray_cluster
    from tests.helpers import free_port

    port = free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    began = time.monotonic()
    with pytest.raises(ray_cluster.RayUnavailable) as refused:
        ray_cluster.check_access("auto", "backend.ray_address")
    assert str(refused.value).startswith(f"backend.ray_address=auto (the cluster at 127.0.0.1:{port}): nothing "
                                         f"answers at 127.0.0.1:{port}")
    assert time.monotonic() - began < 5


def test_ray_output_that_calls_itself_harmless_goes_to_the_log_not_the_console(ray_shared, capfd, caplog,
                                                                               monkeypatch):
    """A Ray process's warning that says it is safe to ignore, with its traceback (Ray Train's
    autoscaling client under load), is kept off the driver's console and in its log; the lines
    around it are printed as before."""
    import logging
    import time

    from orchestrate.cluster import ray_cluster

    ray = ray_shared
    # Handlers an earlier in-process run left on a stream pytest has closed since would print
    # logging's own error (with the record) on the console: not this process's, left out.
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers
                                           if not getattr(getattr(h, "stream", None), "closed", False)])

    @ray.remote
    def say(text: str) -> None:
        import sys

        print(text, file=sys.stderr, flush=True)

    harmless = ("Failed to send resource request for ctrl. If this only happens transiently during network partition "
                "or CPU being overloaded, it's safe to ignore this error. If this error persists, file a GitHub issue.\n"
                "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.")
    with caplog.at_level(logging.INFO, logger="orchestrate.cluster.ray_cluster"), \
            ray_cluster.harmless_output_to_log():
        ray.get(say.remote(harmless))
        ray.get(say.remote("a line of the user's own, printed"))
        printed, until = "", time.monotonic() + 60
        while "a line of the user's own, printed" not in printed and time.monotonic() < until:
            time.sleep(0.2)
            out, err = capfd.readouterr()
            printed += out + err
    assert "a line of the user's own, printed" in printed
    assert "safe to ignore" not in printed and "GetTimeoutError" not in printed, printed
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "it's safe to ignore this error" in logged and "GetTimeoutError" in logged


class FakeRay:
    """The two calls `leave` makes of ray."""

    def __init__(self) -> None:
        self.up, self.shutdowns = True, 0

    def is_initialized(self) -> bool:
        return self.up

    def shutdown(self) -> None:
        self.up, self.shutdowns = False, self.shutdowns + 1


@pytest.mark.parametrize("joined", [True, False])
def test_leave_lets_go_only_of_the_ray_init_started_or_joined(monkeypatch, joined):
    """A command ends with `leave` (Ray's own exit hook sleeps half a second first): it shuts down
    the Ray that `init` brought into this process, once, and never a Ray the caller had."""
    from orchestrate.cluster import ray_cluster

    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_cluster, "_JOINED", joined)
    monkeypatch.setattr(ray_cluster, "_WARM", "127.0.0.1:6379" if joined else None)
    monkeypatch.setattr(ray_cluster, "_LOCAL_SESSION", ray_cluster._LOCAL_SESSION)  # the session's Ray's, given back
    ray_cluster.leave()
    ray_cluster.leave()
    assert fake.shutdowns == (1 if joined else 0)
    assert fake.up is not joined
    assert ray_cluster._WARM is None and not ray_cluster._JOINED


def test_a_wait_on_a_head_that_stopped_answering_is_given_up_after_head_lost_s(monkeypatch):
    """HeadWatch: a head that answers resets the clock; one that does not for HEAD_LOST_S is HeadLost, named."""
    import socket
    import time
    from types import SimpleNamespace

    from orchestrate.cluster import ray_cluster

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    import ray

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address=f"127.0.0.1:{port}"))
    monkeypatch.setattr(ray_cluster, "HEAD_PROBE_S", 0.0)
    monkeypatch.setattr(ray_cluster, "HEAD_LOST_S", 0.5)
    watch = ray_cluster.HeadWatch()
    time.sleep(0.6)
    watch.check()  # it answers: not lost, however long since the watch began
    server.close()
    watch.check()  # not answering, for less than HEAD_LOST_S
    time.sleep(0.6)
    with pytest.raises(ray_cluster.HeadLost, match=rf"the Ray head at 127\.0\.0\.1:{port} has not answered for 1 s"):
        watch.check()
