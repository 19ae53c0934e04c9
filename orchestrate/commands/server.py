"""`orchestrate server`: the team's MLflow tracking server, on PostgreSQL, with artifacts served.

    python -m orchestrate server                    # own PostgreSQL in ./mlflow-server; http://127.0.0.1:5000
    python -m orchestrate server --host 0.0.0.0     # reachable from other machines (Ray workers, teammates)
    python -m orchestrate server --backend-store-uri postgresql://USER:PASSWORD@HOST:5432/DB  # an existing one

Runs then log to it with `tracking=server` (another machine: `tracking.uri=http://HOST:5000`).
The server stores runs in PostgreSQL (many writers at once, unlike a SQLite file) and takes
artifact uploads itself (`--serve-artifacts`): workers on other nodes need no shared disk, only
the server's URL. Without --backend-store-uri it runs a PostgreSQL cluster of its own in
--data-dir (created the first time), on 127.0.0.1 only; Ctrl-C or SIGTERM stops MLflow, then it.

`MlflowServer` (start `mlflow server`, wait for /health, stop) is also the sweeps' own server
on SQLite (orchestrate.sweeps._server).
"""

import argparse
import contextlib
import socket
from pathlib import Path

from orchestrate import errors, extras, signals
from orchestrate.boundary import TOOL, Where, boundary
from orchestrate.cluster.mlflow_server import (
    STUDIES,
    USER,
    MlflowServer,
    Postgres,
    check_port,
    check_reachable,
    redacted,
    with_driver,
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orchestrate server", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on; 0.0.0.0 to be reachable from other machines")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--data-dir", type=Path, default=Path("mlflow-server"),
                   help="the own PostgreSQL cluster (postgres/), its log and password, and the artifacts")
    p.add_argument("--backend-store-uri", help="an existing PostgreSQL, postgresql://USER:PASSWORD@HOST:PORT/DB, "
                                               "instead of the own cluster")
    p.add_argument("--artifacts-destination", help="where served artifacts are stored (a folder, or e.g. "
                                                   "s3://bucket/path); default: DATA_DIR/artifacts")
    p.add_argument("--postgres-port", type=int, help="the own cluster's port on 127.0.0.1; default: a free one")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    with boundary(Where(TOOL)):
        missing = extras.SERVER.missing("orchestrate server")  # MLflow reaches PostgreSQL through psycopg2
        if missing:
            raise errors.Refused(missing)
        try:
            # SIGTERM (systemd, docker stop, kill) and SIGHUP shut down as Ctrl-C does.
            with signals.stop_on_signals():
                serve(args)
        except KeyboardInterrupt:
            return 0


def serve(args: argparse.Namespace) -> None:
    """MLflow's server on the store `args` name (PostgreSQL: its own cluster, or a given one) until
    it exits (errors.Failed) or a signal stops it (then it, and the own cluster, are stopped)."""
    artifacts = args.artifacts_destination or str((args.data_dir / "artifacts").resolve())
    with contextlib.ExitStack() as running:
        check_port(args.host, args.port, "--port")
        studies = ""
        if args.backend_store_uri:
            check_reachable(args.backend_store_uri)
            store_uri, store = args.backend_store_uri, redacted(args.backend_store_uri)
        else:
            postgres = Postgres(args.data_dir, args.postgres_port)
            postgres.prepare()
            running.callback(postgres.stop)  # also when interrupted half-way through starting
            postgres.init()
            store_uri = postgres.start()
            store = f"PostgreSQL in {postgres.data} on 127.0.0.1:{postgres.port}"
            studies = (f"\nOptuna studies of pruning sweeps on this machine: hydra.sweeper.storage=postgresql://"
                       f"{USER}:PASSWORD@127.0.0.1:{postgres.port}/{STUDIES} (PASSWORD in {postgres.password_file})")
        server = MlflowServer(with_driver(store_uri), artifacts, args.host, args.port)
        running.callback(server.stop)
        reach = f"http://{socket.gethostname()}:{args.port}" if args.host == "0.0.0.0" else server.uri
        print(f"\nMLflow server on {server.uri} (store: {store}; artifacts: {artifacts})\n"
              f"Log runs to it: python -m orchestrate tracking=server"
              f"{'' if reach == 'http://127.0.0.1:5000' else f' tracking.uri={reach}'}{studies}\n"
              "Ctrl-C stops it.", flush=True)
        code = server.proc.wait()
        raise errors.Failed(f"mlflow server exited with code {code}")
