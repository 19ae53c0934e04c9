"""What a sweep costs beyond its trials, on the default Ray launcher:

  first    time from the command to the first trial's first step, and when each phase was done
  compose  composing and checking every trial up front, for 10, 100 and 300 trials
  pack     an 8-trial sweep on the machine's cores against the ideal (8 x one trial alone / 2)
  prune    a 16-trial search (learning rate x model width) on the character language model, run to
           the end and with each of Optuna's pruners (hydra/sweeper=orchestrate_optuna): the best
           eval loss, trial-steps and wall time of each against the unpruned sweep; every trial's
           eval curve with its pruning point in docs/pruning.png

    python benchmarks/sweeps.py                                  # first, compose, pack
    python benchmarks/sweeps.py --parts prune                    # ~15 minutes on 2 cores
    python benchmarks/sweeps.py --parts first --steps 100
    python benchmarks/sweeps.py --parts compose --trials 10 100

Sweeps run as users run them (`python -m orchestrate ...` in a fresh folder, a SQLite store, so
that the sweep starts its own MLflow server), torch backend, eval and checkpoints off.

The first step is read from MLflow: the trial logs train/loss at step 1 (trainer.display_loss_steps=1)
with the time it was logged. The sweep's MLflow server, Ray and its workers' warm-up start with the
command, beside the up-front check (orchestrate.sweeps.early); when each was ready comes from
the sweep's own log lines ("MLflow server ... (waited X s for it)", "Ray ready (waited Y s for it)"), the
trial's child run (created by the sweep callback in the Ray worker, just before the app starts)
and, measured in this process, `cli.validate_sweep` (the up-front check of every trial). Prints
markdown tables; writes docs/sweeps.png.
"""

import argparse
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PYTHON = sys.executable
COMMON = ["backend=torch", "trainer.evaluation_period=0", "trainer.checkpoint_period=0", "trainer.progress=false"]


def run_sweep(args: list[str], folder: Path) -> tuple[float, list[tuple[float, str]], float]:
    """Run `python -m orchestrate ARGS` in `folder`; (epoch start, [(seconds since start, line)], wall s)."""
    began = time.time()
    proc = subprocess.Popen([PYTHON, "-m", "orchestrate", *args], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.time() - began, line.rstrip()))

    reader = threading.Thread(target=read)
    reader.start()
    rc = proc.wait()
    reader.join()
    wall = time.time() - began
    if rc != 0:
        raise SystemExit(f"sweep failed (exit {rc}):\n" + "\n".join(line for _, line in lines[-30:]))
    return began, lines, wall


def seconds_in(lines, pattern: str) -> tuple[float, float] | None:
    """(when the line appeared, the seconds it states) for the first line matching `pattern`."""
    for at, line in lines:
        m = re.search(pattern, line)
        if m:
            return at, float(m.group(1))
    return None


def first_step(folder: Path, began: float) -> dict[str, float]:
    """From the store: the earliest trial's child-run start and its step-1 train/loss, in seconds
    after `began`."""
    with sqlite3.connect(folder / "mlflow.db") as db:
        rows = db.execute(
            "SELECT r.start_time, MIN(m.timestamp) FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "AND t.key = 'orchestrate.role' AND t.value = 'trial' "
            "JOIN metrics m ON m.run_uuid = r.run_uuid AND m.key = 'train/loss' AND m.step = 1 "
            "GROUP BY r.run_uuid ORDER BY MIN(m.timestamp) LIMIT 1").fetchall()
    start_ms, step_ms = rows[0]
    return {"trial_run_created": start_ms / 1000 - began, "first_step": step_ms / 1000 - began}


def validate_seconds(values: list[str]) -> float:
    """In this process: `cli.validate_sweep` for a sweep over `values` of optimizer.lr."""
    from orchestrate import cli
    from orchestrate.config import ORCHESTRATE

    began = time.perf_counter()
    cli.validate_sweep(["-m"], [f"optimizer.lr={','.join(values)}", *COMMON], ORCHESTRATE)
    return time.perf_counter() - began


def part_first(steps: int) -> list[tuple[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        began, lines, wall = run_sweep(["+sweep=lr_grid", f"trainer.max_steps={steps}", "trainer.display_loss_steps=1",
                                        *COMMON], folder)
        first = first_step(folder, began)
    # The server, Ray (with its workers' warm-up) and the up-front check run side by side
    # (orchestrate.sweeps.early): each line below is when that phase was done, from the command.
    server = seconds_in(lines, r"MLflow server for the sweep on \S+ \(waited ([\d.]+) s for it\)")
    ray = seconds_in(lines, r"Ray ready \(waited ([\d.]+) s for it\)")
    checks = validate_seconds(["1e-3", "3e-3", "1e-2"])  # the same sweep's up-front check, here
    split = [
        ("`validate_sweep` alone (measured in-process, first call: its imports included)", checks),
        ("the sweep's MLflow server answers, the parent run opens (started at the command's start)", server[0]),
        ("  of which the parent run waited for the server", server[1]),
        ("Ray up and its workers warm (started at the command's start); the launcher submits", ray[0]),
        ("  of which the launcher waited for them", ray[1]),
        ("the first trial's child run opens in its Ray worker", first["trial_run_created"]),
        ("the trial's own start-up (app: build, MLflow run) to step 1", first["first_step"] - first["trial_run_created"]),
        ("**command to first step**", first["first_step"]),
        ("**whole sweep (3 trials, wall)**", wall),
    ]
    print(f"\n### Command to the first trial's first step ({steps}-step trials, lr_grid, 3 trials)\n")
    print("| phase (seconds from the command unless said) | seconds |\n|---|---:|")
    for name, s in split:
        print(f"| {name} | {s:.1f} |")
    return split


def part_compose(counts: list[int]) -> list[tuple[int, float, float]]:
    rows = []
    validate_seconds(["1e-3"])  # imports and Hydra's first composition, out of the first row
    for n in counts:
        values = [f"{1e-4 * (1 + i):.6g}" for i in range(n)]
        inproc = validate_seconds(values)
        with tempfile.TemporaryDirectory() as tmp:
            # The whole command with Hydra's launcher in dry-run mode: the up-front check, then the
            # sweeper's and launcher's composition of every job; nothing runs.
            _, _, wall = run_sweep([f"optimizer.lr={','.join(values)}", "-m", "hydra.launcher.dry_run=true", *COMMON],
                                   Path(tmp))
        rows.append((n, inproc, wall))
        print(f"# {n} trials: validate_sweep {inproc:.2f} s, dry-run command {wall:.2f} s", file=sys.stderr, flush=True)
    print("\n### Composition of N trials\n")
    print("| trials | `validate_sweep` s (in-process) | per trial ms | dry-run command s (whole process) | per trial ms |")
    print("|---:|---:|---:|---:|---:|")
    for n, a, b in rows:
        print(f"| {n} | {a:.2f} | {1000 * a / n:.0f} | {b:.2f} | {1000 * b / n:.0f} |")
    return rows


def summary_times(lines) -> tuple[float, float, float]:
    """(wall s, summed trial s, first start s) from the sweep summary's timing line."""
    for _, line in lines:
        m = re.search(r"(\d+) trial\(s\) ran in ([\d.]+) s of wall time, ([\d.]+) s summed over trials; "
                      r"the first started ([\d.]+) s", line)
        if m:
            return float(m.group(2)), float(m.group(3)), float(m.group(4))
    raise SystemExit("no timing line in the sweep summary")


def part_pack(steps: int, trials: int = 8) -> dict[str, float]:
    cores = os.cpu_count()
    args = [f"trainer.max_steps={steps}", "trainer.display_loss_steps=100", "backend.intra_op_threads=1",
            "hydra.launcher.cpus_per_trial=1", *COMMON]
    with tempfile.TemporaryDirectory() as tmp:
        _, alone_lines, _ = run_sweep(["-m", "optimizer.lr=1e-3", *args], Path(tmp))
    _, alone, _ = summary_times(alone_lines)
    values = ",".join(f"{1e-3 * (1 + i):g}" for i in range(trials))
    with tempfile.TemporaryDirectory() as tmp:
        _, lines, command_wall = run_sweep(["-m", f"optimizer.lr={values}", *args], Path(tmp))
    wall, summed, first = summary_times(lines)
    ideal = trials * alone / cores
    out = {"one trial alone s": alone, "ideal s (trials x alone / cores)": ideal,
           "sweep wall s (parent run open to close)": wall, "of which before the first trial started s": first,
           "trials' wall from first start s": wall - first, "summed trial time s": summed,
           "packing ideal s (summed / cores)": summed / cores, "command wall s": command_wall,
           "wall / ideal": wall / ideal, "(wall - start-up) / ideal": (wall - first) / ideal,
           "**command wall / ideal**": command_wall / ideal}
    print(f"\n### Packing: {trials} trials of {steps} steps, 1 CPU each, on {cores} cores\n")
    print("| figure | value |\n|---|---:|")
    for k, v in out.items():
        print(f"| {k} | {v:.2f} |")
    return out


PRUNERS = ["none", "median", "successive_halving", "hyperband"]
# The same 16 grid points in the same seeded order for every pruner (GridSampler, seed 0).
SEARCH = ["optimizer.lr=choice(0.0003,0.001,0.003,0.01)", "model.n_embd=choice(32,64,96,128)", "trainer.batch_size=16"]


def part_prune(steps: int, png: Path, pruners: list[str] = PRUNERS, every: int = 50) -> list[dict]:
    """Each pruner's sweep (the first, `none`, is the baseline the others are compared with); a
    pruner's settings can follow its name: `successive_halving:reduction_factor=3`."""
    from mlflow.tracking import MlflowClient

    rows, curves = [], {}
    for pruner in pruners:
        name, *settings = pruner.split(":")
        args = ["+experiment=char_lm", "+sweep=lr_optuna", "backend=torch", f"trainer.max_steps={steps}",
                f"trainer.evaluation_period={every}", "trainer.checkpoint_period=0", "trainer.progress=false",
                "hydra/sweeper/sampler=grid", "hydra.sweeper.sampler.seed=0", f"hydra/sweeper/pruner={name}",
                *(f"hydra.sweeper.pruner.{s}" for s in settings), "hydra.sweeper.n_trials=16", *SEARCH]
        with tempfile.TemporaryDirectory() as tmp:
            _, lines, wall = run_sweep(args, Path(tmp))
            client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
            (experiment,) = [e for e in client.search_experiments() if e.name == "char_lm"]
            trials = [r for r in client.search_runs([experiment.experiment_id], max_results=100)
                      if "mlflow.parentRunId" in r.data.tags]
            curves[pruner] = []
            for r in trials:
                history = sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, "eval/loss"))
                curves[pruner].append((r.data.params["optimizer.lr"], r.data.params["model.n_embd"], history,
                                       r.data.tags.get("pruned")))
        best = min(v for *_, history, _ in curves[pruner] for _, v in history)
        trial_steps = sum(int(pruned or steps) for *_, pruned in curves[pruner])
        rows.append({"pruner": pruner, "trials": len(trials), "pruned": sum(bool(p) for *_, p in curves[pruner]),
                     "best eval loss": best, "trial-steps": trial_steps, "wall s": wall})
        print(f"{pruner}: best {best:.4f}, {trial_steps} trial-steps, {wall:.0f} s", flush=True)
    base = rows[0]
    print(f"\n### Pruning: 16 trials (lr x width) of {steps} steps, evaluated every {every}, char_transformer on "
          f"python_source, torch, {os.cpu_count()} cores\n")
    print("| pruner | pruned | best eval loss | vs unpruned best | trial-steps | of unpruned | wall s | of unpruned |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['pruner']} | {r['pruned']} of {r['trials']} | {r['best eval loss']:.4f} | "
              f"{100 * (r['best eval loss'] / base['best eval loss'] - 1):+.2f}% | {r['trial-steps']:,} | "
              f"{100 * r['trial-steps'] / base['trial-steps']:.0f}% | {r['wall s']:.0f} | "
              f"{100 * r['wall s'] / base['wall s']:.0f}% |")
    plot_pruning(curves, steps, png)
    # Every trial's eval curve, to try other pruner settings on the same curves without rerunning.
    png.with_suffix(".json").write_text(json.dumps({"steps": steps, "rows": rows, "curves": curves}, indent=1))
    return rows


def plot_pruning(curves: dict, steps: int, png: Path) -> None:
    """One panel per pruner: every trial's eval loss curve, an x where the pruner stopped it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.6), sharey=True, squeeze=False)
    for ax, (pruner, trials) in zip(axes[0], curves.items()):
        for _lr, _width, history, pruned in trials:
            if not history:
                continue
            x, y = zip(*history)
            line, = ax.plot(x, y, lw=1, alpha=0.8)
            if pruned:
                ax.plot(x[-1], y[-1], "x", color=line.get_color(), ms=7)
        ax.set_title(f"pruner: {pruner}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_xlim(0, steps)
    axes[0][0].set_ylabel("eval loss")
    fig.suptitle("16 trials (lr x width), char LM: eval loss; x = pruned there", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"\nwrote {png}")


def plot(first, compose, pack, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (first, compose, pack) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    axes = list(axes[0])
    if first:
        ax = axes.pop(0)
        # Milestones from the command (the phases overlap: each bar runs from 0 to when it was done).
        done = [(n.strip("*"), s) for n, s in first if not n.startswith(("  ", "`", "the trial's own"))]
        ax.barh(range(len(done)), [s for _, s in done])
        ax.set_yticks(range(len(done)), [n[:40] for n, _ in done], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("seconds from the command")
        ax.set_title("command to first step", fontsize=10)
    if compose:
        ax = axes.pop(0)
        ns = [r[0] for r in compose]
        ax.plot(ns, [r[1] for r in compose], "o-", label="validate_sweep (in-process)")
        ax.plot(ns, [r[2] for r in compose], "s-", label="dry-run command")
        ax.set_xlabel("trials")
        ax.set_ylabel("seconds")
        ax.set_title("composition", fontsize=10)
        ax.legend(fontsize=7)
    if pack:
        ax = axes.pop(0)
        names = ["ideal", "sweep wall", "wall - start-up"]
        vals = [pack["ideal s (trials x alone / cores)"], pack["sweep wall s (parent run open to close)"],
                pack["trials' wall from first start s"]]
        ax.bar(names, vals)
        ax.set_ylabel("seconds")
        ax.set_title("8 trials on 2 cores", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"\nwrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["first", "compose", "pack"],
                        choices=["first", "compose", "pack", "prune"])
    parser.add_argument("--steps", type=int, default=300, help="steps per trial (first, pack)")
    parser.add_argument("--trials", type=int, nargs="+", default=[10, 100, 300], help="sweep sizes for compose")
    parser.add_argument("--png", default=str(Path(__file__).resolve().parents[1] / "docs" / "sweeps.png"))
    parser.add_argument("--prune-steps", type=int, default=300, help="steps per trial (prune)")
    parser.add_argument("--eval-every", type=int, default=50, help="prune: trainer.evaluation_period (the pruners' steps)")
    parser.add_argument("--pruners", nargs="+", default=PRUNERS,
                        help="prune: the pruners to compare, the first the baseline (e.g. none median:n_startup_trials=2)")
    parser.add_argument("--prune-png", default=str(Path(__file__).resolve().parents[1] / "docs" / "pruning.png"))
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores; timings from one run on a shared machine")
    first = part_first(args.steps) if "first" in args.parts else None
    compose = part_compose(args.trials) if "compose" in args.parts else None
    pack = part_pack(args.steps) if "pack" in args.parts else None
    if first or compose or pack:
        plot(first, compose, pack, Path(args.png))
    if "prune" in args.parts:
        part_prune(args.prune_steps, Path(args.prune_png), args.pruners, args.eval_every)


if __name__ == "__main__":
    main()
