"""`orchestrate server` end to end: the real command starts its own PostgreSQL cluster (as the
unprivileged `postgres` user when the tests run as root) and `mlflow server` in front of it; a
sweep and a two-worker runner run log to it as subprocesses, and everything is read back through
MlflowClient, the served artifacts and a plain PostgreSQL connection. Bad input is one message,
exit code 2, within seconds."""

import hashlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrate.cluster import mlflow_server
from orchestrate.commands import server
from tests.conftest import ROOT, client_for, metric_steps
from tests.helpers import command_exit, free_port

STEPS = 10
QUICK = ["data=synthetic", "trainer=quick", f"trainer.max_steps={STEPS}", "trainer.display_loss_steps=1",
         "model.hidden=[32]"]
# A 4-trial sweep: 4 writers at once, and the runner's (scripts/concurrency.py runs 16 against the
# same server: docs/concurrency.md).
LRS = [round(1e-3 * (i + 1), 4) for i in range(4)]
LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def orchestrate(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrate", *args]


@dataclass
class Server:
    uri: str
    port: int
    data: Path  # --data-dir
    proc: subprocess.Popen
    output: Path  # its stdout and stderr

    @property
    def postgres_uri(self) -> str:
        """The own cluster, as psycopg2 reaches it: port from postmaster.pid (its 4th line)."""
        port = (self.data / "postgres" / "postmaster.pid").read_text().splitlines()[3]
        password = (self.data / "postgres.password").read_text().strip()
        return f"postgresql://{mlflow_server.USER}:{password}@127.0.0.1:{port}/{mlflow_server.DATABASE}"


def start(folder: Path, data: str = "data", *args: str) -> Server:
    """`orchestrate server --data-dir folder/data ...` as a subprocess, once it says it is ready."""
    port = free_port()
    output = folder / f"server-{port}.out"
    proc = subprocess.Popen(orchestrate("server", "--data-dir", str(folder / data), "--port", str(port), *args),
                            cwd=folder, env=ENV, stdout=output.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while "Ctrl-C stops it." not in output.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"orchestrate server did not start within 240 s:\n{output.read_text()[-3000:]}")
        time.sleep(0.5)
    return Server(f"http://127.0.0.1:{port}", port, folder / data, proc, output)


def stop(srv: Server) -> int:
    srv.proc.send_signal(signal.SIGTERM)
    return srv.proc.wait(timeout=120)


def listening(port: int) -> set[str]:
    """The local addresses with a listening TCP socket on `port` (any process)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.fixture(scope="module")
def folder():
    """A folder the `postgres` user can enter: pytest's own temporary folders are 0700 root's."""
    try:
        mlflow_server.postgres_bin()
    except mlflow_server.ServerError as e:  # .ci/run installs PostgreSQL: without it these tests fail, saying so
        pytest.fail(str(e), pytrace=False)
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:  # Debian's postgresql package creates it; a bare install may not
            subprocess.run(["useradd", "--system", "--no-create-home", "postgres"], check=True)
    path = Path(tempfile.mkdtemp(prefix="orchestrate-server-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def team(folder):
    """The real `orchestrate server`, with its own PostgreSQL in a temporary folder."""
    srv = start(folder)
    yield srv
    if srv.proc.poll() is None:
        stop(srv)


@pytest.fixture(scope="module")
def tracked(team, folder):
    """A sweep of len(LRS) trials (Ray launcher, all trials at once) and a two-worker runner run,
    both at once: 8 writers on the server; each command's finished process (stdout and stderr in one)."""
    runs = folder / "runs"
    runs.mkdir()
    commands = {
        "sweep": orchestrate("-m", f"optimizer.lr={','.join(map(str, LRS))}", "backend=torch", *QUICK, "tracking=server",
                             f"tracking.uri={team.uri}", f"hydra.launcher.cpus_per_trial={1 / len(LRS)}"),
        "runner": orchestrate("backend=runner", "backend.engine=torch", "trainer.num_workers=2", *QUICK,
                              "trainer.checkpoint_period=5", "tracking=server", f"tracking.uri={team.uri}",
                              "tracking.run_name=runner-on-postgres"),
    }
    procs = {}
    for name, command in commands.items():
        (runs / name).mkdir()
        procs[name] = subprocess.Popen(command, cwd=runs / name, env=ENV, stdout=(runs / f"{name}.out").open("w"),
                                       stderr=subprocess.STDOUT)
    done = {name: subprocess.CompletedProcess(p.args, p.wait(timeout=600), (runs / f"{name}.out").read_text())
            for name, p in procs.items()}
    return done["sweep"], done["runner"], runs


@pytest.mark.slow
def test_a_sweep_logs_every_trial_and_step(tracked, team):
    sweep, _, _ = tracked
    assert sweep.returncode == 0, sweep.stdout[-3000:]
    client = client_for(team.uri)
    experiment = client.get_experiment_by_name("orchestrate")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    (parent,) = [r for r in runs if r.data.tags.get("orchestrate.role") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED"
    assert sorted(float(c.data.params["optimizer.lr"]) for c in children) == LRS
    assert len({c.data.tags["pid"] for c in children}) == len(LRS)  # one worker process each, all at once
    for child in children:
        assert child.info.status == "FINISHED"
        assert [s for s, _ in metric_steps(client, child.info.run_id, "train/loss")] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_the_runner_logs_every_step_and_its_checkpoints_through_the_server(tracked, team, tmp_path):
    _, runner, runs = tracked
    assert runner.returncode == 0, runner.stdout[-3000:]
    client = client_for(team.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id],
                                "attributes.run_name = 'runner-on-postgres'")
    assert run.info.status == "FINISHED"
    assert [s for s, _ in metric_steps(client, run.info.run_id, "train/loss")] == list(range(1, STEPS + 1))
    # Served artifacts: the client uploads to the server, which stores them in its own folder.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    logged = sorted(a.path for a in client.list_artifacts(run.info.run_id, "checkpoints"))
    assert [Path(p).name for p in logged] == ["step_0000005.pt", "step_0000010.pt"]
    downloaded = Path(client.download_artifacts(run.info.run_id, logged[0], str(tmp_path)))
    (written,) = (runs / "runner").glob("outputs/*/*/checkpoints/step_0000005.pt")  # the file rank 0 wrote
    (stored,) = (team.data / "artifacts").rglob(f"{run.info.run_id}/artifacts/checkpoints/step_0000005.pt")
    digest = hashlib.sha256(written.read_bytes()).hexdigest()
    assert hashlib.sha256(downloaded.read_bytes()).hexdigest() == digest
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == digest


@pytest.mark.slow
def test_the_store_is_postgresql(tracked, team):
    import psycopg2

    client = client_for(team.uri)
    ids = {r.info.run_id for r in client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])}
    with psycopg2.connect(team.postgres_uri) as db, db.cursor() as cur:
        cur.execute("SELECT version()")
        assert cur.fetchone()[0].startswith("PostgreSQL")
        cur.execute("SELECT run_uuid FROM runs")
        assert {row[0] for row in cur.fetchall()} == ids  # 1 parent + the trials + the runner
        cur.execute("SELECT count(*) FROM metrics WHERE key = 'train/loss' GROUP BY run_uuid")
        assert sorted(row[0] for row in cur.fetchall()) == [STEPS] * (len(LRS) + 1)


@pytest.mark.slow
def test_mlflow_and_postgresql_listen_on_loopback_only(team):
    postgres_port = int(team.postgres_uri.rsplit(":", 1)[1].split("/")[0])
    assert listening(team.port) == {LOOPBACK}
    assert listening(postgres_port) == {LOOPBACK}
    assert f"tracking.uri={team.uri}" in team.output.read_text()  # what to set, printed


@pytest.mark.slow
def test_no_process_has_the_database_password_on_its_command_line(team):
    """Every user of the machine reads every process's command line (ps): the password reaches
    `mlflow server` and its workers by their environment, readable by their user only."""
    password = (team.data / "postgres.password").read_text().strip()
    seen = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            seen.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # a process that ended meanwhile
            continue
    assert any("mlflow" in line and "server" in line for line in seen)
    assert not [line for line in seen if password in line]


@pytest.mark.slow
def test_a_second_server_in_front_of_an_existing_postgresql(team, folder):
    """--backend-store-uri: the team's database, reached by another `orchestrate server`; stopping
    that one leaves the database running."""
    import psycopg2

    client_for(team.uri).create_experiment("seen-by-both")
    other = start(folder, "other", "--backend-store-uri", team.postgres_uri)
    assert client_for(other.uri).get_experiment_by_name("seen-by-both") is not None
    password = (team.data / "postgres.password").read_text().strip()
    assert password not in other.output.read_text() and ":***@" in other.output.read_text()  # not printed
    assert stop(other) == 0
    psycopg2.connect(team.postgres_uri).close()  # still up


@pytest.mark.slow
def test_a_pruning_sweeps_study_lives_in_the_servers_postgresql(team, folder):
    """The study storage the server prints (its own PostgreSQL, a database beside MLflow's): a
    pruned sweep keeps its study there, and its runs on the server."""
    import optuna

    from tests.sweeps.test_optuna_sweeper import PRUNED_SWEEP

    printed = re.search(r"hydra\.sweeper\.storage=(\S+) \(PASSWORD in (\S+)\)", team.output.read_text())
    storage = printed.group(1).replace("PASSWORD", Path(printed.group(2)).read_text().strip())
    cwd = folder / "pruned"
    cwd.mkdir()
    done = subprocess.run(orchestrate(*PRUNED_SWEEP, "hydra/launcher=basic", "hydra.sweeper.n_trials=3", "tracking=server",
                                      f"tracking.uri={team.uri}", f"hydra.sweeper.storage='{storage}'"),
                          cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reach = mlflow_server.with_driver(storage)  # psycopg2's driver, as the sweep reaches it
    (summary,) = optuna.get_all_study_summaries(reach)
    study = optuna.load_study(study_name=summary.study_name, storage=reach)
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "PRUNED", "PRUNED"]
    pruned = client_for(team.uri).search_runs(
        [client_for(team.uri).get_experiment_by_name("orchestrate").experiment_id], "tags.pruned = '10'")
    assert len(pruned) == 2


@pytest.mark.slow
def test_sigterm_stops_mlflow_and_postgresql(team):
    postgres_port = int(team.postgres_uri.rsplit(":", 1)[1].split("/")[0])
    assert stop(team) == 0
    assert not (team.data / "postgres" / "postmaster.pid").exists()  # PostgreSQL shut down cleanly
    assert listening(team.port) == set() and listening(postgres_port) == set()


# ---- bad input: one message, exit code 2, within seconds ---------------------------------------

def test_an_unreachable_store_is_one_message(tmp_path):
    uri = f"postgresql://someone:secret@127.0.0.1:{free_port()}/mlflow"
    began = time.monotonic()
    done = subprocess.run(orchestrate("server", "--port", str(free_port()), "--backend-store-uri", uri),
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --backend-store-uri=postgresql://someone:***@127.0.0.1:")
    assert "cannot connect" in done.stderr and "secret" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert time.monotonic() - began < 60  # the command starts Python and imports psycopg2 and MLflow


def test_a_port_in_use_is_one_message(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert command_exit(server.main, ["--port", str(port), "--data-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --port={port}: 127.0.0.1:{port} is not free (Address already in "
                                       "use); another server may be running there: stop it or choose another --port\n")


def test_missing_postgresql_is_one_message(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mlflow_server, "DEBIAN_BINS", str(tmp_path / "postgresql" / "*" / "bin"))
    assert command_exit(server.main, ["--port", str(free_port()), "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: PostgreSQL not found (initdb, pg_ctl, postgres on PATH or in ")
    assert "apt-get install postgresql" in err and "--backend-store-uri" in err


def test_a_store_that_is_not_postgresql_is_refused(capsys):
    assert command_exit(server.main, ["--port", str(free_port()), "--backend-store-uri", "sqlite:///mlflow.db"]) == 2
    assert capsys.readouterr().err == ("error: --backend-store-uri=sqlite:///mlflow.db: not a PostgreSQL URI; "
                                       "allowed: postgresql://USER:PASSWORD@HOST:PORT/DATABASE\n")
