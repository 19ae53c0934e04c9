"""Many trials writing at once: is every metric step of every trial in MLflow exactly once?

    python scripts/concurrency.py --trials 16

Two stores, each with `--trials` trials of a torch sweep on the Ray launcher, all running at once
(each trial in its own Ray worker process, `hydra.launcher.cpus_per_trial` = 2 / trials):

  default store   no tracking settings: the sweep's own MLflow server in front of one SQLite file
  postgresql      `tracking=server` against `orchestrate server` (MLflow on its own PostgreSQL,
                  artifacts served), started here in a temporary folder on 127.0.0.1

Each trial logs `train/loss` and `perf/samples_per_sec` at every step and `eval/loss` every
`--eval-every` steps. MLflow is then read back through MlflowClient: each run FINISHED, each
trial in its own process, and each metric's steps exactly the expected ones (a lost step or a
duplicated one shows in the counts). The table goes to stdout and docs/concurrency.md.

The tests run the same check with fewer trials (tests/sweeps/test_sweeps.py, tests/commands/test_server.py).
Needs PostgreSQL's programs (initdb, postgres), as `orchestrate server` does.
"""

import argparse
import collections
import datetime
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrate.cluster.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVER_START_TIMEOUT_S = 240
SWEEP_TIMEOUT_S = 1800
METRICS = ("train/loss", "perf/samples_per_sec", "eval/loss")


def sweep_command(trials: int, steps: int, eval_every: int, *tracking: str) -> list[str]:
    lrs = ",".join(f"{0.001 * (i + 1):.3f}" for i in range(trials))
    return [sys.executable, "-m", "orchestrate", "-m", "backend=torch", f"optimizer.lr={lrs}", "data=synthetic",
            "trainer=quick", f"trainer.max_steps={steps}", "model.hidden=[32]", "trainer.display_loss_steps=1",
            f"trainer.evaluation_period={eval_every}", "trainer.progress=false", "hydra.launcher.num_cpus=2",
            f"hydra.launcher.cpus_per_trial={2 / trials}", *tracking]


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    """`orchestrate server` on a free port, waited for until it says it serves (or SystemExit)."""
    port = free_port()
    output = folder / "server.out"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrate", "server", "--data-dir", str(folder / "server"),
                             "--port", str(port)], cwd=folder, stdout=output.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while "Ctrl-C stops it." not in output.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"orchestrate server did not start within {SERVER_START_TIMEOUT_S} s:\n"
                             f"{output.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def check(client: MlflowClient, trials: int, steps: int, eval_every: int) -> dict:
    """What MLflow holds for the sweep's trials, counted against what they should have logged."""
    (experiment,) = [e for e in client.search_experiments() if e.name == "orchestrate"]
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    expected = {"train/loss": list(range(1, steps + 1)), "perf/samples_per_sec": list(range(1, steps + 1)),
                "eval/loss": list(range(eval_every, steps + 1, eval_every)) if eval_every else []}
    counts = {"trials": len(children), "finished": sum(r.info.status == "FINISHED" for r in children),
              "processes": len({r.data.tags.get("pid") for r in children}), "expected": 0, "logged": 0, "lost": 0,
              "duplicated": 0}
    for run in children:
        for key in METRICS:
            logged = collections.Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            counts["expected"] += len(expected[key])
            counts["logged"] += sum(logged.values())
            counts["lost"] += sum(1 for s in expected[key] if s not in logged)
            counts["duplicated"] += sum(n - 1 for n in logged.values() if n > 1)
    counts["ok"] = (counts["trials"] == counts["finished"] == counts["processes"] == trials
                    and counts["lost"] == counts["duplicated"] == 0 and counts["logged"] == counts["expected"])
    return counts


def run_case(name: str, folder: Path, trials: int, steps: int, eval_every: int) -> dict:
    folder.mkdir(parents=True)
    server = None
    try:
        if name == "postgresql":
            server, uri = start_server(folder)
            tracking = ["tracking=server", f"tracking.uri={uri}"]
        else:
            uri, tracking = f"sqlite:///{folder}/mlflow.db", []
        print(f"{name}: {trials} trials at once ...", flush=True)
        began = time.monotonic()
        done = subprocess.run(sweep_command(trials, steps, eval_every, *tracking), cwd=folder, capture_output=True,
                              text=True, timeout=SWEEP_TIMEOUT_S, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        took = time.monotonic() - began
        if done.returncode != 0:
            raise SystemExit(f"{name}: the sweep exited {done.returncode}:\n{done.stderr[-3000:]}")
        return {"store": name, "seconds": took, **check(MlflowClient(uri), trials, steps, eval_every)}
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)


def table(results: list[dict], trials: int, steps: int, eval_every: int) -> str:
    lines = [f"{trials} trials at once, {steps} steps each; `train/loss` and `perf/samples_per_sec` every step, "
             f"`eval/loss` every {eval_every}.", "",
             "| store | trials FINISHED | worker processes | points expected | points logged | lost | duplicated "
             "| sweep s | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['store']} | {r['finished']}/{r['trials']} | {r['processes']} | {r['expected']} | "
                     f"{r['logged']} | {r['lost']} | {r['duplicated']} | {r['seconds']:.0f} | "
                     f"{'every step exactly once' if r['ok'] else 'FAILED'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--stores", nargs="+", default=["default store", "postgresql"],
                   choices=["default store", "postgresql"])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "concurrency.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="concurrency-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)  # PostgreSQL runs as its own user where this runs as root
        results = [run_case(store, Path(tmp) / store.replace(" ", "_"), args.trials, args.steps, args.eval_every)
                   for store in args.stores]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    header = (f"# Concurrency: many writers at once\n\n`python scripts/concurrency.py --trials {args.trials}` on "
              f"{platform.node()} ({os.cpu_count()} CPUs), {datetime.date.today()}, commit "
              f"{commit.stdout.strip() or 'unknown'}.\n\n")
    text = header + table(results, args.trials, args.steps, args.eval_every) + "\n"
    print(text)
    args.out.write_text(text)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
