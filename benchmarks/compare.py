"""How sure is a comparison, how good is backend=auto's pick, and what does pruning a
two-objective sweep cost: the figures of docs/compare.md, as a user gets them from the command line.

    python benchmarks/compare.py                          # everything (about 35 minutes on 2 cores)
    python benchmarks/compare.py --tasks mlp --no-sweeps  # one task's comparison and auto's picks

1. Each task (the digits MLP, the digits CNN, the character transformer), compared as
   `python -m orchestrate -m +sweep=compare compare.repeats=5 ...` runs it: the four single-process
   backends, 5 repeats each, interleaved, one at a time with both cores
   (hydra.launcher.cpus_per_trial=2). The intervals and verdicts at R = 3 (the first three repeats
   of the same runs) and R = 5, computed as the sweep's summary computes them.
2. `backend=auto` on the same task and steps, --auto-runs times, each a fresh command: which backend
   it picked, and whether the comparison's samples/s intervals put that backend behind another.
3. A 24-trial two-objective sweep (eval loss, seconds) over backend x learning rate on the MLP,
   without pruning and with hydra/sweeper/pruner=dominated: each front's hypervolume (against one
   reference point, the worst of both sweeps' finished trials on each objective, 10% further out)
   and the compute each spent (trial-steps, and the summed seconds of its trials' runs).

Every sweep runs in a folder of its own under a temporary directory (removed at the end); the
comparison's chart of each task is kept as docs/compare_<task>.png and both fronts as
docs/compare_pareto.png. The tables go between the markers of docs/compare.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrate.sweeps import compare, pareto
from orchestrate.sweeps._runs import read_repeat

DOCS = Path(__file__).resolve().parent.parent / "docs"
TASKS = {
    "mlp": ["model=mlp", "data=digits", "trainer.max_steps=3000", "trainer.evaluation_period=500"],
    "cnn": ["model=cnn", "data=digits", "trainer.max_steps=1000", "trainer.evaluation_period=200"],
    "char_transformer": ["model=char_transformer", "data=python_source", "trainer.batch_size=16",
                         "trainer.max_steps=200", "trainer.evaluation_period=50"],
}
COMMON = ["trainer.progress=false", "tracking.log_checkpoints=false", "trainer.checkpoint_period=0"]
BACKENDS = "torch,compile,ortmodule,ondevice"
BEGIN, END = "<!-- benchmarks/compare.py: begin -->", "<!-- benchmarks/compare.py: end -->"


def orchestrate(args: list[str], folder: Path) -> str:
    """`python -m orchestrate ARGS` in `folder`, as a user runs it; its output (raises on failure)."""
    folder.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrate", *args], cwd=folder, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    print(f"  {' '.join(args)}: {time.perf_counter() - began:.0f} s", flush=True)
    return done.stdout


def sweep_runs(folder: Path):
    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id], max_results=1000)
    parent = next(r for r in runs if r.data.tags.get("orchestrate.role") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return client, parent, sorted(children, key=lambda c: int(c.data.tags["orchestrate.trial_index"]))


def comparison(task: str, repeats: int, folder: Path) -> dict:
    orchestrate(["-m", "+sweep=compare", f"compare.repeats={repeats}", f"backend={BACKENDS}",
                 "hydra.launcher.cpus_per_trial=2", "hydra.launcher.process_per_trial=true", *TASKS[task], *COMMON],
                folder)
    client, parent, children = sweep_runs(folder)
    runs = [read_repeat(c, c.data.tags["orchestrate.trial"], c.info.status, client.get_metric_history) for c in children]
    client.download_artifacts(parent.info.run_id, "comparison.png", str(folder))
    (DOCS / f"compare_{task}.png").write_bytes((folder / "comparison.png").read_bytes())
    # The sweep's own target is eager torch's eval loss, which a backend whose dropout draws differ
    # (ORT's, Inductor's) may never reach exactly: the times here are to the loss every backend
    # reached in every repeat (the worst of all the repeats' best), which the table names.
    bests = [min(v for _, v in x.evals) for x in runs if x.evals]
    common = max(bests) if bests else None
    return {r: compare.compare([x for x in runs if x.repeat < r], "torch", common, 0.95) for r in sorted({3, repeats})}


def auto_picks(task: str, runs: int, folder: Path) -> list[str]:
    picks = []
    for i in range(runs):
        orchestrate(["backend=auto", *TASKS[task], *COMMON], folder / f"auto{i}")
        client = MlflowClient(tracking_uri=f"sqlite:///{folder / f'auto{i}'}/mlflow.db")
        run = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])[0]
        picks.append(run.data.tags["backend"])
    return picks


def behind(result: compare.Comparison, backend: str, key: str, higher_better: bool) -> bool:
    """Whether the intervals of `key` put `backend` clearly behind some other backend."""
    mine = next((g.figures.get(key) for g in result.groups if g.name == f"backend={backend}"), None)
    others = [g.figures[key] for g in result.groups if g.figures.get(key) is not None]
    return mine is not None and any(mine.clear_of(o) and (o.mean > mine.mean) == higher_better for o in others)


TRADEOFF = ["+sweep=tradeoff", "hydra.sweeper.n_trials=24", "backend=choice(torch,compile,ortmodule,ondevice)",
            "optimizer.lr=tag(log,interval(1e-4,3e-2))", "trainer.batch_size=64", "trainer.max_steps=1000",
            "trainer.evaluation_period=100", *COMMON]


def tradeoff(pruned: bool, folder: Path) -> dict:
    args = [*TRADEOFF, "hydra/sweeper/pruner=dominated" if pruned else "hydra/sweeper/pruner=none"]
    orchestrate(["-m", *args], folder)
    _, _, children = sweep_runs(folder)
    points, steps, seconds = {}, 0, 0.0
    for c in children:
        stopped = c.data.tags.get("pruned")
        steps += int(stopped) if stopped else 1000
        seconds += (c.info.end_time - c.info.start_time) / 1000
        if not stopped and c.info.status == "FINISHED":
            points[c.data.tags["orchestrate.trial"]] = [c.data.metrics["final/eval_loss"], c.data.metrics["final/wall_time_s"]]
    return {"points": points, "steps": steps, "seconds": seconds, "trials": len(children),
            "pruned": sum("pruned" in c.data.tags for c in children)}


def interval_rows(task: str, results: dict) -> list[str]:
    lines = []
    for r, result in results.items():
        for g in result.groups:
            cells = [task, str(r), g.name.removeprefix("backend="), f"{result.target:.4f}", f"{g.best_eval:.4f}"]
            for key, spec in (("samples_per_sec", ",.0f"), ("time_to_target", ".2f"), ("warmup_s", ".2f"),
                              ("peak_rss_mb", ",.0f")):
                figure = g.figures.get(key)
                cells.append(figure.shown(spec) if figure else "not reached" if key == "time_to_target" else "")
            cells.append("baseline" if g.deviation is None else f"{g.deviation:.1e}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def draw_fronts(sweeps: dict[str, dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5))
    ax = fig.subplots()
    for (label, s), colour in zip(sweeps.items(), ("C0", "C3")):
        pts = s["points"]
        ax.scatter([v[1] for v in pts.values()], [v[0] for v in pts.values()], color=colour, alpha=0.35)
        on = sorted(pts[k] for k in pareto.front(pts, [True, True]))
        ax.plot([v[1] for v in on], [v[0] for v in on], "o-", color=colour, label=f"{label}: front")
    ax.set(xlabel="seconds (wall_time_s)", ylabel="eval loss", yscale="log", title="24-trial two-objective sweeps")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--auto-runs", type=int, default=5)
    parser.add_argument("--no-sweeps", action="store_true", help="leave out the two-objective sweeps")
    args = parser.parse_args()
    lines = ["| task | R | backend | target eval loss | its best eval loss | samples/s mean [95% CI] | "
             "s to target [95% CI] | warm-up s | peak RSS MiB | max train-loss gap to torch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts, picks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            print(f"{task}: comparison, {args.repeats} repeats", flush=True)
            results = comparison(task, args.repeats, Path(tmp) / task)
            lines += interval_rows(task, results)
            for r, result in results.items():
                v = result.verdicts()
                verdicts.append(f"| {task} | {r} | {v['samples_per_sec']} | {v['time_to_target']} |")
            print(f"{task}: backend=auto, {args.auto_runs} runs", flush=True)
            chosen = auto_picks(task, args.auto_runs, Path(tmp) / f"{task}-auto")
            final = results[args.repeats]
            picks.append(f"| {task} | {', '.join(chosen)} | "
                         f"{sum(behind(final, c, 'samples_per_sec', True) for c in chosen)} of {len(chosen)} | "
                         f"{sum(behind(final, c, 'time_to_target', False) for c in chosen)} of {len(chosen)} |")
        sweeps = {}
        if not args.no_sweeps:
            for pruned in (False, True):
                label = "dominated pruner" if pruned else "no pruning"
                print(f"two-objective sweep, {label}", flush=True)
                sweeps[label] = tradeoff(pruned, Path(tmp) / f"tradeoff-{pruned}")
    text = ["Per backend, over its repeats (R), interleaved, one run at a time on both cores, each in a new "
            "process (`hydra.launcher.cpus_per_trial=2 hydra.launcher.process_per_trial=true`); the target: "
            "the eval loss every backend reached in every repeat:", "", *lines, "",
            "| task | R | verdict on samples/s | verdict on time to target |", "|---|---|---|---|", *verdicts, "",
            f"`backend=auto` on the same task and steps, {args.auto_runs} fresh commands each:", "",
            "| task | auto picked | picks the samples/s intervals (R = 5) put behind | picks the time-to-target "
            "intervals put behind |", "|---|---|---|---|", *picks]
    if sweeps:
        everyone = [v for s in sweeps.values() for v in s["points"].values()]
        reference = [max(v[k] for v in everyone) * 1.1 for k in range(2)]
        text += ["", f"24-trial two-objective sweeps (eval loss, seconds; the MLP, 1,000 steps; reference point "
                     f"{reference[0]:.4f}, {reference[1]:.2f} s):", "",
                 "| sweep | trials finished / pruned | front | hypervolume | trial-steps | trials' seconds |",
                 "|---|---|---|---|---|---|"]
        base = None
        for label, s in sweeps.items():
            front = pareto.front(s["points"], [True, True])
            volume = pareto.hypervolume([s["points"][k] for k in front], [True, True], reference)
            base = base or (volume, s["steps"], s["seconds"])
            text.append(f"| {label} | {len(s['points'])} / {s['pruned']} | {len(front)} | {volume:.4f} "
                        f"({volume / base[0]:.1%}) | {s['steps']:,} ({s['steps'] / base[1]:.0%}) | "
                        f"{s['seconds']:.0f} ({s['seconds'] / base[2]:.0%}) |")
        draw_fronts(sweeps, DOCS / "compare_pareto.png")
        (DOCS / "compare-sweeps.json").write_text(json.dumps(sweeps, indent=1))
    block = "\n".join(text)
    print(block)
    doc = DOCS / "compare.md"
    current = doc.read_text()
    doc.write_text(current[:current.index(BEGIN) + len(BEGIN)] + "\n" + block + "\n" + current[current.index(END):])


if __name__ == "__main__":
    main()
