"""An elastic run on a real multi-node Ray cluster on loopback: does it grow when nodes join, shrink
when one leaves, log every step once, and train as a fixed-size run does?

    python scripts/elastic.py                       # 2 to 4 workers: the figures in docs/elastic.md
    python scripts/elastic.py --min 1 --max 2 --steps 600 --out /tmp/elastic.json   # the suite's size

The cluster is Ray's own `ray.cluster_utils.Cluster` (as Ray's elastic tests build it): a head with
no CPUs for training and one node of 1 CPU per worker, all on 127.0.0.1. First a fixed-size run
(`trainer.num_workers=MAX`) on MAX nodes; then nodes are removed down to MIN and the elastic run
starts (`trainer.min_workers=MIN trainer.num_workers=MAX`); once it has trained a while the
missing nodes join again (it grows to MAX), and once it has trained at MAX one node is killed (it
shrinks). Both runs log to an MLflow server started here; what they logged is read back through
MlflowClient: the sizes over steps (`world_size`), the `resized_at_*` tags, every step of
`train/loss` exactly once, and the elastic run's loss at each step against the fixed run's.

`--out x.json` writes the figures as JSON (tests/backends/test_elastic.py reads them); `--out x.md`
(the default: docs/elastic.md) writes the page.
"""

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every port a node opens on 127.0.0.1, and Ray's clients keep that address (orchestrate.cluster.ray_cluster).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900
EVENT_TIMEOUT_S = 300


def settings(args, folder: Path, name: str) -> list[str]:
    """The overrides both runs share: the torch engine on 1-CPU workers, the loss at every step."""
    return ["backend=runner", "backend.engine=torch", "backend.cpus_per_worker=1", f"trainer.num_workers={args.max}",
            "data=digits",
            f"model.hidden=[{args.width},{args.width}]", f"trainer.batch_size={args.batch_size}",
            f"trainer.max_steps={args.steps}", "trainer.display_loss_steps=1", "trainer.evaluation_period=0",
            f"trainer.checkpoint_period={args.checkpoint_period}", "trainer.progress=false", "optimizer=sgd",
            f"optimizer.lr={args.lr}", f"tracking.run_name={name}", f"hydra.run.dir={folder / name}"]


def start_run(args, address: str, uri: str, folder: Path, name: str, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "orchestrate", *settings(args, folder, name), f"backend.ray_address={address}",
               f"tracking.uri={uri}", *extra]
    log = (folder / f"{name}.out").open("w")
    return subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def start_reference(args, uri: str, folder: Path) -> subprocess.Popen:
    """The fixed-size run in one process: backend=torch with the whole global batch a step (the
    runner's MAX ranks read slices of that same batch)."""
    overrides = [o for o in settings(args, folder, "fixed") if not o.startswith(("backend", "trainer.num_workers",
                                                                                "trainer.batch_size"))]
    command = [sys.executable, "-m", "orchestrate", "backend=torch", "backend.intra_op_threads=1",
               f"trainer.batch_size={args.batch_size * args.max}", *overrides, f"tracking.uri={uri}"]
    return subprocess.Popen(command, cwd=folder, stdout=(folder / "fixed.out").open("w"), stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, folder: Path, name: str) -> None:
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    if code != 0:
        said = f"not finished within {RUN_TIMEOUT_S} s" if code is None else f"exited {code}"
        raise SystemExit(f"{name}: {said}:\n{(folder / f'{name}.out').read_text()[-3000:]}")


class Watch:
    """The run's MLflow metrics as they arrive (rank 0 logs them as it trains)."""

    def __init__(self, client, name: str, proc: subprocess.Popen):
        self.client, self.name, self.proc, self.run_id = client, name, proc, None

    def _run_id(self) -> str | None:
        if self.run_id is None:
            runs = self.client.search_runs(self.client.get_experiment_by_name("orchestrate").experiment_id,
                                           filter_string=f"tags.mlflow.runName = '{self.name}'")
            self.run_id = runs[0].info.run_id if runs else None
        return self.run_id

    def history(self, key: str) -> list[tuple[int, float]]:
        run_id = self._run_id()
        return sorted((m.step, m.value) for m in self.client.get_metric_history(run_id, key)) if run_id else []

    def wait(self, what: str, done) -> None:
        """Until `done()` (polled each half second), or SystemExit naming `what` when the run exits first."""
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not done():
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} finished before {what}: make the run longer (--steps)")
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: no {what} within {EVENT_TIMEOUT_S} s")
            time.sleep(0.5)

    def step(self) -> int:
        loss = self.history("train/loss")
        return loss[-1][0] if loss else 0

    def size_at_or_after(self, step: int) -> int | None:
        sizes = [size for s, size in self.history("world_size") if s >= step]
        return int(sizes[-1]) if sizes else None


def run(args) -> dict:
    import ray
    from mlflow.tracking import MlflowClient
    from ray.cluster_utils import Cluster

    from orchestrate.sweeps._server import TrackingServer

    folder = Path(tempfile.mkdtemp(prefix="elastic-", dir="/tmp"))
    server = TrackingServer(f"sqlite:///{folder}/mlflow.db", folder / "artifacts")
    client = MlflowClient(server.uri)
    began = time.monotonic()
    events: list[dict] = []

    def event(what: str, **more) -> None:
        events.append({"t": round(time.monotonic() - began, 1), "event": what, **more})
        print(f"[{events[-1]['t']:6.1f} s] {what} {more or ''}", flush=True)

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
    try:
        nodes = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(args.max)]
        event(f"cluster up: a head with no CPUs and {args.max} nodes of 1 CPU", address=cluster.address)
        fixed_began = time.monotonic()
        if args.reference == "runner":
            finish(start_run(args, cluster.address, server.uri, folder, "fixed"), folder, "fixed")
        else:  # the same global batch in one process: backend=torch, batch_size x MAX
            finish(start_reference(args, server.uri, folder), folder, "fixed")
        fixed_s = time.monotonic() - fixed_began
        event(f"fixed-size run finished ({args.max} workers)" if args.reference == "runner" else
              f"fixed-size run finished (backend=torch, one batch of {args.max} x {args.batch_size})",
              seconds=round(fixed_s, 1))
        for node in nodes[args.min:]:
            cluster.remove_node(node)
        nodes = nodes[:args.min]
        event(f"nodes removed: {args.min} left")

        elastic_began = time.monotonic()
        proc = start_run(args, cluster.address, server.uri, folder, "elastic", f"trainer.min_workers={args.min}",
                         f"backend.resize_interval_s={args.resize_interval}",
                         f"backend.placement_timeout_s={args.start_timeout}", f"backend.max_failures={args.max_failures}")
        watch = Watch(client, "elastic", proc)
        watch.wait(f"{args.grow_at} steps", lambda: watch.step() >= args.grow_at)
        event(f"{args.max - args.min} node(s) join", step=watch.step())
        nodes += [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(args.max - args.min)]
        grown = watch.step()
        watch.wait(f"growth to {args.max} workers", lambda: watch.size_at_or_after(grown) == args.max)
        at_max = min(s for s, size in watch.history("world_size") if s >= grown and size == args.max)
        event(f"trains with {args.max} workers", step=at_max)
        watch.wait(f"{args.shrink_after} steps at {args.max} workers", lambda: watch.step() >= at_max + args.shrink_after)
        leaving = nodes.pop()
        if args.shrink == "drain":  # a planned removal, as a spot reclaim or a scale-down announces it
            event(f"a node is drained (deadline {args.drain_deadline} s), then removed", step=watch.step())
            drain(cluster.address, leaving.node_id, args.drain_deadline)
            watch.wait("the run without the drained node", lambda: watch.size_at_or_after(at_max) == args.max - 1)
            event(f"trains with {args.max - 1} workers", step=watch.step())
        else:
            event("a node is killed", step=watch.step())
        cluster.remove_node(leaving)
        finish(proc, folder, "elastic")
        elastic_s = time.monotonic() - elastic_began
        event("elastic run finished", seconds=round(elastic_s, 1))
        printed = (folder / "elastic.out").read_text().splitlines()
        return {**read_back(client, watch, args), "events": events, "fixed_s": fixed_s, "elastic_s": elastic_s,
                "summary_workers": next((line.strip() for line in printed if line.strip().startswith("workers ")), None),
                "args": vars(args) | {"out": str(args.out)}}
    finally:
        cluster.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        server.stop()
        forget_address(cluster)


def drain(address: str, node_id: str, deadline_s: int) -> None:
    """Ask the cluster to drain a node for preemption with a deadline (Ray's `ray drain-node`, the
    call a cloud's reclaim notice or Ray's autoscaler makes): Ray Train tells the workers, which
    checkpoint at once, and restarts without the node at the deadline."""
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "drain-node", f"--address={address}",
                    f"--node-id={node_id}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message=scripts/elastic.py", f"--deadline-remaining-seconds={deadline_s}"], check=True)


def forget_address(cluster) -> None:
    """Cluster writes its address where a later plain `ray.init()` would look for a running Ray:
    that file goes with the cluster."""
    from ray._private.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    if path.is_file() and path.read_text().strip() == str(cluster.address):
        path.unlink()


def read_back(client, watch: Watch, args) -> dict:
    """What MLflow holds for both runs: statuses, the sizes over steps, the tags, every step once, the
    loss at each step against the fixed run's."""
    runs = {r.data.tags["mlflow.runName"]: r for r in client.search_runs(
        client.get_experiment_by_name("orchestrate").experiment_id)}
    losses, counts = {}, {}
    for name, r in runs.items():
        points = client.get_metric_history(r.info.run_id, "train/loss")
        counts[name] = collections.Counter(m.step for m in points)
        losses[name] = {m.step: m.value for m in points}
    expected = set(range(1, args.steps + 1))
    sizes = [(s, int(v)) for s, v in watch.history("world_size")]
    changes = [sizes[0]] + [(s, v) for (s, v), (_, before) in zip(sizes[1:], sizes) if v != before]
    both = [s for s in sorted(expected) if s in losses["elastic"] and s in losses["fixed"]]
    gaps = [abs(losses["elastic"][s] - losses["fixed"][s]) for s in both]
    diffs = [gap / max(abs(losses["fixed"][s]), 1e-12) for gap, s in zip(gaps, both)]
    tags = runs["elastic"].data.tags
    kept = [int(a.path.split("step_")[1].split(".")[0]) for a in
            client.list_artifacts(runs["elastic"].info.run_id, "checkpoints") if "step_" in a.path]
    return {
        "status": {name: r.info.status for name, r in runs.items()},
        "missing": {name: len(expected - set(c)) for name, c in counts.items()},
        "twice": {name: sum(n - 1 for n in c.values() if n > 1) for name, c in counts.items()},
        "sizes": changes,  # (first step logged at this size, size)
        "resized_at": {k: v for k, v in tags.items() if k.startswith("resized_at_")},
        "world_sizes_tag": tags.get("world_sizes"),
        # checkpoints off trainer.checkpoint_period: the one a drain notice asked for
        "drain_checkpoints": sorted(s for s in kept if s % args.checkpoint_period and s < args.steps),
        # relative to the step's own loss (large where the loss is near 0), and to the first step's loss
        "max_rel_diff": max(diffs), "final_rel_diff": diffs[-1], "max_diff_of_start": max(gaps) / losses["fixed"][1],
        "loss": {"fixed_first": losses["fixed"][1], "fixed_last": losses["fixed"][args.steps],
                 "elastic_last": losses["elastic"][args.steps]},
    }


def page(figures: dict) -> str:
    a = figures["args"]
    sizes = " -> ".join(f"{size} (from step {step})" for step, size in figures["sizes"])
    lines = [
        "# Elastic runner on a loopback cluster",
        "",
        f"Written by `python scripts/elastic.py` on {datetime.date.today()} ({platform.node()}, "
        f"{os.cpu_count()} cores). Ray's `ray.cluster_utils.Cluster` on 127.0.0.1: a head with no CPUs and one "
        "1-CPU node per worker.",
        "",
        f"Both runs: `backend=runner backend.engine=torch data=digits model.hidden=[{a['width']},{a['width']}] "
        f"trainer.batch_size={a['batch_size']} trainer.max_steps={a['steps']} "
        f"trainer.checkpoint_period={a['checkpoint_period']} optimizer=sgd optimizer.lr={a['lr']}`, the loss at every "
        f"step. Fixed: `trainer.num_workers={a['max']}` (the runner; with `--reference torch`, `backend=torch` and "
        f"the global batch in one process). Elastic: `trainer.min_workers={a['min']} "
        f"trainer.num_workers={a['max']} backend.resize_interval_s={a['resize_interval']} "
        f"backend.placement_timeout_s={a['start_timeout']}`.",
        "",
        "| what | value |", "|---|---|",
        f"| elastic run's sizes (MLflow `world_size`) | {sizes} |",
        f"| `resized_at_*` tags | {', '.join(f'{k} = {v}' for k, v in sorted(figures['resized_at'].items()))} |",
        f"| `world_sizes` tag | {figures['world_sizes_tag']} |",
        f"| checkpoints written on the drain notice (off the period of {a['checkpoint_period']}) | "
        f"{', '.join(f'step {s}' for s in figures['drain_checkpoints']) or 'none'} |",
        f"| steps missing / logged twice (elastic) | {figures['missing']['elastic']} / {figures['twice']['elastic']} |",
        f"| steps missing / logged twice (fixed) | {figures['missing']['fixed']} / {figures['twice']['fixed']} |",
        f"| largest loss difference at a step, elastic vs fixed, relative to that step's loss | "
        f"{figures['max_rel_diff']:.2e} |",
        f"| the same, relative to the first step's loss | {figures['max_diff_of_start']:.2e} |",
        f"| at the last step | {figures['final_rel_diff']:.2e} (loss {figures['loss']['fixed_first']:.4f} at step 1, "
        f"{figures['loss']['fixed_last']:.4f} fixed / {figures['loss']['elastic_last']:.4f} elastic at the last) |",
        f"| wall time, fixed / elastic | {figures['fixed_s']:.0f} s / {figures['elastic_s']:.0f} s |",
        f"| runs' status | {', '.join(f'{k} {v}' for k, v in sorted(figures['status'].items()))} |",
        "",
        "What happened, in the script's clock:",
        "",
        "| s | event |", "|---|---|",
        *[f"| {e['t']} | {e['event']}{' (step ' + str(e['step']) + ')' if 'step' in e else ''} |"
          for e in figures["events"]],
        "",
        "A resize is a restart of every worker from the latest checkpoint (Ray Train's design): the steps "
        "since it are trained again, at the new size, and logged once (the first time). The differences "
        "above come from the order floating-point sums are taken in, which depends on the worker count "
        "(the gradients are the same means over the same samples); BatchNorm statistics, where a model has "
        "them, are per rank and would differ more.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min", type=int, default=2)
    p.add_argument("--max", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--grow-at", type=int, default=100, help="nodes join once the run logged this step")
    p.add_argument("--shrink-after", type=int, default=100, help="a node leaves this many steps after the growth")
    p.add_argument("--shrink", choices=["drain", "kill"], default="drain",
                   help="drain: the node is drained first (a preemption notice with a deadline), then removed; "
                        "kill: removed without notice")
    p.add_argument("--drain-deadline", type=int, default=10)
    p.add_argument("--width", type=int, default=1024, help="the MLP's hidden width (sets the step time)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker at --max workers")
    p.add_argument("--checkpoint-period", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--resize-interval", type=float, default=2.0)
    p.add_argument("--start-timeout", type=float, default=10.0)
    p.add_argument("--max-failures", type=int, default=4)
    p.add_argument("--reference", choices=["runner", "torch"], default="runner",
                   help="the fixed-size run: the runner on MAX workers, or backend=torch with the global batch "
                        "in one process (the same samples a step; quicker)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "elastic.md")
    args = p.parse_args()
    if not 1 <= args.min < args.max:
        p.error("--min must be at least 1 and below --max")
    figures = run(args)
    if args.out.suffix == ".json":
        args.out.write_text(json.dumps(figures, indent=1))
    else:
        args.out.write_text(page(figures))
    print(json.dumps({k: v for k, v in figures.items() if k != "events"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
