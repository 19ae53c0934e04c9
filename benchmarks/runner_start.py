"""From the command to the first step, and the whole run, as a user runs it: one process
(backend=torch, backend=ortmodule) against the runner with two workers (its torch and ortmodule
engines), 300 steps of the default experiment (digits MLP), each in a fresh folder with its own
SQLite store. The first step is the step-1 train/loss point in MLflow, logged with its time.

    python benchmarks/runner_start.py

Prints a markdown table: seconds from the command to the first step, and wall seconds."""

import subprocess
import sys
import tempfile
import time

from mlflow.tracking import MlflowClient


def run(args: list[str]) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        began = time.time()
        done = subprocess.run([sys.executable, "-m", "orchestrate", *args, "trainer.max_steps=300",
                               "trainer.display_loss_steps=1", "trainer.progress=false", "trainer.checkpoint_period=0"],
                              cwd=tmp, capture_output=True, text=True)
        wall = time.time() - began
        assert done.returncode == 0, done.stderr[-2000:]
        client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
        (r,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
        first = min(m.timestamp for m in client.get_metric_history(r.info.run_id, "train/loss") if m.step == 1) / 1000
        return first - began, wall


RUNS = [
    ("torch, one process", ["backend=torch"]),
    ("runner, 2 workers (torch engine)", ["backend=runner", "trainer.num_workers=2", "backend.engine=torch"]),
    ("ortmodule, one process", ["backend=ortmodule"]),
    ("runner, 2 workers (ortmodule engine)", ["backend=runner", "trainer.num_workers=2"]),
]


def main() -> None:
    print("| run | command to first step s | wall s |\n|---|---:|---:|")
    for name, args in RUNS:
        first, wall = run(args)
        print(f"| {name} | {first:.1f} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
