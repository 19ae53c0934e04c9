"""The MLflow tracking server as a process: `MlflowServer` (start `mlflow server`, wait for
/health, stop), on a SQLite store (a sweep's own: orchestrate.sweeps._server; the warm stack's:
orchestrate.cluster.warm) or on PostgreSQL, a cluster of its own (`Postgres`: initdb, start, stop)
or a given one (`orchestrate server`: orchestrate.commands.server).
"""

import contextlib
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

from orchestrate import errors
from orchestrate.cluster.ports import free_port

HEALTH_TIMEOUT_S = 120  # mlflow server: start-up, and on a new database its schema migrations
POSTGRES_TIMEOUT_S = 60  # pg_ctl start/stop
CONNECT_TIMEOUT_S = 5  # an existing PostgreSQL (--backend-store-uri)
DEBIAN_BINS = "/usr/lib/postgresql/*/bin"  # Debian's and Ubuntu's packages put the server here, off PATH
USER, DATABASE = "mlflow", "mlflow"  # the own cluster's role and database
# Optuna's studies (hydra/sweeper=orchestrate_optuna) in a database of their own: MLflow's and
# Optuna's schema migrations would share one `alembic_version` table.
STUDIES = f"{DATABASE}_optuna"


class ServerError(errors.Refused):
    """Something outside this process is missing or refuses: one message, exit code 2."""


def check_port(host: str, port: int, option: str) -> None:
    with socket.socket() as s:
        # As the servers bind: SO_REUSEADDR ignores a closed connection's TIME_WAIT, not a listener.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServerError(f"{option}={port}: {host}:{port} is not free ({e.strerror}); another server "
                              f"may be running there: stop it or choose another {option}") from None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that started it ends (Linux's
    PR_SET_PDEATHSIG; the sweep starts its server from its main thread: when the process ends)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def health(uri: str, timeout_s: float = 2.0) -> bool:
    """Whether the MLflow server at `uri` answers /health within `timeout_s`."""
    try:
        urllib.request.urlopen(f"{uri}/health", timeout=timeout_s).close()
        return True
    except OSError:
        return False


class MlflowServer:
    """`mlflow server` in front of `store_uri`, artifacts served from `artifacts` (a folder or a
    bucket URI), started and ready (/health answers) when the constructor returns; with
    `wait=False` started only, `wait_healthy` waits (a sweep starts its server while it checks
    its trials). `log`: where its output goes (None: this console). `detached`: in a session of its
    own, stopped by Linux when the starting thread ends unless `outlive` (`orchestrate up`'s)."""

    def __init__(self, store_uri: str, artifacts: str | Path, host: str = "127.0.0.1", port: int | None = None,
                 log: IO | None = None, timeout_s: float = HEALTH_TIMEOUT_S, wait: bool = True,
                 detached: bool = False, outlive: bool = False):
        self.port = port or free_port(host)
        self.artifacts = artifacts
        self.uri = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"
        # A log-batch request can hold one pooled connection while it waits for a second. With
        # MLflow's default pool (5 + 10 overflow) and 8 trials each sending from several logging
        # threads, every connection ended up held by a waiting request: the server deadlocked
        # ("QueuePool limit ... reached"). A larger pool here, and one logging thread per run
        # (orchestrate.tracking.outbox), keep requests in flight below the pool's size; one worker
        # process keeps the connections (40 + 10 overflow) within PostgreSQL's default 100. No
        # job-runner workers (MLflow's GenAI jobs, unused here): 0.55 GiB instead of 2.6 GiB.
        # The store's URI (a PostgreSQL one holds its password) by the environment, which MLflow's
        # `--backend-store-uri` reads too: a command line is on every user's process list.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
               "MLFLOW_SQLALCHEMYSTORE_POOL_SIZE": "40", "MLFLOW_BACKEND_STORE_URI": store_uri}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(self.port), "--workers", "1",
             "--serve-artifacts", "--artifacts-destination", str(artifacts)],
            env=env, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
            # detached (a sweep's own server): out of the terminal's process group, so that Ctrl-C
            # stops the sweep, which then writes its summary through the server and stops it; and
            # sent SIGTERM by Linux should the process that started it die without stopping it.
            start_new_session=detached, preexec_fn=_die_with_parent if detached and not outlive else None)
        self.healthy = False
        if wait:
            try:
                self.wait_healthy(timeout_s)
            except BaseException:
                self.stop()
                raise

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        if self.healthy:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                self.healthy = True
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise ServerError(f"mlflow server on {self.uri} exited with code {self.proc.returncode} "
                                      "before it answered /health") from None
                if time.monotonic() > deadline:
                    raise ServerError(f"mlflow server on {self.uri} did not answer /health "
                                      f"within {timeout_s:g} s") from None
                time.sleep(0.1)

    def answers(self, timeout_s: float = 2.0) -> bool:
        """Whether the server is up and answers /health now."""
        return self.proc.poll() is None and health(self.uri, timeout_s)

    def stop(self) -> None:
        self.proc.terminate()  # `mlflow server` hands SIGTERM on to its uvicorn and waits for it
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- PostgreSQL -------------------------------------------------------------------------------

def postgres_bin() -> Path:
    """The folder with initdb, pg_ctl and postgres: PATH first, then Debian's versioned folders
    (newest version first)."""
    names = ("initdb", "pg_ctl", "postgres")
    on_path = shutil.which("pg_ctl")
    candidates = [Path(on_path).resolve().parent] if on_path else []
    candidates += sorted((Path(p) for p in Path("/").glob(DEBIAN_BINS.lstrip("/"))),
                         key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)], reverse=True)
    for folder in candidates:
        if all((folder / name).is_file() for name in names):
            return folder
    raise ServerError(f"PostgreSQL not found ({', '.join(names)} on PATH or in {DEBIAN_BINS}): install it "
                      "(Debian/Ubuntu: apt-get install postgresql), or use an existing one with "
                      "--backend-store-uri postgresql://USER:PASSWORD@HOST:PORT/DATABASE")


def redacted(uri: str) -> str:
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", uri)


def with_driver(uri: str) -> str:
    """The URI for mlflow server's SQLAlchemy: a bare postgresql:// would pick the psycopg (3)
    driver, which is not installed; psycopg2 is (the `server` extra)."""
    return re.sub(r"^postgres(ql)?://", "postgresql+psycopg2://", uri)


def check_reachable(uri: str) -> None:
    """An existing PostgreSQL: connect once, so that a typo or a down database is one message now
    rather than a traceback from mlflow server a minute later."""
    if not re.match(r"postgres(ql)?(\+\w+)?://", uri):
        raise ServerError(f"--backend-store-uri={redacted(uri)}: not a PostgreSQL URI; "
                          "allowed: postgresql://USER:PASSWORD@HOST:PORT/DATABASE")
    import psycopg2

    try:
        # libpq reads postgresql:// URIs; SQLAlchemy's `+driver` suffix is not part of them.
        psycopg2.connect(re.sub(r"^postgres(ql)?\+\w+://", "postgresql://", uri),
                         connect_timeout=CONNECT_TIMEOUT_S).close()
    except psycopg2.Error as e:
        reason = " ".join(str(e).split())
        raise ServerError(f"--backend-store-uri={redacted(uri)}: cannot connect "
                          f"(waited up to {CONNECT_TIMEOUT_S} s): {reason}") from None


class Postgres:
    """A PostgreSQL cluster of this server's own: data in `folder`/postgres, listening on
    127.0.0.1 only, its unix socket in that data folder (not /var/run/postgresql, which may not
    exist and belongs to the system's cluster), one password-protected role and database for MLflow.

    PostgreSQL refuses to run as root (a compromised database must not own the machine). Run as
    root (a container, a CI job), its programs run as the unprivileged `postgres` user instead
    (`runuser`; Debian's postgresql package creates that user), which owns the data folder;
    everything else (mlflow, the artifacts) stays with the caller."""

    def __init__(self, folder: Path, port: int | None = None):
        self.bin = postgres_bin()
        self.folder = folder.resolve()
        self.data = self.folder / "postgres"
        self.log = self.folder / "postgres.log"
        self.password_file = self.folder / "postgres.password"  # readable by the caller only
        self.port = port or free_port()
        self.owner = pwd.getpwuid(os.geteuid())
        self.as_owner: list[str] = []
        if os.geteuid() == 0:
            try:
                self.owner = pwd.getpwnam("postgres")
            except KeyError:
                raise ServerError("running as root: PostgreSQL refuses to run as root, and there is no `postgres` "
                                  "user to run it as; create one (useradd --system postgres), run as another "
                                  "user, or pass --backend-store-uri") from None
            runuser = shutil.which("runuser") or "/usr/sbin/runuser"
            self.as_owner = [runuser, "-u", "postgres", "--"]

    def run(self, *command: str, timeout: float = POSTGRES_TIMEOUT_S + 10) -> subprocess.CompletedProcess:
        # cwd: the data's folder, which the owner can enter (the caller's may be closed to it).
        return subprocess.run([*self.as_owner, *command], cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout)

    def give(self, path: Path) -> None:
        os.chown(path, self.owner.pw_uid, self.owner.pw_gid)

    def running(self) -> bool:
        return self.data.is_dir() and self.run(str(self.bin / "pg_ctl"), "status", "-D", str(self.data)).returncode == 0

    def prepare(self) -> None:
        """Everything that can be refused before a process starts: the folder, the port, a
        cluster already running there (another server's: it must not be stopped by this one)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data.mkdir(mode=0o700, exist_ok=True)
        self.give(self.data)
        self.log.touch()
        self.give(self.log)
        if self.as_owner and self.run("test", "-w", str(self.data)).returncode != 0:
            raise ServerError(f"--data-dir={self.folder}: the `postgres` user (PostgreSQL cannot run as root) cannot "
                              "enter it, since a folder above it is closed to other users (e.g. /root); choose a "
                              "--data-dir it can reach, e.g. /srv/mlflow-server")
        if self.running():
            raise ServerError(f"--data-dir={self.folder}: its PostgreSQL is already running (another `orchestrate "
                              f"server`, or one that was killed): stop that one, or `pg_ctl stop -D {self.data}`")
        check_port("127.0.0.1", self.port, "--postgres-port")

    def init(self) -> None:
        """initdb, once: the role `mlflow` with a random password (scram-sha-256 for every
        connection, over TCP and the socket alike), which is kept in postgres.password."""
        if (self.data / "PG_VERSION").exists():
            return
        password = secrets.token_urlsafe(24)
        pwfile = self.folder / ".initdb-password"
        pwfile.write_text(password)
        try:
            os.chmod(pwfile, 0o600)
            self.give(pwfile)
            done = self.run(str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, f"--pwfile={pwfile}",
                            "--auth=scram-sha-256", "--encoding=UTF8", "--no-instructions")
        finally:
            pwfile.unlink()
        if done.returncode != 0:
            raise ServerError(f"initdb {self.data} failed: {last_line(done.stderr)}")
        self.password_file.write_text(password)
        os.chmod(self.password_file, 0o600)

    def start(self) -> str:
        """pg_ctl start (it waits for PostgreSQL to accept connections), then the database;
        returns the URI for mlflow server."""
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                   f"-c unix_socket_directories={shlex.quote(str(self.data))}")
        done = self.run(str(self.bin / "pg_ctl"), "start", "-D", str(self.data), "-l", str(self.log), "-w",
                        "-t", str(POSTGRES_TIMEOUT_S), "-o", options)
        if done.returncode != 0:
            raise ServerError(f"PostgreSQL in {self.data} did not start and accept connections within "
                              f"{POSTGRES_TIMEOUT_S} s: {last_line(self.log.read_text())} (log: {self.log})")
        uri = f"postgresql://{USER}:{self.password_file.read_text().strip()}@127.0.0.1:{self.port}/{DATABASE}"
        import psycopg2

        with contextlib.closing(psycopg2.connect(uri.rsplit("/", 1)[0] + "/postgres",
                                                 connect_timeout=CONNECT_TIMEOUT_S)) as db:
            db.autocommit = True  # CREATE DATABASE cannot run in a transaction
            with db.cursor() as cur:
                for name in (DATABASE, STUDIES):
                    cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                    if cur.fetchone() is None:
                        cur.execute(f"CREATE DATABASE {name}")
        return uri

    def stop(self) -> None:
        """Fast shutdown: open connections are closed, committed data is on disk."""
        if self.running():
            self.run(str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w",
                     "-t", str(POSTGRES_TIMEOUT_S))


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


# ---- the command --------------------------------------------------------------------------------
