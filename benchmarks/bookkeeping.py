"""What orchestrate's loop costs per step: each backend's loop against a hand-written loop over
the same model, batches, optimizer, seed and thread settings, with nothing logged. Two figures
per backend: the loop alone (`backend.fit` on a prepared job, no MLflow run: its per-step
bookkeeping, the progress meter, the norms at display steps) and the whole of `orchestrate.app.train`
(the same loop with the default metric logging: train/loss, throughput, lr, gradient and parameter
norms every trainer.display_loss_steps, sent to MLflow's store by the run's outbox thread).

    python benchmarks/bookkeeping.py                               # digits MLP, 3000 steps, 3 repeats
    python benchmarks/bookkeeping.py --steps 1000 --repeats 2 --backends torch ondevice
    python benchmarks/bookkeeping.py --overrides backend.intra_op_threads=1   # torch on one thread too

On a machine whose cores are busy with other work, PyTorch's default pool (one thread per core)
collapses (spinning threads wait for descheduled ones: 867 samples/s seen for 30k+ idle): there,
compare with one thread for every backend.

Eval and checkpoints are off in both. The hand-written loops:
  torch      forward, loss, backward, fused AdamW step, zero_grad; the loss summed as a tensor and
             never read in the loop (the fastest a mean loss can be kept; orchestrate's loop reads
             its losses at display steps only).
  ortmodule  the same loop around `ORTModule(model)`, whose sessions get the options orchestrate's
             backend gives them (intra-op threads, spinning: `orchestrate.ort.configure`), torch
             with the same thread count, ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=1 as conf sets.
  ondevice   `Module(batch)`, `Optimizer.step()`, `lazy_reset_grad()` over the artifacts
             orchestrate's backend builds (graph building is start-up, not the loop), with the
             same session options.
All are timed the same way: steps after the first display window (graph builds, warm-up) to the
last one, wall clock. Runs are interleaved (hand, loop, tracked; then the other way round) per
backend and repeated; the table shows the medians of samples/s and of each repeat's ratio to its
own hand-written run (with the tracked ratio's range over the repeats). The PNG goes to
docs/bookkeeping.png.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from orchestrate import app, ort, process
from orchestrate.config import load_config
from orchestrate.job import Job, seed_everything
from orchestrate.tasks import losses

BACKENDS = ["torch", "ortmodule", "ondevice"]
TARGET = 0.95  # orchestrate's samples/s over the hand-written loop's


def config(backend: str, steps: int, tmp: str, overrides: list[str]):
    return load_config([f"backend={backend}", f"trainer.max_steps={steps}", "trainer.progress=false",
                            "trainer.evaluation_period=0", "trainer.checkpoint_period=0",
                            f"tracking.uri=sqlite:///{tmp}/bench.db", "tracking.experiment=bookkeeping",
                            "tracking.log_checkpoints=false", *overrides])


def timed_loop(step_fn, steps: int, warmup: int) -> float:
    """Run step_fn(step) for steps 1..steps; seconds of steps warmup+1..steps."""
    for step in range(1, warmup + 1):
        step_fn(step)
    began = time.perf_counter()
    for step in range(warmup + 1, steps + 1):
        step_fn(step)
    return time.perf_counter() - began


def hand_torch(job: Job, wrap=None) -> float:
    """The plain PyTorch loop (ORTModule's when `wrap` wraps the model)."""
    t, data = job.trainer, job.data
    job.use_cores(job.backend)  # the run's CPU budget, as TorchBackend.fit sizes it
    model = wrap(job.model) if wrap else job.model
    # The fused AdamW, as orchestrate's loops build it (backend.fused_optimizer).
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                  fused=job.backend.fused_optimizer)
    loss_fn = losses.get(data.loss).torch
    model.train()
    total = [torch.zeros(())]

    def step(i: int) -> None:
        x, y = data.train_batch(i - 1, t.batch_size, t.seed)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total[0] += loss.detach()  # summed where it is, read once at the end

    return timed_loop(step, t.max_steps, t.display_loss_steps)


def hand_ortmodule(job: Job) -> float:
    backend = job.backend
    os.environ.update({k: str(v) for k, v in backend.options.items()})
    ort.quiet(backend.log_level)
    from onnxruntime.training.ortmodule import ORTModule

    def wrap(model):
        wrapped = ORTModule(model)
        backend._set_threads(wrapped)  # the same session options (threads, spinning) as the backend's
        return wrapped

    return hand_torch(job, wrap)


def hand_ondevice(job: Job) -> float:
    backend, t, data = job.backend, job.trainer, job.data
    ort.quiet(backend.log_level)
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    folder = job.out_dir / "artifacts"
    with ort.stderr_logged():
        backend.generate_artifacts(job, folder)
    options = ort.session_options(job.use_cores(backend).threads, backend.allow_spinning, backend.mapped_dimensions,
                                  backend.log_level)
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                    device="cpu", session_options=options)
    optimizer = Optimizer(str(folder / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(job.lr)
    module.train()
    total = [0.0]

    def step(i: int) -> None:
        x, y = data.train_batch(i - 1, t.batch_size, t.seed)
        loss, _ = module(x.numpy(), y.numpy())
        optimizer.step()
        module.lazy_reset_grad()
        total[0] += float(loss)

    return timed_loop(step, t.max_steps, t.display_loss_steps)


HAND = {"torch": hand_torch, "ortmodule": hand_ortmodule, "ondevice": hand_ondevice}


def loop_alone(cfg, out_dir: Path) -> float:
    """samples/s of the backend's own loop on a prepared job, with no MLflow run."""
    seed_everything(cfg.trainer.seed)
    job = Job.prepare(cfg, out_dir)
    with process.kept():
        job.backend.fit(job)
    return job.meter.summary()["samples_per_sec"]


def tracked(cfg, out_dir: Path) -> float:
    """samples/s of the whole run, as `python -m orchestrate` trains it (an MLflow run)."""
    return app.train(cfg, out_dir).metrics["samples_per_sec"]


def hand_written(cfg, out_dir: Path) -> float:
    """samples/s of the hand-written loop (built from the same config, same seed)."""
    seed_everything(cfg.trainer.seed)
    job = Job.prepare(cfg, out_dir)
    with process.kept():  # thread counts and environment back as they were
        seconds = HAND[job.backend.name](job)
    t = job.trainer
    return (t.max_steps - t.display_loss_steps) * t.batch_size / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--png", default=str(Path(__file__).resolve().parents[1] / "docs" / "bookkeeping.png"))
    args = parser.parse_args()

    runs = {"hand": hand_written, "loop": loop_alone, "tracked": tracked}
    got: dict[str, dict[str, list[float]]] = {b: {who: [] for who in runs} for b in args.backends}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for backend in args.backends:
                cfg = config(backend, args.steps, tmp, args.overrides)
                # Alternate the order: none always gets the warmer caches.
                order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
                for who in order:
                    began = time.perf_counter()
                    got[backend][who].append(runs[who](cfg, Path(tmp) / f"{backend}-{who}-{rep}"))
                    print(f"# repeat {rep} {backend} {who}: {got[backend][who][-1]:,.0f} samples/s "
                          f"({time.perf_counter() - began:.1f} s with start-up)", file=sys.stderr, flush=True)

    rows = []
    for backend in args.backends:
        h, lo, tr = (statistics.median(got[backend][who]) for who in runs)
        # Each ratio is the median of the repeats' own ratios: the three runs of a repeat ran one
        # after the other, so a slow spell of a shared machine hits them alike.
        paired = {who: [a / b for a, b in zip(got[backend][who], got[backend]["hand"])] for who in ("loop", "tracked")}
        rows.append((backend, h, lo, tr, statistics.median(paired["loop"]), statistics.median(paired["tracked"]),
                     f"{min(paired['tracked']):.2f}-{max(paired['tracked']):.2f}"))
    print(f"\n{args.steps} steps x {args.repeats} repeats, {' '.join(args.overrides) or 'digits MLP, batch 64, AdamW'}, "
          f"eval and checkpoints off; tracked: logging every {cfg.trainer.display_loss_steps} steps to MLflow "
          "(SQLite)\n")
    print("| backend | hand-written samples/s | loop alone | loop / hand | tracked (app.train) | tracked / hand "
          "| tracked / hand, each repeat | target | met (loop, tracked) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|:--:|")
    for backend, h, lo, tr, r_loop, r_tracked, spread in rows:
        met = "/".join("yes" if r >= TARGET else "no" for r in (r_loop, r_tracked))
        print(f"| {backend} | {h:,.0f} | {lo:,.0f} | {r_loop:.3f} | {tr:,.0f} | {r_tracked:.3f} | {spread} | {TARGET} "
              f"| {met} |")
    plot(rows, Path(args.png), args)


def plot(rows, png: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.27 for x in xs], [r[1] for r in rows], 0.27, label="hand-written")
    ax.bar(list(xs), [r[2] for r in rows], 0.27, label="orchestrate's loop (no MLflow)")
    ax.bar([x + 0.27 for x in xs], [r[3] for r in rows], 0.27, label="orchestrate (app.train, MLflow)")
    for x, r in zip(xs, rows):
        ax.text(x, r[2], f"{r[4]:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.text(x + 0.27, r[3], f"{r[5]:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [r[0] for r in rows])
    ax.set_ylabel("samples/s (median)")
    ax.set_title(f"Loop bookkeeping: digits MLP, {args.steps} steps x {args.repeats}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"\nwrote {png}")


if __name__ == "__main__":
    main()
