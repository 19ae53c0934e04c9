"""What each start-up accelerator pays: whole commands as a user types them, under each mechanism
alone and all together, against the import floor and the one-process run measured in the same
script.

    python benchmarks/warm.py                  # every case, best of 3
    python benchmarks/warm.py --repeats 2 --cases single sweep

The mechanisms (each a column):
  cold, nothing     no stack recorded, ORCHESTRATE_EARLY_START=0: every command starts what it needs,
                    in order
  early start       cold, with Ray and a sweep's MLflow server begun while the command line checks
                    the config (orchestrate.sweeps.early, Backend.start_early)
  stack             `orchestrate up --workers 0`: the warm Ray head and MLflow server, no pool
                    (ORCHESTRATE_EARLY_START=0)
  stack + pool      `orchestrate up`: the head, the server and the warm pool (every command and Ray
                    worker a fork of a pre-imported process), ORCHESTRATE_EARLY_START=0
  all               the same with early start: what a user gets after `orchestrate up`
Each warm command runs in the stack's folder, whose store its MLflow server fronts (as a user
runs them after `orchestrate up` in a project); each cold one in a fresh folder.

Cases (each a row):
  floor    `python -c "import torch, torch._dynamo, sklearn.datasets, mlflow, hydra, ..."`: what any
           cold command pays before it does anything
  single   `backend=torch trainer.max_steps=1`
  sweep    `+sweep=lr_grid backend=torch trainer.max_steps=100 ...`: 3 trials on the Ray launcher
           (each repeat its own experiment: a repeated sweep would skip its finished trials)
  runner   `backend=runner trainer.num_workers=2` 300 steps, against `backend=torch` with the same
           steps (the one-process run)

Prints a markdown table (seconds, best of --repeats; ratios to the floor), then the targets of
issues 43 and 54 as ratios measured here.
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
TARGETS = [("warm 3-trial sweep / import floor", "sweep all", "floor", 0.7),
           ("warm 1-step run / import floor", "single all", "floor", 0.3),
           ("warm runner, 2 workers / its one-process run (warm)", "runner all", "one process all", 1.5),
           ("cold runner, 2 workers / its one-process run (cold)", "runner early start", "one process early start", 2.0)]
# column -> (state folder, ORCHESTRATE_EARLY_START, whether it runs in the stack's folder)
MECHANISMS = {"cold, nothing": ("cold", "0", False), "early start": ("cold", "1", False),
              "stack": ("stack", "0", True), "stack + pool": ("pool", "0", True), "all": ("pool", "1", True)}


class Bench:
    def __init__(self, root: Path, repeats: int) -> None:
        self.root, self.repeats = root, repeats
        self.states = {name: root / f"{name}-state" for name in ("cold", "stack", "pool")}
        self.folders = {name: root / f"{name}-folder" for name in ("stack", "pool")}
        for folder in [*self.states.values(), *self.folders.values()]:
            folder.mkdir()
        self.seconds: dict[str, float] = {}
        self.runs = 0

    def timed(self, argv: list[str], mechanism: str) -> float:
        """Seconds of one whole command under `mechanism` (MECHANISMS)."""
        state, early, in_stack = MECHANISMS[mechanism]
        self.runs += 1
        folder = self.folders[state] if in_stack else Path(tempfile.mkdtemp(dir=self.root))
        env = {**os.environ, "ORCHESTRATE_STATE_DIR": str(self.states[state]), "ORCHESTRATE_EARLY_START": early}
        began = time.perf_counter()
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - began
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
        forked = "in a fork of the warm pool" in done.stdout
        if argv[1:3] == ["-m", "orchestrate"] and forked != (state == "pool"):
            raise SystemExit(f"{' '.join(argv)} ran {'' if forked else 'not '}on the warm pool under {mechanism}:\n"
                             f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return seconds

    def best(self, name: str, argv: list[str], mechanism: str = "cold, nothing", own_experiment: bool = False) -> None:
        """Best of `repeats`; `own_experiment`: each its own tracking.experiment (a sweep run again in
        the same store would skip its finished trials)."""
        key = f"{name} {mechanism}" if name != "floor" else name
        self.seconds[key] = min(
            self.timed([*argv, *([f"tracking.experiment=bench-{self.runs}"] if own_experiment else [])], mechanism)
            for _ in range(self.repeats))
        print(f"{key}: {self.seconds[key]:.1f} s (best of {self.repeats})", file=sys.stderr, flush=True)

    def orchestrate(self, state: str, *words: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrate", *words], cwd=self.folders[state],
                              env={**os.environ, "ORCHESTRATE_STATE_DIR": str(self.states[state])}, capture_output=True,
                              text=True, timeout=600)

    def up(self) -> None:
        for state, words in (("stack", ["--workers", "0"]), ("pool", [])):
            done = self.orchestrate(state, "up", *words)
            if done.returncode != 0:
                raise SystemExit(f"orchestrate up failed:\n{done.stdout}{done.stderr}")

    def down(self) -> None:
        for state in ("stack", "pool"):
            self.orchestrate(state, "down")


def measure(bench: Bench, cases: list[str]) -> None:
    py = [sys.executable, "-m", "orchestrate"]
    bench.best("floor", [sys.executable, "-c", FLOOR])
    for mechanism in MECHANISMS:  # one mechanism at a time, every case under it
        if "single" in cases:
            bench.best("single", [*py, *SINGLE], mechanism)
        if "sweep" in cases:
            bench.best("sweep", [*py, *SWEEP], mechanism, own_experiment=True)
        if "runner" in cases:
            bench.best("one process", [*py, *ONE_PROCESS], mechanism)
            bench.best("runner", [*py, *RUNNER], mechanism)


def report(bench: Bench) -> None:
    s = bench.seconds
    floor = s["floor"]
    print(f"\nStart-up mechanisms alone and together, best of {bench.repeats} (seconds, whole command; "
          f"x: to the import floor, {floor:.1f} s)\n")
    print("| case | command | " + " | ".join(MECHANISMS) + " |")
    print("|---|---|" + "---:|" * len(MECHANISMS))
    rows = [("single", " ".join(SINGLE)),
            ("sweep", "+sweep=lr_grid backend=torch trainer.max_steps=100 (3 trials)"),
            ("one process", "backend=torch, 300 steps"),
            ("runner", "backend=runner trainer.num_workers=2, 300 steps")]
    for case, shown in rows:
        cells = [f"{s[f'{case} {m}']:.1f} ({s[f'{case} {m}'] / floor:.2f}x)" if f"{case} {m}" in s else "" for m in MECHANISMS]
        if any(cells):
            print(f"| {case} | `{shown}` | " + " | ".join(cells) + " |")
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
