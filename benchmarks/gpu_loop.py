"""orchestrate's PyTorch loop on a GPU against the loop a user would write by hand: what the loop's
own bookkeeping (loss window, divergence guard, progress, metrics to MLflow) costs per step.

    python benchmarks/gpu_loop.py                                  # both models x 4 precisions, 2 repeats
    python benchmarks/gpu_loop.py --models small --precisions bf16 fp16 --repeats 1
    python benchmarks/gpu_loop.py --check-syncs                    # also: no host sync between reading steps
    python benchmarks/gpu_loop.py --device cpu --steps 40 --models small --precisions fp32   # the script itself, on a CPU

Each row trains the same CharTransformer on the same `PythonSource` batches, from the same seed,
with the same optimizer (the fused AdamW orchestrate builds: lr 1e-3, weight decay 0.01):
  orchestrate  `orchestrate.app.train`, as `python -m orchestrate backend=torch ...` runs it: a
               tracked MLflow run (a throwaway SQLite store), metrics every 25 steps, evaluation
               and a checkpoint at the end only; its summary's step time (the first window, graph
               warm-up, left out).
  hand         the fast hand-written loop: pinned batches copied with non_blocking=True, the loss
               summed on the device and read once at the end, GradScaler in fp16, nothing logged;
               steps 26 on, timed between two synchronizations.
Runs are interleaved (orchestrate, hand; then the other way round). The table shows the median
step time of each and hand / orchestrate (1.0: the same speed); the target is 0.97 in every row.
The last lines say whether orchestrate's bf16 step is at most its fp16 step (bf16 has no loss
scaler to read back, so by hand it is the faster of the two).

`--check-syncs` runs orchestrate's loop (no MLflow run) for each precision under
`torch.cuda.set_sync_debug_mode("error")` on every step that reads nothing back (not a display,
evaluation or checkpoint step) after the first window: any host sync there fails the check, naming
the operation. `scripts/gpu_check.sh` runs both on a lent GPU machine.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from backends import commit, machine  # benchmarks/backends.py: where and when it was measured

from orchestrate import app, process
from orchestrate.config import load_config
from orchestrate.job import Job, seed_everything
from orchestrate.tasks import losses

TARGET = 0.97  # hand-written step time over orchestrate's: orchestrate within 3% of the fast hand loop
WARMUP = 25  # steps left out of the timing (orchestrate's first display window)
GPT = ["model=char_transformer", "data=python_source"]
MODELS = {
    "small": ("shipped 2-layer GPT, batch 64", [*GPT, "trainer.batch_size=64"], 500),
    "large": ("6 layers, n_embd=384 n_head=6 block_size=128, batch 256",
              [*GPT, "model.n_layer=6", "model.n_embd=384", "model.n_head=6", "data.block_size=128",
               "trainer.batch_size=256"], 300),
}
PRECISIONS = {
    "fp32": ("fp32, TF32 off", ["trainer.precision=fp32", "trainer.tf32=false"]),
    "tf32": ("fp32, TF32", ["trainer.precision=fp32", "trainer.tf32=true"]),
    "bf16": ("bf16", ["trainer.precision=bf16"]),
    "fp16": ("fp16", ["trainer.precision=fp16"]),
}


def config(model: str, precision: str, device: str, steps: int | None, tmp: str, *more: str):
    _, overrides, default_steps = MODELS[model]
    return load_config(["backend=torch", *overrides, *PRECISIONS[precision][1], f"trainer.device={device}",
                        f"trainer.max_steps={steps or default_steps}", f"trainer.display_loss_steps={WARMUP}",
                        "trainer.evaluation_period=0", "trainer.checkpoint_period=0", "trainer.progress=false",
                        f"tracking.uri=sqlite:///{tmp}/gpu_loop.db", "tracking.experiment=gpu_loop",
                        "tracking.log_checkpoints=false", *more])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def orchestrate(cfg, out_dir: Path) -> float:
    """ms a step of `python -m orchestrate` on this config (its summary's step time)."""
    return app.train(cfg, out_dir).metrics["step_time_ms"]


def hand(cfg, out_dir: Path) -> float:
    """ms a step of the fast hand-written loop on the same model, batches and optimizer."""
    seed_everything(cfg.trainer.seed)
    job = Job.prepare(cfg, out_dir)  # the same model (same seed), data and settings, nothing run
    t, device = job.trainer, job.device
    with process.kept():  # TF32 and the thread settings back as they were
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = t.tf32
        model = job.model.to(device)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.01, fused=True)
        half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(t.precision.value)
        scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)
        loss_fn = losses.get(job.data.loss).torch
        total = torch.zeros((), device=device)

        def batch(step: int):
            x, y = job.train_batch(step)
            if device.type == "cuda":
                x, y = x.pin_memory(), y.pin_memory()
            return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

        began = 0.0
        for step in range(1, t.max_steps + 1):
            if step == WARMUP + 1:
                synchronize(device)
                began = time.perf_counter()
            x, y = batch(step)
            with torch.autocast(device.type, dtype=half, enabled=half is not None):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
        synchronize(device)
        elapsed = time.perf_counter() - began
        assert torch.isfinite(total), "the hand-written loop diverged"
    return 1000.0 * elapsed / (t.max_steps - WARMUP)


def check_syncs(cfg, out_dir: Path) -> str:
    """Run orchestrate's loop with every step after the first window that reads nothing back
    under set_sync_debug_mode("error"); '' when no such step synchronized, else what did."""
    job = Job.prepare(cfg, out_dir)
    meter, steps = job.meter, job.meter.steps

    def watched(start: int = 1):
        try:
            for step in steps(start):
                quiet = step > WARMUP and not meter.reads(step)
                torch.cuda.set_sync_debug_mode("error" if quiet else "default")
                yield step
        finally:
            torch.cuda.set_sync_debug_mode("default")

    meter.steps = watched
    try:
        with process.kept():
            job.backend.fit(job)
    except RuntimeError as e:
        return f"step {meter.step}: {str(e).splitlines()[0]}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 500 small, 300 large)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--check-syncs", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run it on a GPU machine (scripts/gpu_check.sh), or try the script itself "
              "with --device cpu", file=sys.stderr)
        return 2
    if args.device == "cpu" and set(args.precisions) - {"fp32"}:
        print("--device cpu trains in fp32 only: --precisions fp32", file=sys.stderr)
        return 2

    print(f"# {machine()}; torch {torch.__version__}; commit {commit()}; "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    failed = False
    runs = {"orchestrate": orchestrate, "hand": hand}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.check_syncs:
            for model in args.models:
                for precision in args.precisions:
                    found = check_syncs(config(model, precision, args.device, args.steps or 100, tmp), Path(tmp) / "sync")
                    failed |= bool(found)
                    print(f"{'FAIL' if found else 'OK  '}  host syncs between reading steps, {model} "
                          f"{PRECISIONS[precision][0]}: {found or 'none'}", flush=True)
        for model in args.models:
            for precision in args.precisions:
                got: dict[str, list[float]] = {who: [] for who in runs}
                for rep in range(args.repeats):
                    for who in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
                        cfg = config(model, precision, args.device, args.steps, tmp)
                        got[who].append(runs[who](cfg, Path(tmp) / f"{model}-{precision}-{who}-{rep}"))
                        print(f"# {model} {precision} {who} repeat {rep}: {got[who][-1]:.2f} ms a step",
                              file=sys.stderr, flush=True)
                mine, theirs = statistics.median(got["orchestrate"]), statistics.median(got["hand"])
                rows.append((model, precision, mine, theirs))

    print("\n| model | precision | orchestrate ms/step | hand (fast) ms/step | hand / orchestrate | target | met |")
    print("|---|---|---:|---:|---:|---:|:--:|")
    for model, precision, mine, theirs in rows:
        ratio = theirs / mine
        print(f"| {MODELS[model][0]} | {PRECISIONS[precision][0]} | {mine:.2f} | {theirs:.2f} | {ratio:.2f} | "
              f"{TARGET} | {'yes' if ratio >= TARGET else 'no'} |")
    steps = {(model, precision): mine for model, precision, mine, _ in rows}
    for model in args.models:
        if (model, "bf16") in steps and (model, "fp16") in steps:
            bf16, fp16 = steps[model, "bf16"], steps[model, "fp16"]
            print(f"{model}: orchestrate bf16 {bf16:.2f} ms, fp16 {fp16:.2f} ms a step: bf16 at most fp16: "
                  f"{'yes' if bf16 <= fp16 else 'no'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
