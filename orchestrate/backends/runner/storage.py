"""Where the runner's checkpoints go (`backend.storage_path`), and whether every host reaches
them and the data.

Ray Train copies each reported checkpoint to its storage, restarts failed workers from there,
and the driver reads the run's last report from there: on a cluster whose hosts share no disk
that storage must be one every host reaches. `backend.storage_path` is
- unset: a folder in the run's output folder (one machine);
- a folder: the same folder on every host (a shared file system, NFS and the like);
- `s3://bucket/prefix`: S3 or an S3-compatible object store. Its endpoint and credentials come
  from the standard AWS variables of the driver's environment (AWS_ENDPOINT_URL_S3 or
  AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION or
  AWS_DEFAULT_REGION); the file system built from them travels with the run to every worker, so
  the other hosts need no settings of their own.

`check_shared` proves it before any run opens: a file written on the driver's node is read back on
every other host of the cluster, within the placement timeout; a folder that is not the same everywhere, or a bucket
a host cannot reach, is refused in one line naming the setting and what would work. `check_data`
does the same for the files and folders the data config names: each host must have them at the
same path (or inside the working folder, which goes to every host with the code).
"""

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from orchestrate.schema import ConfigError

KEY = "backend.storage_path"
WORKS = ("set backend.storage_path to s3://bucket/prefix (object storage; endpoint and credentials from the AWS_* "
         "variables) or to a folder every host mounts")


@dataclass(frozen=True)
class Storage:
    """What Ray Train's RunConfig takes: `path` (without its scheme when `filesystem` is given)."""

    path: str
    filesystem: object = None  # a pyarrow file system (S3), or None: a local folder
    given: str | None = None  # backend.storage_path as set (None: the run's output folder)

    @property
    def shown(self) -> str:
        return f"{KEY}={self.given}" if self.given else f"{KEY} (unset: the run's output folder {self.path})"


def check_scheme(storage_path: str | None) -> None:
    """ConfigError for a `backend.storage_path` whose scheme this does not take."""
    if storage_path and "://" in storage_path and not storage_path.startswith("s3://"):
        scheme = storage_path.split("://")[0]
        raise ConfigError(f"{KEY}={storage_path}: {scheme}:// is not supported here; allowed: a folder, or "
                          "s3://bucket/prefix")


def resolve(storage_path: str | None, out_dir: Path) -> Storage:
    """The storage `backend.storage_path` names, for a run whose output folder is `out_dir`."""
    check_scheme(storage_path)
    if not storage_path:
        return Storage(str((out_dir / "ray").resolve()))
    if storage_path.startswith("s3://"):
        return Storage(storage_path[len("s3://"):].rstrip("/"), s3_filesystem(), storage_path)
    return Storage(str(Path(storage_path).expanduser().resolve()), None, storage_path)


def s3_filesystem():
    """S3 from the standard AWS variables; short timeouts, so that an endpoint that does not
    answer is said within seconds, not after the SDK's retries."""
    from pyarrow import fs

    env = os.environ
    options = dict(connect_timeout=5, request_timeout=30,
                   region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1")
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        scheme, _, rest = endpoint.partition("://")
        options.update(endpoint_override=rest or scheme, scheme=scheme if rest else "https")
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        options.update(access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"],
                       session_token=env.get("AWS_SESSION_TOKEN"))
    return fs.S3FileSystem(**options)


def _at(storage: Storage, path: str, do: str) -> str | None:
    """A Ray task on one host (max_calls=1: its own process): `do` the marker at `path` there,
    "write" (its folder made), "read" (its content, None where it is not) or "remove"."""
    from pyarrow import fs

    files = storage.filesystem or fs.LocalFileSystem()
    try:
        if do == "write":
            files.create_dir(storage.path, recursive=True)
            with files.open_output_stream(path) as out:
                out.write(path.encode())
        elif do == "read":
            with files.open_input_stream(path) as source:
                return source.read().decode()
        else:
            files.delete_file(path)
    except FileNotFoundError:
        return None
    finally:
        if storage.filesystem is not None:  # the process ends after this task: S3's client first
            fs.finalize_s3()
    return path


def other_hosts() -> dict[str, str]:
    """The cluster's alive nodes on other hosts than this process's: address -> a node id there."""
    import ray

    here = ray.util.get_node_ip_address()
    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes()
            if n.get("Alive") and n["NodeManagerAddress"] != here}


def _on(node: str, fn, *args):
    """`fn(*args)` as a Ray task on `node` (its own process: max_calls=1), in the job's runtime
    environment (the working folder shipped to a cluster elsewhere is its current folder)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0, max_calls=1)(fn)
    return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)


def _failed(host: str, ref, timeout_s: float, timeout_key: str) -> str | None:
    """None when the task `ref` (waited for already) answered; else why not, in a few words."""
    import ray

    try:
        ray.get(ref, timeout=0)
        return None
    except ray.exceptions.RayTaskError as e:
        return f"{host}: {type(e.cause).__name__}: {str(e.cause).splitlines()[0][:200]}"
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        return f"{host}: no answer within {timeout_key}={timeout_s:g} s"
    except ray.exceptions.RayError as e:  # its node or worker gone meanwhile
        return f"{host}: {type(e).__name__}"


def _ask_every_host(hosts: dict[str, str], fn, args: tuple, timeout_s: float, timeout_key: str) -> tuple[dict, list]:
    """`fn(*args)` on one node of every host at once: (host -> answer, for those that answered;
    why each other one did not)."""
    import ray

    asked = {host: _on(node, fn, *args) for host, node in hosts.items()}
    ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
    problems = {host: _failed(host, ref, timeout_s, timeout_key) for host, ref in sorted(asked.items())}
    answers = {host: ray.get(asked[host]) for host, why in problems.items() if not why}
    return answers, [why for why in problems.values() if why]


def check_shared(storage: Storage, timeout_s: float, timeout_key: str) -> None:
    """Refuse (ConfigError) storage that some host of the cluster does not share with this one:
    a marker written on this process's node is read on one node of every other host, each step
    a Ray task waited for at most `timeout_s`. One machine (no other hosts) needs no check. Ray
    must be initialized."""
    import ray

    hosts = other_hosts()
    if not hosts:
        return
    if storage.given is None:
        raise ConfigError(f"{storage.shown}: the cluster has other hosts ({', '.join(sorted(hosts))}), which do not "
                          f"see this machine's folders; {WORKS}")
    here = ray.get_runtime_context().get_node_id()
    path = f"{storage.path}/.orchestrate-storage-check-{uuid.uuid4().hex[:12]}"
    written = _on(here, _at, storage, path, "write")
    ray.wait([written], timeout=timeout_s)
    why = _failed("this host", written, timeout_s, timeout_key)
    if why:
        raise ConfigError(f"{storage.shown}: cannot be written from here ({why.split(': ', 1)[1]}); {WORKS}")
    try:
        answers, unreachable = _ask_every_host(hosts, _at, (storage, path, "read"), timeout_s, timeout_key)
    finally:
        ray.wait([_on(here, _at, storage, path, "remove")], timeout=timeout_s)
    missing = [host for host, answer in answers.items() if answer != path]
    if missing:
        raise ConfigError(f"{storage.shown}: not the same folder on host(s) {', '.join(missing)} (a file written here "
                          f"is not there); {WORKS}")
    if unreachable:
        raise ConfigError(f"{storage.shown}: not reachable from every host ({'; '.join(unreachable)}); {WORKS}")


def data_paths(node, key: str = "data") -> dict[str, str]:
    """The files and folders a data config names (`key` -> the value as given): its string values
    (not `_target_` and the like) that name a file or folder here, relative to this process's
    folder or absolute. A data set's own class reads them on every rank."""
    if isinstance(node, dict):
        return {k: v for name, value in node.items() if not str(name).startswith("_")
                for k, v in data_paths(value, f"{key}.{name}").items()}
    if isinstance(node, (list, tuple)):
        return {k: v for i, value in enumerate(node) for k, v in data_paths(value, f"{key}[{i}]").items()}
    if isinstance(node, str) and node.strip() not in ("", ".") and Path(node).expanduser().exists():
        return {key: node}
    return {}


def _missing(paths: list[str]) -> list[str]:
    """Those of `paths` not on this host (relative ones: to the task's folder, the shipped working folder)."""
    return [p for p in paths if not Path(p).expanduser().exists()]


def check_data(data: dict, timeout_s: float, timeout_key: str) -> None:
    """Refuse (ConfigError) a data config whose files or folders some other host of the cluster
    does not have at the same path (each rank reads the data where it runs): asked on one node of
    every other host, as a Ray task waited for at most `timeout_s`. One machine: nothing to ask."""
    hosts = other_hosts()
    paths = data_paths(data)
    if not hosts or not paths:
        return
    answers, unreachable = _ask_every_host(hosts, _missing, (sorted(set(paths.values())),), timeout_s, timeout_key)
    for key, path in paths.items():
        lacking = [host for host, missing in answers.items() if path in missing]
        if lacking:
            raise ConfigError(
                f"{key}={path}: not on host(s) {', '.join(lacking)}, where the workers read it (each host reads the "
                "data at the same path); copy it there, put it in a folder every host mounts, or inside the working "
                "folder (it goes to every host with the code, leaving out what .gitignore names)")
    if unreachable:
        raise ConfigError(f"{', '.join(paths)}: could not be looked for on every host ({'; '.join(unreachable)})")
