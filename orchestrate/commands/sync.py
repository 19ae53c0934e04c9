"""`orchestrate sync RUN_FOLDER...`: send what a run could not, into the same MLflow run, once.

A run whose MLflow server was away at its end wrote what it kept (metrics with the step and time
they were logged at, tags, files to upload) to `mlflow_unsent.jsonl` in its output folder
(orchestrate.tracking.outbox). Once the server answers again:

    orchestrate sync outputs/2026-11-27/10-00-00-000000            # the run folder(s)
    orchestrate sync --tracking-uri http://127.0.0.1:5000 RUN_FOLDER

The store is `--tracking-uri`, else MLFLOW_TRACKING_URI, else the `tracking.uri` of the folder's
own config (`.hydra/config.yaml`, when it is not hidden there). Everything sent, the file becomes
`mlflow_unsent.jsonl.sent`: a second sync sends nothing. A sync cut short sends it all again next
time, which stores nothing twice: a metric point is the same row (key, value, step and time), a tag
the same value, an upload the same file. The trained model goes in as the LoggedModel the run would
have logged (registered as it would have been), and the run then ends with the status it reached
(FINISHED, FAILED, KILLED) when the server did not take that either. `trainer.resume=auto` does the same for the run it
continues before training on. Exit code 0 when every folder was sent (or had nothing to send), 1
when the server did not take it all, 2 for bad arguments.
"""

import argparse
import logging
import os
import threading
from pathlib import Path

from orchestrate import errors
from orchestrate.boundary import TOOL, Where, boundary
from orchestrate.tracking.outbox import SENT_SUFFIX, UNSENT_FILE, ThreadFilter, cause, read_unsent, send_unsent
from orchestrate.tracking.redact import HIDDEN, redact_text


def folder_uri(folder: Path) -> str | None:
    """The tracking URI of the run folder's own config, unless a password in it was hidden."""
    config = folder / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    from omegaconf import OmegaConf

    uri = OmegaConf.select(OmegaConf.load(config), "tracking.uri", default=None)
    return uri if isinstance(uri, str) and HIDDEN not in uri and "${" not in uri else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate sync", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, metavar="RUN_FOLDER")
    parser.add_argument("--tracking-uri", help="the MLflow store the runs log to (default: MLFLOW_TRACKING_URI, "
                                               "else the tracking.uri in the folder's .hydra/config.yaml)")
    args = parser.parse_args(argv)
    with boundary(Where(TOOL)):
        return sync(args.folders, args.tracking_uri)


def sync(folders: list[Path], tracking_uri: str | None) -> int:
    """Send each folder's kept items (0); errors.Refused for a folder it cannot place, before
    anything is sent from it; errors.Failed naming those the server did not take (kept for next
    time), once every folder was tried."""
    from mlflow.tracking import MlflowClient

    from orchestrate.tracking.settings import quick_http, set_env

    not_taken = []
    env_before = quick_http()  # a server still away answers within seconds, not minutes
    # urllib3 says "Retrying ..." for each failed try: a server still away gets this command's one line.
    quiet = ThreadFilter(threading.current_thread())
    logging.getLogger("urllib3.connectionpool").addFilter(quiet)
    try:
        for folder in folders:
            path = folder / UNSENT_FILE
            if not folder.is_dir():
                raise errors.Refused(f"{folder}: no such folder")
            if not path.is_file():
                done = path.with_name(path.name + SENT_SUFFIX).is_file()
                print(f"{folder}: nothing to send" + (" (sent already)" if done else ""), flush=True)
                continue
            uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or folder_uri(folder)
            if not uri:
                raise errors.Refused(f"{folder}: which MLflow store? Give --tracking-uri (or set MLFLOW_TRACKING_URI)")
            try:
                items = read_unsent(path)  # before any store is opened: a SQLite one would be created
            except ValueError as e:  # read_unsent names the line
                raise errors.Refused(str(e)) from None
            try:
                sent = send_unsent(MlflowClient(tracking_uri=uri), path, items)
            except Exception as e:  # noqa: BLE001 - one line per folder, the file stays for next time
                not_taken.append(f"{folder}: MLflow at {redact_text(uri)} did not take it ({cause(e)}); {path} is kept")
                continue
            print(f"{folder}: sent {sent} item(s) to {redact_text(uri)}", flush=True)
    finally:
        logging.getLogger("urllib3.connectionpool").removeFilter(quiet)
        set_env(env_before)
    if not_taken:
        raise errors.Failed("; ".join(not_taken) + ": run this again later")
    return 0
