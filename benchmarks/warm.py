"""Warm against cold: whole commands as a user types them, with and without `orchestrate up`
(orchestrate.stack), each against its one-process baseline measured in the same script.

    python benchmarks/warm.py                  # every case, best of 2
    python benchmarks/warm.py --repeats 3 --cases sweep runner

Cases (each command in a fresh folder; "cold" has no stack recorded, "warm" joins the stack that
this script starts once with `orchestrate up` in its own folder):
  floor    `python -c "import torch, torch._dynamo, sklearn.datasets, mlflow, hydra, ..."`: what any
           command pays before it does anything (the single run's baseline)
  single   `backend=torch trainer.max_steps=1`: one process, no Ray, no server (so the same warm)
  sweep    `+sweep=lr_grid backend=torch trainer.max_steps=100 ...`: 3 trials on the Ray launcher;
           also the first trial's start, as the sweep's summary prints it ("the first started
           X s after the sweep began")
  runner   `backend=runner trainer.num_workers=2 ...` 300 steps, and `trainer.num_workers=1` (in the
           driver's process), against `backend=torch` with the same steps (the one-process run)

Prints a markdown table: seconds (best of --repeats) and the ratio to the case's baseline.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR = "import torch, torch._dynamo, sklearn.datasets, mlflow, hydra, mlflow.store.tracking.sqlalchemy_store"
QUIET = ["trainer.progress=false", "trainer.evaluation_period=0", "trainer.checkpoint_period=0"]
SWEEP = ["+sweep=lr_grid", "backend=torch", "trainer.max_steps=100", *QUIET]
RUNNER_STEPS = ["trainer.max_steps=300", *QUIET]


def timed(argv: list[str], state: Path, root: Path) -> tuple[float, str]:
    folder = Path(tempfile.mkdtemp(dir=root))
    env = {**os.environ, "ORCHESTRATE_STATE_DIR": str(state)}
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def best(argv: list[str], state: Path, root: Path, repeats: int) -> tuple[float, list[str]]:
    runs = [timed(argv, state, root) for _ in range(repeats)]
    return min(s for s, _ in runs), [out for _, out in runs]


def first_start(outputs: list[str]) -> float:
    found = [float(m.group(1)) for out in outputs
             for m in [re.search(r"the first started ([0-9.]+) s after the sweep began", out)] if m]
    return min(found) if found else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=["floor", "single", "sweep", "runner"])
    args = parser.parse_args()
    py = [sys.executable, "-m", "orchestrate"]
    root = Path(tempfile.mkdtemp(prefix="warm-bench-"))
    cold, warm = root / "cold-state", root / "warm-state"
    cold.mkdir()
    rows = []  # (case, command, cold s, warm s, baseline s)
    stack_folder = root / "stack"
    stack_folder.mkdir()
    up = subprocess.run([*py, "up"], cwd=stack_folder, env={**os.environ, "ORCHESTRATE_STATE_DIR": str(warm)},
                        capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        raise SystemExit(f"orchestrate up failed:\n{up.stderr}")
    try:
        floor = best([sys.executable, "-c", FLOOR], cold, root, args.repeats)[0]
        if "floor" in args.cases:
            rows.append(("floor", "python -c 'import torch, mlflow, ...'", floor, floor, floor))
        if "single" in args.cases:
            c = best([*py, "backend=torch", "trainer.max_steps=1", "trainer.progress=false"], cold, root, args.repeats)[0]
            w = best([*py, "backend=torch", "trainer.max_steps=1", "trainer.progress=false"], warm, root, args.repeats)[0]
            rows.append(("single", "backend=torch trainer.max_steps=1", c, w, floor))
        if "sweep" in args.cases:
            c, c_out = best([*py, *SWEEP], cold, root, args.repeats)
            w, w_out = best([*py, *SWEEP], warm, root, args.repeats)
            rows.append(("sweep", "+sweep=lr_grid backend=torch trainer.max_steps=100 (3 trials)", c, w, float("nan")))
            rows.append(("sweep: first trial starts", "(after the sweep began, as its summary says)",
                         first_start(c_out), first_start(w_out), float("nan")))
        if "runner" in args.cases:
            one = best([*py, "backend=torch", *RUNNER_STEPS], cold, root, args.repeats)[0]
            rows.append(("one process", "backend=torch, 300 steps", one, one, one))
            for workers in (1, 2):
                argv = [*py, "backend=runner", "backend.engine=torch", f"trainer.num_workers={workers}", *RUNNER_STEPS]
                c = best(argv, cold, root, args.repeats)[0]
                w = best(argv, warm, root, args.repeats)[0]
                rows.append((f"runner, {workers} worker(s)", f"backend=runner trainer.num_workers={workers}, 300 steps",
                             c, w, one))
    finally:
        subprocess.run([*py, "down"], cwd=stack_folder, env={**os.environ, "ORCHESTRATE_STATE_DIR": str(warm)},
                       capture_output=True, timeout=300)
    print(f"\nwarm against cold, best of {args.repeats} (seconds, whole command; ratio: to the baseline column)\n")
    print("| case | command | cold s | warm s | baseline s | cold / baseline | warm / baseline |")
    print("|---|---|---|---|---|---|---|")
    for case, command, c, w, base in rows:
        ratio = (lambda x: f"{x / base:.2f}x") if base == base else (lambda x: "")  # noqa: B023
        print(f"| {case} | `{command}` | {c:.1f} | {w:.1f} | {'' if base != base else f'{base:.1f}'} | "
              f"{ratio(c)} | {ratio(w)} |")


if __name__ == "__main__":
    main()
