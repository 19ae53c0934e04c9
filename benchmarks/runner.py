"""The runner's speed: samples/s for 1 and 2 workers (one CPU thread each) per engine, against the
same data-parallel loop written by hand (torch.multiprocessing + gloo + DDP: no Ray, no MLflow,
no bookkeeping), and the cost of `ray.train.report`.

    python benchmarks/runner.py                      # MLP 64-512-512-10 on digits, batch 512 per worker, AdamW
    python benchmarks/runner.py --steps 600 --engines torch ortmodule
    python benchmarks/runner.py --report-cost        # ray.train.report: direct vs the runner's Reporter
    python benchmarks/runner.py --startup --scaling --steps 300 --engines torch   # start-up split; 2 vs 1 worker

`--startup` splits one runner run's start, from `app.train` to the first step: the job's checks,
Ray's start, the placement check, then the MLflow run, Ray Train's controller and the worker
processes up to the first step, and the first step itself (read from MLflow: train/loss at step 1
and its perf/step_time_ms). `--scaling` runs 1 and 2 workers on the same global batch (the
batch split over the workers): the speed-up data parallelism gives on this machine.

`samples/s` is the steady state, summed over workers (the first display window, with graph
builds, is left out by both loops alike); `wall s` is the whole call, start-up included. The
overhead of the orchestration is the ratio of the two loops' samples/s (steady state) and the
difference in wall time (start-up: Ray, worker processes, MLflow).
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def runner(engine: str, workers: int, steps: int, batch: int, tmp: str, display: int = 50) -> dict:
    from orchestrate import app
    from orchestrate.config import load_config

    cfg = load_config(["backend=runner", f"backend.engine={engine}", f"trainer.num_workers={workers}",
                           f"trainer.max_steps={steps}", "trainer.progress=false", "trainer.evaluation_period=0",
                           "trainer.checkpoint_period=0", f"trainer.display_loss_steps={display}",
                           f"tracking.uri=sqlite:///{tmp}/bench.db", "tracking.experiment=runner-benchmark",
                           "tracking.log_checkpoints=false", "model.hidden=[512,512]", f"trainer.batch_size={batch}"])
    began, began_epoch = time.perf_counter(), time.time()
    result = app.train(cfg, Path(tmp) / f"{engine}-{workers}-{time.time_ns()}")
    return {"samples_per_sec": result.metrics["samples_per_sec"], "wall_s": time.perf_counter() - began,
            "train_loss": result.metrics["train_loss"], "run_id": result.run_id, "began": began_epoch}


def startup(engine: str, workers: int, batch: int, tmp: str) -> list[tuple[str, float]]:
    """Where a runner run's start goes: the driver's phases timed around `ray_cluster`'s calls,
    the rest from the run's step-1 metrics."""
    import sqlite3

    from orchestrate.cluster import ray_cluster

    marks: dict[str, tuple[float, float]] = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                marks[name] = (start, time.time())
        return call

    saved = ray_cluster.init, ray_cluster.wait_for_placement
    ray_cluster.init, ray_cluster.wait_for_placement = timed("ray", saved[0]), timed("placement", saved[1])
    try:
        ran = runner(engine, workers, 30, batch, tmp, display=1)
    finally:
        ray_cluster.init, ray_cluster.wait_for_placement = saved
    with sqlite3.connect(f"{tmp}/bench.db") as db:
        logged_ms, step_ms = db.execute(
            "SELECT a.timestamp, b.value FROM metrics a JOIN metrics b ON a.run_uuid = b.run_uuid AND b.step = 1 "
            "AND b.key = 'perf/step_time_ms' WHERE a.run_uuid = ? AND a.key = 'train/loss' AND a.step = 1",
            (ran["run_id"],)).fetchone()
    first_done = logged_ms / 1000 - ran["began"]
    ray_start, ray_end = (t - ran["began"] for t in marks["ray"])
    placed = marks["placement"][1] - ran["began"]
    return [("job checks (Job.prepare: data, model, backend)", ray_start),
            ("Ray start (local instance)", ray_end - ray_start),
            ("placement check (a placement group for the workers)", placed - ray_end),
            ("MLflow run, Ray Train controller, worker processes, model build",
             first_done - step_ms / 1000 - placed),
            ("first step (graph builds, the first all-reduce)", step_ms / 1000),
            ("**app.train to the first step done**", first_done),
            ("whole run (30 steps, wall)", ran["wall_s"])]


def _hand_worker(rank: int, world: int, port: int, engine: str, steps: int, batch: int, out) -> None:
    """The loop as one would write it by hand: same model, same batches, same optimizer."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from orchestrate.tasks.data import Digits
    from orchestrate.tasks.models import MLP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = Digits()
    torch.manual_seed(0)
    model = MLP(64, 10, hidden=[512, 512])
    if engine == "ortmodule":
        from types import SimpleNamespace

        from orchestrate import schema
        from orchestrate.config import load_config

        # The backend as conf/backend/ortmodule.yaml builds it, with one thread; wrap() reads only
        # the job's output folder (for ORTModule's debug graphs).
        backend = schema.build(load_config(["backend=ortmodule", "backend.intra_op_threads=1"]).backend, "backend")
        model = backend.wrap(model, SimpleNamespace(out_dir=Path(tempfile.mkdtemp())))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    loss_fn = torch.nn.functional.cross_entropy
    warm = 50
    for step in range(1, steps + 1):
        if step == warm + 1:
            began = time.perf_counter()
        x, y = data.train_batch(step - 1, batch, 0, rank, world)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            loss.item()
    seconds = time.perf_counter() - began
    if rank == 0:
        out.put((steps - warm) * batch * world / seconds)
    dist.destroy_process_group()


def by_hand(engine: str, workers: int, steps: int, batch: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.perf_counter()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hand_worker, args=(r, workers, port, engine, steps, batch, out)) for r in range(workers)]
    for p in procs:
        p.start()
    sps = out.get(timeout=600)
    for p in procs:
        p.join()
    return {"samples_per_sec": sps, "wall_s": time.perf_counter() - began}


def report_cost(reports: int, gaps: list[float]) -> None:
    """ray.train.report called directly in the loop, against the runner's Reporter, for display
    windows of `gaps` seconds of work."""
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        import ray.train
        import torch

        from orchestrate.backends.runner.collective import Workers
        from orchestrate.backends.runner.report import Reporter

        context = ray.train.get_context()
        reporter = Reporter(Workers(context.get_world_rank(), context.get_world_size(), torch.device("cpu")))
        rows = []
        for gap in config["gaps"]:
            for how in ("direct", "reporter"):
                costs = []
                for i in range(config["reports"]):
                    start = time.perf_counter()
                    while time.perf_counter() - start < gap:  # the training between two display steps
                        pass
                    t = time.perf_counter()
                    if how == "direct":
                        ray.train.report({"i": i})
                    else:
                        reporter.metrics(i, {"train/loss": 0.0})
                    costs.append(time.perf_counter() - t)
                rows.append((gap, how, statistics.median(costs) * 1e3, max(costs) * 1e3))
        reporter.close()
        if ray.train.get_context().get_world_rank() == 0:
            print(f"\nray.train.report, 2 workers, {config['reports']} reports per row, "
                  f"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={os.environ.get('RAY_TRAIN_HEALTH_CHECK_INTERVAL_S')}")
            print(f"{'work between':>12} {'call':>9} {'median ms':>10} {'max ms':>8}")
            for gap, how, median, worst in rows:
                print(f"{gap * 1e3:>10.0f}ms {how:>9} {median:>10.3f} {worst:>8.1f}", flush=True)

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    with tempfile.TemporaryDirectory() as tmp:
        TorchTrainer(loop, train_loop_config={"reports": reports, "gaps": gaps}, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(storage_path=tmp)).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=512, help="per worker")
    parser.add_argument("--engines", nargs="+", default=["torch", "ortmodule", "ondevice"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--report-cost", action="store_true", help="measure ray.train.report instead")
    parser.add_argument("--reports", type=int, default=40)
    parser.add_argument("--gaps", nargs="+", type=float, default=[0.005, 0.05, 0.2],
                        help="seconds of work between two reports (--report-cost)")
    parser.add_argument("--startup", action="store_true", help="split the start-up of one run per engine")
    parser.add_argument("--scaling", action="store_true", help="1 vs 2 workers on the same global batch (--batch)")
    parser.add_argument("--png", default=str(Path(__file__).resolve().parents[1] / "docs" / "runner.png"))
    args = parser.parse_args()
    if args.report_cost:
        report_cost(args.reports, args.gaps)
        return
    if args.startup or args.scaling:
        startup_and_scaling(args)
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            for workers in args.workers:
                ran = runner(engine, workers, args.steps, args.batch, tmp)
                hand = by_hand(engine, workers, args.steps, args.batch) if engine != "ondevice" else None
                rows.append((engine, workers, ran, hand))

    print(f"\nrunner vs the same loop by hand: MLP 64-512-512-10, digits, batch {args.batch} per worker, AdamW, "
          f"{args.steps} steps, 1 CPU thread per worker")
    print(f"{'engine':<10} {'workers':>7} {'samples/s':>10} {'by hand':>10} {'ratio':>6} {'wall s':>7} {'hand wall s':>11}")
    for engine, workers, ran, hand in rows:
        hand_sps = f"{hand['samples_per_sec']:>10,.0f}" if hand else f"{'-':>10}"
        ratio = f"{ran['samples_per_sec'] / hand['samples_per_sec']:>5.2f}x" if hand else f"{'-':>6}"
        hand_wall = f"{hand['wall_s']:>11.1f}" if hand else f"{'-':>11}"
        print(f"{engine:<10} {workers:>7} {ran['samples_per_sec']:>10,.0f} {hand_sps} {ratio} {ran['wall_s']:>7.1f} {hand_wall}")


def startup_and_scaling(args) -> None:
    splits, scaling = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            if args.startup:
                splits[engine] = startup(engine, 2, args.batch // 2, tmp)
            if args.scaling:
                one = runner(engine, 1, args.steps, args.batch, tmp)
                two = runner(engine, 2, args.steps, args.batch // 2, tmp)
                scaling.append((engine, one, two))
    if splits:
        print(f"\n### Runner start-up, 2 workers (30 steps, MLP 64-512-512-10, batch {args.batch // 2} per worker)\n")
        print("| phase | " + " | ".join(f"{e} s" for e in splits) + " |")
        print("|---|" + "---:|" * len(splits))
        for i, (name, _) in enumerate(next(iter(splits.values()))):
            print(f"| {name} | " + " | ".join(f"{split[i][1]:.1f}" for split in splits.values()) + " |")
    if scaling:
        print(f"\n### 2 workers against 1 on the same global batch ({args.batch}), {args.steps} steps, "
              f"1 CPU thread per worker\n")
        print("| engine | 1 worker samples/s | 2 workers samples/s | speed-up | 1 worker wall s | 2 workers wall s |")
        print("|---|---:|---:|---:|---:|---:|")
        for engine, one, two in scaling:
            print(f"| {engine} | {one['samples_per_sec']:,.0f} | {two['samples_per_sec']:,.0f} | "
                  f"{two['samples_per_sec'] / one['samples_per_sec']:.2f}x | {one['wall_s']:.1f} | {two['wall_s']:.1f} |")
    plot(splits, scaling, Path(args.png))


def plot(splits: dict, scaling: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for row, split in enumerate(splits.values()):
        left = 0.0
        for i, (name, s) in enumerate(split[:5]):
            axes[0].barh(row, s, left=left, color=f"C{i}", label=name[:45] if row == 0 else None)
            left += s
    axes[0].set_yticks(range(len(splits)), list(splits))
    axes[0].set_xlabel("seconds from app.train")
    axes[0].set_title("runner start-up, 2 workers", fontsize=10)
    axes[0].legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    xs = range(len(scaling))
    axes[1].bar([x - 0.2 for x in xs], [one["samples_per_sec"] for _, one, _ in scaling], 0.4, label="1 worker")
    axes[1].bar([x + 0.2 for x in xs], [two["samples_per_sec"] for _, _, two in scaling], 0.4, label="2 workers")
    axes[1].set_xticks(list(xs), [e for e, _, _ in scaling])
    axes[1].set_ylabel("samples/s")
    axes[1].set_title("same global batch", fontsize=10)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"\nwrote {png}")


if __name__ == "__main__":
    main()
