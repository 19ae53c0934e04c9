"""The runner's speed: samples/s for 1 and 2 workers (one CPU thread each) per engine, against the
same data-parallel loop written by hand (torch.multiprocessing + gloo + DDP: no Ray, no MLflow,
no bookkeeping), and the cost of `ray.train.report`.

    python benchmarks/runner.py                      # MLP 64-512-512-10 on digits, batch 512 per worker, AdamW
    python benchmarks/runner.py --steps 600 --engines torch ortmodule
    python benchmarks/runner.py --report-cost        # ray.train.report: direct vs the runner's Reporter

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

def runner(engine: str, workers: int, steps: int, batch: int, tmp: str) -> dict:
    from orchestrate import app

    cfg = app.load_config(["backend=runner", f"backend.engine={engine}", f"trainer.num_workers={workers}",
                           f"trainer.max_steps={steps}", "trainer.progress=false", "trainer.evaluation_period=0",
                           "trainer.checkpoint_period=0", "trainer.display_loss_steps=50",
                           f"tracking.uri=sqlite:///{tmp}/bench.db", "tracking.experiment=runner-benchmark",
                           "tracking.log_checkpoints=false", "model.hidden=[512,512]", f"trainer.batch_size={batch}"])
    began = time.perf_counter()
    metrics = app.train(cfg, Path(tmp) / f"{engine}-{workers}-{time.time_ns()}").metrics
    return {"samples_per_sec": metrics["samples_per_sec"], "wall_s": time.perf_counter() - began,
            "train_loss": metrics["train_loss"]}


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

        from orchestrate import app, schema

        # The backend as conf/backend/ortmodule.yaml builds it, with one thread; wrap() reads only
        # the job's output folder (for ORTModule's debug graphs).
        backend = schema.build(app.load_config(["backend=ortmodule", "backend.intra_op_threads=1"]).backend, "backend")
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

        from orchestrate.backends.runner.report import Reporter
        from orchestrate.backends.runner.sync import Workers

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
    args = parser.parse_args()
    if args.report_cost:
        report_cost(args.reports, args.gaps)
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


if __name__ == "__main__":
    main()
