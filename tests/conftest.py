"""Shared fixtures: a real MLflow tracking server on 127.0.0.1 and a real local Ray instance, each
started once per session (Ray's `ray_start_regular_shared` is the model), and configs composed from
conf/ pointed at a test's temporary folder (the lightning-hydra-template way).

Three tiers (pytest's `--runslow` recipe): `pytest` (`make test`) runs the default tier, everything
shown in this process or on the session's Ray and MLflow server; `pytest --runslow`
(`make test-all`, CI) adds the tests marked `slow`: those whose proof is a process boundary
(signals, kills, a command as a user types it, the README), a cluster, or minutes of training.
`pytest --runslow --runlong` (`make test-long`) adds the tests marked `long`: the other cases of
a family CI runs a representative of (another backend, signal or launcher through the same code,
a README command whose feature a test of its own shows), each naming the test that stands for
it in CI. An explicit `-m` expression chooses for itself.

Tests marked `ort` need ORT's training build (the `ort` extra): in an environment without it (the
current stack, `make test STACK=current`) they are left out, and the run's summary says how many
and why."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.types import RunMode
from mlflow.tracking import MlflowClient

from orchestrate import extras
from orchestrate.config import load_config
from orchestrate.sweeps._server import TrackingServer

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = sorted(p.stem for p in (ROOT / "conf" / "backend").glob("*.yaml"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow: the full suite (make test-all; CI runs it)")
    parser.addoption("--runlong", action="store_true", default=False,
                     help="also run the tests marked slow and long: every case (make test-long)")


WITHOUT_ORT = pytest.StashKey[int]()  # how many tests marked `ort` this environment left out


# A test whose id names an ORT backend or one of ORT's settings needs ORT: marked `ort` here, as if by hand.
ORT_WORDS = re.compile(r"ondevice|ortmodule|ORTMODULE|onnxruntime|log_level|allow_spinning|fp16_optimizer")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if ORT_WORDS.search(item.nodeid):
            item.add_marker(pytest.mark.ort)
    left_out = [] if extras.ORT.present() else ["ort"]
    config.stash[WITHOUT_ORT] = sum(1 for item in items if item.get_closest_marker("ort")) if left_out else 0
    if not config.getoption("-m"):
        runlong = config.getoption("--runlong")
        left_out += [name for name, run in (("slow", runlong or config.getoption("--runslow")), ("long", runlong))
                     if not run]
    dropped = [item for item in items if any(item.get_closest_marker(name) for name in left_out)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in gone]


def pytest_terminal_summary(terminalreporter, config):
    if config.stash.get(WITHOUT_ORT, 0):
        terminalreporter.write_line(f"{config.stash[WITHOUT_ORT]} tests marked ort left out: they need ORT's training "
                                    f"build, which this environment lacks ({extras.ORT.install}, Python 3.11 or 3.12)",
                                    yellow=True)


def ort_backends() -> set[str]:
    """The conf/backend files that train through ORT (the runner: through its default engine)."""
    from orchestrate import schema
    from orchestrate.backends.base import backend_config

    found = set()
    for name in BACKENDS:
        backend = schema.build(backend_config(name), "backend")
        engine = backend.engine_backend() if getattr(backend, "distributed", False) else backend
        if engine.extra is extras.ORT:
            found.add(name)
    return found


ORT_BACKENDS = ort_backends()


def backend_params(names) -> list:
    """`names` (conf/backend names, or tuples whose first item is one) as pytest params, marked
    `ort` where the backend trains through ORT."""
    return [pytest.param(*(n if isinstance(n, tuple) else (n,)),
                         marks=[pytest.mark.ort] if (n[0] if isinstance(n, tuple) else n) in ORT_BACKENDS else [])
            for n in names]


def here(words) -> list[str]:
    """Overrides for a test that is not about a backend: as given where ORT is installed (the
    shipped default, backend=ortmodule); else with backend=torch, and the runner's engine torch
    (its default is ortmodule), unless the words choose."""
    words = list(words)
    if extras.ORT.present():
        return words
    if not any(w.lstrip("+").startswith("backend=") for w in words):
        words.insert(0, "backend=torch")
    if "backend=runner" in words and not any(w.startswith("backend.engine=") for w in words):
        words.append("backend.engine=torch")
    return words


def long(stands_for: str):
    """The mark of a case that runs only in `make test-long`: `stands_for` names the test (or
    case) that shows the same code path in CI's tier."""
    assert stands_for, "a long case names the test that stands for it in CI"
    return pytest.mark.long(stands_for=stands_for)


# MLflow's variables are the defaults of tracking.uri and tracking.experiment: each test starts
# from the environment the session started with (a user's shell may set them; the suite does not).
MLFLOW_DEFAULTS = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "ORCHESTRATE_TRACKING_URI", "MLFLOW_RUN_ID")


@pytest.fixture(autouse=True, scope="session")
def own_state_dir(tmp_path_factory):
    """`orchestrate up`'s record (orchestrate.cluster.warm) in a folder of the session's: every
    command a test starts picks its runtime at its entry from that record, so a warm stack the
    developer left running is never joined by a test (the suite's figures and outputs would depend
    on the machine), and a test's own is never the developer's. Tests that run warm name the
    session's stack (`warm_stack`: its ORCHESTRATE_STATE_DIR). Set for the whole session, so that
    the commands tests start see it too; in-process calls below the entry are cold by default."""
    before = os.environ.get("ORCHESTRATE_STATE_DIR")
    os.environ["ORCHESTRATE_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        os.environ.pop("ORCHESTRATE_STATE_DIR", None)
    else:
        os.environ["ORCHESTRATE_STATE_DIR"] = before


@pytest.fixture(autouse=True)
def mlflow_environment(monkeypatch):
    for name in MLFLOW_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture(scope="session")
def ray_shared():
    """One local Ray with 2 CPUs on 127.0.0.1 for every in-process test that needs Ray (the runner,
    the launcher's in-process sweeps); the runner and the launcher join it and leave it running.
    Its workers import `tests.helpers` (PYTHONPATH holds the repository). Shut down at the end."""
    import ray

    from orchestrate.cluster import ray_cluster

    if ray.is_initialized():
        ray.shutdown()
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), before) if p)
    try:
        ray_cluster.init(None, "test", num_cpus=2)
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before
    yield ray
    ray.shutdown()


@dataclass(frozen=True)
class WarmStack:
    state: Path  # its ORCHESTRATE_STATE_DIR: a command run with it joins the stack
    folder: Path  # the folder whose store (mlflow.db) its MLflow server fronts
    printed: str  # what `orchestrate up` printed


@pytest.fixture(scope="session")
def warm_stack(tmp_path_factory) -> WarmStack:
    """`orchestrate up --num-cpus 2` once for the session, for a folder's store, started from
    another folder (the head's processes run where it started); a test's commands run warm when
    their ORCHESTRATE_STATE_DIR names its state folder (cold otherwise: `own_state_dir`).
    tests/cluster/test_warm.py shows it and ends with `orchestrate down`; here again at the end."""
    state, folder = tmp_path_factory.mktemp("warm_stack_state"), tmp_path_factory.mktemp("warm_stack")
    env = {**os.environ, "ORCHESTRATE_STATE_DIR": str(state)}
    up = subprocess.run([sys.executable, "-m", "orchestrate", "up", "--num-cpus", "2",
                         f"--store=sqlite:///{folder}/mlflow.db"], cwd=state, env=env, capture_output=True,
                        text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    yield WarmStack(state, folder, up.stdout)
    subprocess.run([sys.executable, "-m", "orchestrate", "down"], cwd=state, env=env, capture_output=True, timeout=300)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with a SQLite store (the one sweeps start); yields its URI."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    server = TrackingServer(f"sqlite:///{folder}/mlflow.db", folder / "artifacts")
    yield server.uri
    server.stop()


@pytest.fixture
def make_cfg(tmp_path):
    """compose(overrides) on the synthetic task with the quick trainer, tracking in tmp_path."""

    def make(*overrides: str, uri: str | None = None):
        base = ["data=synthetic", "trainer=quick", f"tracking.uri={uri or f'sqlite:///{tmp_path}/mlflow.db'}"]
        return load_config(here([*base, *overrides]))

    return make


def multirun_config(overrides: list[str]):
    """The config a `-m` command line composes, with its `hydra` node (sweeper, launcher, overrides)."""
    return load_config(overrides, run_mode=RunMode.MULTIRUN, with_hydra=True)


def sweep_runs(folder, experiment: str = "orchestrate"):
    """(client, parent runs, child runs) of the sweeps in `folder`'s MLflow store (sqlite:///mlflow.db)."""
    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("orchestrate.role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def client_for(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri)


def metric_steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node Slurm cluster on 127.0.0.1 (munged, slurmctld, slurmd; tests/slurm.py), started
    once and stopped at the end; its `env` (SLURM_CONF) reaches it. Without Slurm's programs the
    tests that need it fail, saying so: a skipped test shows nothing (.ci/run installs them)."""
    from tests import slurm

    why = slurm.cannot_start()
    if why:
        pytest.fail(f"{why}; .ci/run installs Slurm's programs (slurmctld, slurmd, munge)", pytrace=False)
    cluster = slurm.start()
    yield cluster
    slurm.stop(cluster)


@dataclass(frozen=True)
class InstalledWheel:
    wheel: Path  # the built .whl
    python: Path  # the fresh venv's interpreter
    bin: Path  # its bin/, with the `orchestrate` console script
    env: dict[str, str]  # PATH: venv bin, then .venv/bin (mlflow, ray), then the rest


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory) -> InstalledWheel:
    """This checkout built as a wheel and installed, without its dependencies, into a fresh venv
    that sees the set-up environment's packages but imports orchestrate only from the wheel.
    Nothing is downloaded."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Output of the commands below is captured by pytest and shown if one fails.
    # pip builds in place (build/, *.egg-info): build from a copy, so that the checkout is untouched.
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "mlruns", "outputs", "multirun",
        "*.db"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp / "dist", src],
                   check=True)
    (wheel,) = (tmp / "dist").glob("orchestrate-*.whl")
    # A venv made by the interpreter that made .venv; this pip installs into it (pip >= 22.3: --python).
    venv = tmp / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], check=True)
    # .venv's site-packages on the new venv's sys.path, after its own. A .pth line adds a plain path,
    # not a site dir: .venv's own .pth files (orchestrate's editable install) are not processed.
    purelib = Path(sysconfig.get_paths()["purelib"])
    (venv / purelib.relative_to(sys.prefix) / "_setup_env.pth").write_text(f"{purelib}\n")
    env = {**os.environ, "VIRTUAL_ENV": str(venv),
           "PATH": os.pathsep.join([str(venv / "bin"), str(Path(sys.prefix) / "bin"), os.environ.get("PATH", "")])}
    env.pop("PYTHONPATH", None)  # would put the checkout back on sys.path
    return InstalledWheel(wheel, python, venv / "bin", env)


@pytest.fixture(scope="session")
def hosts():
    """Three test hosts that share nothing (tests/hosts.py): the driver's (hosts.head, with a Ray
    head of no CPUs) and two with a 1-CPU Ray node each, in network and mount namespaces of their
    own; started once, removed at the end. Without root or iproute2 the tests that need them
    fail, saying so (.ci/run installs iproute2)."""
    from tests.hosts import Hosts, cannot_start

    why = cannot_start()
    if why:
        pytest.fail(why, pytrace=False)
    with Hosts(3, ray_cpus=1) as started:
        yield started


@pytest.fixture
def project(tmp_path):
    """The user's project for the tests on hosts (tests.hosts.write_project: a model module and a
    `--config-dir` folder), on the driver's host only."""
    from tests.hosts import write_project

    return write_project(tmp_path)


@pytest.fixture(scope="session")
def s3_on_hosts(hosts):
    """An S3 API server on the driver's host, which every host reaches (tests.hosts.s3_server);
    yields the AWS_* variables a driver sets, with the bucket `checkpoints` made."""
    from tests.hosts import s3_server

    with s3_server(hosts) as env:
        yield env
