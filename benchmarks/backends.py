"""The three backends side by side on the same task, in one process, as users run them
(through `orchestrate.app.train`, default settings, MLflow on a throwaway SQLite store).

    python benchmarks/backends.py                         # digits MLP, batch 64, AdamW
    python benchmarks/backends.py --steps 3000 --repeats 5
    python benchmarks/backends.py --overrides model=char_transformer data=python_source trainer.batch_size=16

Runs are interleaved (torch, ortmodule, ondevice, torch, ...) so that drift on a shared machine
hits every backend alike; the table shows the median of the repeats and the ratio to torch. Each
run leaves the process as it found it (orchestrate.process), so torch runs with PyTorch's default
threads even right after ORTModule set one; the script checks that before every run.

The table's head names where and when it was measured: the machine (CPU model and cores, the GPU
if torch sees one), the load average before the runs (an idle 2-core machine shows well under 1),
Python, torch and ORT versions, the date and the commit of the checkout. Its last column holds the
targets: the ratios the defaults are meant to reach on the default task, met or not in this run;
they are goals, not results.
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from orchestrate import app, ort
from orchestrate.config import load_config

BACKENDS = ["torch", "ortmodule", "ondevice"]
# Targets, not results: the speed the defaults are meant to reach on the digits MLP, relative to torch.
TARGETS = {"ondevice": 1.5, "ortmodule": 0.9}
CHECKOUT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (/proc/cpuinfo), else what Python's platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    return f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()}){gpu}{load}"


def commit() -> str:
    """The checkout's commit, with '+ uncommitted changes' when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return (head or "unknown (not a git checkout)") + (" + uncommitted changes" if head and dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=BACKENDS)
    parser.add_argument("--overrides", nargs="*", default=[])
    args = parser.parse_args()

    results: dict[str, list[dict]] = {b: [] for b in args.backends}
    threads = torch.get_num_threads()
    where = machine()  # before the runs: the load average says whether the machine was idle
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
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
    print(f"\nmachine   {where}")
    print(f"software  Python {platform.python_version()}, torch {torch.__version__}, "
          f"onnxruntime {ort.load().__version__}")
    print(f"measured  {when}, commit {commit()}")
    print(f"{args.steps} steps x {args.repeats} repeats, {' '.join(args.overrides) or 'digits MLP, batch 64, AdamW'}; "
          f"torch with PyTorch's default {threads} threads, ortmodule and ondevice with their configured ORT threads")
    print(f"{'backend':<10} {'samples/s':>10} {'step ms':>8} {'vs torch':>9} {'final loss':>10} {'eval acc':>9}  "
          "target (a goal, not a result)")
    for backend, runs in results.items():
        sps = statistics.median(r["samples_per_sec"] for r in runs)
        ms = statistics.median(r["step_time_ms"] for r in runs)
        # The targets are for the default task (digits MLP); other tasks print none.
        target = ""
        if backend in TARGETS and not args.overrides:
            target = f">= {TARGETS[backend]:.2f}x: {'met' if sps / base >= TARGETS[backend] else 'not met'}"
        print(f"{backend:<10} {sps:>10,.0f} {ms:>8.3f} {sps / base:>8.2f}x "
              f"{runs[-1]['train_loss']:>10.4f} {runs[-1].get('eval_accuracy', float('nan')):>9.4f}  {target}".rstrip())


if __name__ == "__main__":
    main()
