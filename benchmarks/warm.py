"""Warm against cold: whole commands as a user types them, with and without `orchestrate up`
(orchestrate.cluster.warm, its pool: orchestrate.cluster.pool), against the import floor and the
one-process run measured in the same script.

    python benchmarks/warm.py                  # every case, best of 3
    python benchmarks/warm.py --repeats 2 --cases single sweep

Cases ("cold": no stack recorded, each command in a fresh folder; "warm": the stack this script
starts once with `orchestrate up`, each command in its folder, whose store its MLflow server
fronts, as a user runs them after `orchestrate up` in a project):
  floor    `python -c "import torch, torch._dynamo, sklearn.datasets, mlflow, hydra, ..."`: what any
           cold command pays before it does anything
  single   `backend=torch trainer.max_steps=1`
  sweep    `+sweep=lr_grid backend=torch trainer.max_steps=100 ...`: 3 trials on the Ray launcher
           (each repeat its own experiment: a repeated sweep would skip its finished trials)
  runner   `backend=runner trainer.num_workers=2` 300 steps, against `backend=torch` with the same
           steps (the one-process run), each cold and warm

Prints a markdown table (seconds, best of --repeats; ratios to the floor and to the one-process run),
then the targets of issue 43 as ratios measured here.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR = "import torch, torch._dynamo, sklearn.datasets, mlflow, hydra, mlflow.store.tracking.sqlalchemy_store"
QUIET = ["trainer.progress=false", "trainer.evaluation_period=0", "trainer.checkpoint_period=0"]
SINGLE = ["backend=torch", "trainer.max_steps=1", "trainer.progress=false"]
SWEEP = ["+sweep=lr_grid", "backend=torch", "trainer.max_steps=100", *QUIET]
ONE_PROCESS = ["backend=torch", "trainer.max_steps=300", *QUIET]
RUNNER = ["backend=runner", "backend.engine=torch", "trainer.num_workers=2", "trainer.max_steps=300", *QUIET]
# (what, ratio of, to, at most)
TARGETS = [("warm 3-trial sweep / import floor", "sweep warm", "floor", 0.8),
           ("warm 1-step run / import floor", "single warm", "floor", 0.4),
           ("warm runner, 2 workers / its one-process run (warm)", "runner warm", "one process warm", 1.5),
           ("cold runner, 2 workers / its one-process run (cold)", "runner cold", "one process cold", 2.0)]


class Bench:
    def __init__(self, root: Path, repeats: int) -> None:
        self.root, self.repeats = root, repeats
        self.cold, self.warm, self.stack = root / "cold-state", root / "warm-state", root / "stack"
        for folder in (self.cold, self.warm, self.stack):
            folder.mkdir()
        self.seconds: dict[str, float] = {}
        self.runs = 0

    def timed(self, argv: list[str], warm: bool, in_stack: bool = False) -> float:
        """Seconds of one whole command (in a fresh folder, or the stack's)."""
        self.runs += 1
        folder = self.stack if in_stack else Path(tempfile.mkdtemp(dir=self.root))
        env = {**os.environ, "ORCHESTRATE_STATE_DIR": str(self.warm if warm else self.cold)}
        began = time.perf_counter()
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - began
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
        if warm and argv[1:3] == ["-m", "orchestrate"] and "in a fork of the warm pool" not in done.stdout:
            raise SystemExit(f"{' '.join(argv)} did not run on the warm pool:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return seconds

    def best(self, name: str, argv: list[str], warm: bool = False, in_stack: bool = False,
             own_experiment: bool = False) -> None:
        """Best of `repeats`; `own_experiment`: each its own tracking.experiment (a sweep run again in
        the same store would skip its finished trials)."""
        self.seconds[name] = min(
            self.timed([*argv, *([f"tracking.experiment=bench-{self.runs}"] if own_experiment else [])], warm, in_stack)
            for _ in range(self.repeats))
        print(f"{name}: {self.seconds[name]:.1f} s (best of {self.repeats})", file=sys.stderr, flush=True)

    def up(self) -> None:
        done = subprocess.run([sys.executable, "-m", "orchestrate", "up"], cwd=self.stack,
                              env={**os.environ, "ORCHESTRATE_STATE_DIR": str(self.warm)}, capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"orchestrate up failed:\n{done.stdout}{done.stderr}")

    def down(self) -> None:
        subprocess.run([sys.executable, "-m", "orchestrate", "down"], cwd=self.stack,
                       env={**os.environ, "ORCHESTRATE_STATE_DIR": str(self.warm)}, capture_output=True, timeout=300)


def measure(bench: Bench, cases: list[str]) -> None:
    py = [sys.executable, "-m", "orchestrate"]
    bench.best("floor", [sys.executable, "-c", FLOOR])
    if "single" in cases:
        bench.best("single cold", [*py, *SINGLE])
        bench.best("single warm", [*py, *SINGLE], warm=True)
    if "sweep" in cases:
        bench.best("sweep cold", [*py, *SWEEP])
        bench.best("sweep warm", [*py, *SWEEP], warm=True, in_stack=True, own_experiment=True)
    if "runner" in cases:
        for how in ("cold", "warm"):
            bench.best(f"one process {how}", [*py, *ONE_PROCESS], warm=how == "warm")
            bench.best(f"runner {how}", [*py, *RUNNER], warm=how == "warm")


def report(bench: Bench) -> None:
    s = bench.seconds
    floor = s["floor"]
    print(f"\nwarm against cold, best of {bench.repeats} (seconds, whole command)\n")
    print("| case | command | cold s | warm s | cold / floor | warm / floor |")
    print("|---|---|---:|---:|---:|---:|")
    rows = [("floor", "python -c 'import torch, mlflow, ...'", "floor", "floor"),
            ("single", " ".join(SINGLE), "single cold", "single warm"),
            ("sweep", "+sweep=lr_grid backend=torch trainer.max_steps=100 (3 trials)", "sweep cold", "sweep warm"),
            ("one process", "backend=torch, 300 steps", "one process cold", "one process warm"),
            ("runner", "backend=runner trainer.num_workers=2, 300 steps", "runner cold", "runner warm")]
    for case, shown, cold, warm in rows:
        if cold in s:
            print(f"| {case} | `{shown}` | {s[cold]:.1f} | {s[warm]:.1f} | {s[cold] / floor:.2f}x | "
                  f"{s[warm] / floor:.2f}x |")
    print("\n| target | measured | at most | |\n|---|---:|---:|---|")
    for what, of, to, most in TARGETS:
        if of in s and to in s:
            ratio = s[of] / s[to]
            print(f"| {what} | {ratio:.2f}x | {most:g}x | {'met' if ratio <= most else 'not met'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=["single", "sweep", "runner"])
    args = parser.parse_args()
    bench = Bench(Path(tempfile.mkdtemp(prefix="warm-bench-")), args.repeats)
    bench.up()
    try:
        measure(bench, args.cases)
    finally:
        bench.down()
    report(bench)


if __name__ == "__main__":
    main()
