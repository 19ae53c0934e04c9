"""The three backends side by side on the same task, in one process, as users run them
(through `orchestrate.app.train`, default settings, MLflow on a throwaway SQLite store).

    python benchmarks/backends.py                         # digits MLP, batch 64, AdamW
    python benchmarks/backends.py --steps 3000 --repeats 5
    python benchmarks/backends.py --overrides model=char_transformer data=python_source trainer.batch_size=16

Runs are interleaved (torch, ortmodule, ondevice, torch, ...) so that drift on a shared machine
hits every backend alike; the table shows the median of the repeats and the ratio to torch. Each
run leaves the process as it found it (orchestrate.process), so torch runs with PyTorch's default
threads even right after ORTModule set one; the script checks that before every run.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from orchestrate import app
from orchestrate.config import load_config

BACKENDS = ["torch", "ortmodule", "ondevice"]
TARGETS = {"ondevice": 1.5, "ortmodule": 0.9}  # the speed the defaults must reach, relative to torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=BACKENDS)
    parser.add_argument("--overrides", nargs="*", default=[])
    args = parser.parse_args()

    results: dict[str, list[dict]] = {b: [] for b in args.backends}
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for backend in args.backends:
                overrides = [f"backend={backend}", f"trainer.max_steps={args.steps}", "trainer.progress=false",
                             "trainer.evaluation_period=0", "trainer.checkpoint_period=0",
                             "trainer.display_loss_steps=100", f"tracking.uri=sqlite:///{tmp}/bench.db",
                             "tracking.experiment=benchmark", "tracking.log_checkpoints=false", *args.overrides]
                cfg = load_config(overrides)
                assert torch.get_num_threads() == threads, "an earlier run left its thread count behind"
                results[backend].append(app.train(cfg, Path(tmp) / f"{backend}-{rep}").metrics)

    base = statistics.median(r["samples_per_sec"] for r in results.get("torch", [{"samples_per_sec": float("nan")}]))
    print(f"\n{args.steps} steps x {args.repeats} repeats, {' '.join(args.overrides) or 'digits MLP, batch 64, AdamW'}; "
          f"torch with PyTorch's default {threads} threads, ortmodule and ondevice with their configured ORT threads")
    print(f"{'backend':<10} {'samples/s':>10} {'step ms':>8} {'vs torch':>9} {'target':>7} {'final loss':>10} {'eval acc':>9}")
    for backend, runs in results.items():
        sps = statistics.median(r["samples_per_sec"] for r in runs)
        ms = statistics.median(r["step_time_ms"] for r in runs)
        # The targets are for the default task (digits MLP); other tasks print no target.
        target = f">={TARGETS[backend]}x" if backend in TARGETS and not args.overrides else ""
        print(f"{backend:<10} {sps:>10,.0f} {ms:>8.3f} {sps / base:>8.2f}x {target:>7} "
              f"{runs[-1]['train_loss']:>10.4f} {runs[-1].get('eval_accuracy', float('nan')):>9.4f}")


if __name__ == "__main__":
    main()
