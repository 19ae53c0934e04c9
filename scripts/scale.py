"""A large pruned sweep on a multi-node Ray cluster on loopback: does it keep every slot busy, and
does every trial's every metric arrive?

    python scripts/scale.py                        # 200 trials on 4 nodes: docs/scale.md, docs/scale.png
    python scripts/scale.py --trials 24 --out /tmp/scale.json   # a smaller one, figures as JSON

The cluster is Ray's own `ray.cluster_utils.Cluster` on 127.0.0.1: a head with no CPUs and
`--nodes` nodes of `--cpus-per-node` CPUs; a trial takes one CPU, so the cluster has nodes x
cpus-per-node slots. The sweep is an Optuna one with a pruner (hydra/sweeper=orchestrate_optuna,
successive halving), its trials on the cluster through the Ray launcher (hydra.launcher.address),
the study in the PostgreSQL of an `orchestrate server` started here (which also serves MLflow).
Read back through MlflowClient:

- occupancy: busy slots / slots over time, from each trial's MLflow start and end, between the
  first trial's start and the last one's end;
- the sweep's wall time (the command, start to exit) against the ideal: summed trial time / slots;
- every trial FINISHED, and each one's `train/loss` logged at every display step up to where it
  stopped (its `pruned_at`, or the last step) exactly once.

Target (issue 33): wall within 1.25x the ideal, occupancy above 85%.
"""

import argparse
import collections
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every port a node opens on 127.0.0.1, and Ray's clients keep that address (orchestrate.cluster.ray_cluster).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
SWEEP_TIMEOUT_S = 3600


def concurrency_script():
    """scripts/concurrency.py, loaded from its file: it starts `orchestrate server` and waits for it."""
    spec = importlib.util.spec_from_file_location("concurrency", ROOT / "scripts" / "concurrency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def study_storage(folder: Path) -> str:
    """The PostgreSQL URL the server printed for Optuna studies, its password filled in."""
    said = (folder / "server.out").read_text()
    found = re.search(r"hydra\.sweeper\.storage=(\S+) \(PASSWORD in (\S+)\)", said)
    if not found:
        raise SystemExit(f"orchestrate server did not say where studies go:\n{said[-2000:]}")
    return found.group(1).replace("PASSWORD", Path(found.group(2)).read_text().strip())


def sweep_command(args, address: str, uri: str, storage: str) -> list[str]:
    return [sys.executable, "-m", "orchestrate", "-m", "hydra/sweeper=orchestrate_optuna",
            "hydra/sweeper/pruner=successive_halving", f"hydra.sweeper.n_trials={args.trials}",
            f"hydra.sweeper.storage='{storage}'", "hydra.sweeper.sampler.seed=0",
            "optimizer.lr=tag(log, interval(0.0001, 0.1))",
            f"hydra.launcher.address={address}", "hydra.launcher.cpus_per_trial=1",
            "tracking=server", f"tracking.uri={uri}", "backend=torch", "backend.intra_op_threads=1", "data=synthetic",
            "trainer=quick", f"trainer.max_steps={args.steps}", f"trainer.evaluation_period={args.eval_every}",
            "trainer.display_loss_steps=5", "trainer.checkpoint_period=0", "tracking.log_checkpoints=false",
            f"model.hidden=[{args.width},{args.width}]", f"trainer.batch_size={args.batch_size}", "sweep.name=scale"]


def occupancy(intervals: list[tuple[float, float]], slots: int) -> tuple[float, list[tuple[float, int]]]:
    """Busy slot-seconds / (slots x span) between the first start and the last end, and the busy
    count as a step function: (time from the first start, busy slots from then on)."""
    first, last = min(s for s, _ in intervals), max(e for _, e in intervals)
    changes = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    busy, steps = 0, []
    for t, d in changes:
        busy += d
        steps.append((t - first, busy))
    return sum(e - s for s, e in intervals) / (slots * (last - first)), steps


def run(args) -> dict:
    import ray
    from mlflow.tracking import MlflowClient
    from ray.cluster_utils import Cluster

    folder = Path(tempfile.mkdtemp(prefix="scale-", dir="/tmp"))
    os.chmod(folder, 0o755)  # PostgreSQL runs as its own user where this runs as root
    server, uri = concurrency_script().start_server(folder)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus_per_node, node_ip_address="127.0.0.1")
        slots = args.nodes * args.cpus_per_node
        print(f"cluster up: {args.nodes} nodes x {args.cpus_per_node} CPU = {slots} slots ({cluster.address}); "
              f"MLflow {uri}", flush=True)
        began, started_at = time.monotonic(), time.time()
        log = folder / "sweep.out"
        done = subprocess.run(sweep_command(args, cluster.address, uri, study_storage(folder)), cwd=folder,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, timeout=SWEEP_TIMEOUT_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.monotonic() - began
        if done.returncode != 0:
            raise SystemExit(f"the sweep exited {done.returncode}:\n{log.read_text()[-3000:]}")
        return {**read_back(MlflowClient(uri), args, slots, wall, started_at), "args": vars(args) | {"out": str(args.out)}}
    finally:
        cluster.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


def read_back(client, args, slots: int, wall: float, started_at: float) -> dict:
    (experiment,) = [e for e in client.search_experiments() if e.name == "orchestrate"]
    runs = client.search_runs([experiment.experiment_id], max_results=5000)
    trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    intervals = [(r.info.start_time / 1000, r.info.end_time / 1000) for r in trials if r.info.end_time]
    share, busy = occupancy(intervals, slots)
    ideal = sum(e - s for s, e in intervals) / slots
    lost = twice = 0
    for r in trials:
        last = int(r.data.metrics.get("final/pruned_at", args.steps))
        expected = {s for s in range(5, last + 1, 5)} | {last}
        logged = collections.Counter(m.step for m in client.get_metric_history(r.info.run_id, "train/loss"))
        lost += len(expected - set(logged))
        twice += sum(n - 1 for n in logged.values() if n > 1)
    first, last = min(s for s, _ in intervals), max(e for _, e in intervals)
    idle = slots * (last - first) - sum(e - s for s, e in intervals)  # slot-seconds between trials
    return {"head_s": first - started_at, "tail_s": started_at + wall - last, "gap_s": idle / len(intervals),
            "trials": len(trials), "finished": sum(r.info.status == "FINISHED" for r in trials),
            "pruned": sum("pruned" in r.data.tags for r in trials), "slots": slots, "wall_s": wall, "ideal_s": ideal,
            "wall_over_ideal": wall / ideal, "occupancy": share, "span_s": max(e for _, e in intervals) -
            min(s for s, _ in intervals), "mean_trial_s": sum(e - s for s, e in intervals) / len(intervals),
            "lost": lost, "twice": twice, "busy": busy}


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, busy = zip(*figures["busy"])
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.step(t, busy, where="post", linewidth=1)
    ax.axhline(figures["slots"], color="grey", linestyle="--", linewidth=1, label=f"{figures['slots']} slots")
    ax.set_xlabel("seconds since the first trial started")
    ax.set_ylabel("busy slots")
    ax.set_title(f"{figures['trials']} trials ({figures['pruned']} pruned): occupancy {figures['occupancy']:.0%}, "
                 f"wall {figures['wall_over_ideal']:.2f}x ideal")
    ax.legend(loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def page(figures: dict, picture: str) -> str:
    a = figures["args"]
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    return "\n".join([
        "# A large pruned sweep on a loopback cluster",
        "",
        f"Written by `python scripts/scale.py --trials {a['trials']} --nodes {a['nodes']}` on {datetime.date.today()} "
        f"({platform.node()}, {os.cpu_count()} cores). Ray's `ray.cluster_utils.Cluster` on 127.0.0.1: a head with no "
        f"CPUs and {a['nodes']} nodes of {a['cpus_per_node']} CPU; each trial takes 1 CPU: {figures['slots']} slots. "
        "The study is in the PostgreSQL of an `orchestrate server` started by the script, which also serves MLflow.",
        "",
        f"Trials: `backend=torch data=synthetic model.hidden=[{a['width']},{a['width']}] trainer.batch_size={a['batch_size']} "
        f"trainer.max_steps={a['steps']} "
        f"trainer.evaluation_period={a['eval_every']}`, the learning rate drawn by TPE, pruned by successive halving.",
        "",
        "| what | value | target |", "|---|---|---|",
        f"| trials FINISHED | {figures['finished']} of {figures['trials']} ({figures['pruned']} pruned) | all |",
        f"| `train/loss` points lost / logged twice | {figures['lost']} / {figures['twice']} | 0 / 0 |",
        f"| sweep wall time | {figures['wall_s']:.0f} s | |",
        f"| ideal (summed trial time / slots) | {figures['ideal_s']:.0f} s (mean trial {figures['mean_trial_s']:.1f} s) | |",
        f"| wall / ideal | {figures['wall_over_ideal']:.2f} | at most 1.25 ({verdict(figures['wall_over_ideal'] <= 1.25)}) |",
        f"| occupancy, first start to last end ({figures['span_s']:.0f} s) | {figures['occupancy']:.1%} | above 85% "
        f"({verdict(figures['occupancy'] > 0.85)}) |",
        f"| before the first trial's run / after the last one's | {figures['head_s']:.1f} s / {figures['tail_s']:.1f} s | |",
        f"| idle slot time per trial (its launch, the run's set-up before MLflow opens it) | {figures['gap_s']:.2f} s | |",
        "",
        f"![busy slots over time]({picture})",
        "",
        "The wall time counts what the trials' MLflow runs do not: the sweep's own start (Ray, the study, the "
        "first composition), the launch of each trial and the sweep's end (its summary).",
    ]) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument("--steps", type=int, default=300, help="trainer.max_steps of a trial")
    p.add_argument("--eval-every", type=int, default=100, help="trainer.evaluation_period: where the pruner looks")
    p.add_argument("--width", type=int, default=1024, help="the MLP's two hidden layers' width")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "scale.md")
    args = p.parse_args()
    figures = run(args)
    if args.out.suffix == ".json":
        args.out.write_text(json.dumps(figures, indent=1))
    else:
        plot(figures, args.out.with_suffix(".png"))
        args.out.write_text(page(figures, args.out.with_suffix(".png").name))
    print(json.dumps({k: v for k, v in figures.items() if k != "busy"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
