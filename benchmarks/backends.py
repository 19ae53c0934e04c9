"""The single-process backends side by side on the same task, in one process, as users run them
(through `orchestrate.app.train`, default settings, MLflow on a throwaway SQLite store): plain
PyTorch, torch.compile, ORTModule and the on-device API.

    python benchmarks/backends.py                         # digits MLP, batch 64, AdamW
    python benchmarks/backends.py --steps 3000 --repeats 5
    python benchmarks/backends.py --overrides model=char_transformer data=python_source trainer.batch_size=16
    python benchmarks/backends.py --models mlp cnn char_transformer --plot docs/backends.png
    python benchmarks/backends.py --budget --models cnn --data disk --busy 2   # the CPU budget rule

`--budget` measures the CPU budget rule (orchestrate/cpu.py) instead: every backend at the rule,
at its library's own default (PyTorch's or ORT's threads, one per core; on disk data 2 loader
processes, orchestrate's default before the rule) and at each fixed thread count from 1 to the
cores (the loader at the rule's count), and says whether the rule is the fastest or within 5% of
the fastest fixed setting. `--data disk` reads the digits as PNG files decoded in a Dataset's
`__getitem__` (benchmarks/png_digits.py) instead of from memory; `--busy N` keeps N other
CPU-bound processes running meanwhile (a machine shared with other work).

Runs are interleaved (torch, compile, ortmodule, ondevice, torch, ...) so that drift on a shared
machine hits every backend alike; the table shows the median of the repeats and the ratio to
torch. Each run leaves the process as it found it (orchestrate.process), so torch runs with
PyTorch's default threads even right after ORTModule set one; the script checks that before every
run. Compile time is its own column (`compile_s`: the compiled backend's first step); samples/s
and step times leave the first display window out, on every backend. "s to eval loss" is the time
from the run's start (compile, export and graph builds included) to its first evaluation at or
below the level every backend reached: what a user waits for the same model quality.

The table's head names where and when it was measured: the machine (CPU model and cores, the GPU
if torch sees one), the load average before the runs (an idle 2-core machine shows well under 1),
Python, torch and ORT versions, the date and the commit of the checkout. Its last column holds the
targets: the ratios the defaults are meant to reach on the default task, met or not in this run;
they are goals, not results.
"""

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import png_digits  # benchmarks/png_digits.py: --data disk
import torch
from mlflow.tracking import MlflowClient

from orchestrate import app, cpu, ort
from orchestrate.config import load_config

BACKENDS = ["torch", "compile", "ortmodule", "ondevice"]
# The shipped models with the data they are made for, and steps that keep a run to about a minute
# on 2 cores (`--models`); the character transformer at batch 16, as experiment=char_lm trains it.
MODELS = {
    "mlp": (["model=mlp", "data=digits"], 2000),
    "cnn": (["model=cnn", "data=digits"], 1000),
    "char_transformer": (["model=char_transformer", "data=python_source", "trainer.batch_size=16"], 200),
}
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


def seconds_to(client: MlflowClient, run_id: str, level: float) -> float | None:
    """Seconds from the run's start to its first eval/loss at or below `level`."""
    start = client.get_run(run_id).info.start_time
    for m in sorted(client.get_metric_history(run_id, "eval/loss"), key=lambda m: m.step):
        if m.value <= level:
            return (m.timestamp - start) / 1000
    return None


def measure(overrides: list[str], steps: int, repeats: int, arms: dict[str, list[str]], tmp: str, label: str) -> dict:
    """Every arm (a name and its overrides: a backend, a thread count) `repeats` times,
    interleaved: each arm's medians (samples/s, step ms, compile s, s to the common eval loss),
    its last run's losses and the CPU budget it ran with (its run's cpu.* params)."""
    runs: dict[str, list] = {b: [] for b in arms}
    threads = torch.get_num_threads()
    store = f"sqlite:///{tmp}/bench.db"
    for rep in range(repeats):
        for arm, arm_overrides in arms.items():
            cfg = load_config([*arm_overrides, f"trainer.max_steps={steps}", "trainer.progress=false",
                               f"trainer.evaluation_period={max(steps // 10, 1)}", "trainer.checkpoint_period=0",
                               f"trainer.display_loss_steps={max(steps // 20, 1)}", f"tracking.uri={store}",
                               "tracking.experiment=benchmark", "tracking.log_checkpoints=false", *overrides])
            assert torch.get_num_threads() == threads, "an earlier run left its thread count behind"
            runs[arm].append(app.train(cfg, Path(tmp) / f"{label}-{arm.replace(' ', '_')}-{rep}"))
    client = MlflowClient(store)
    # The level every backend's runs reached: the worst of their best evaluations.
    level = max(min(v for _, v in r.history["eval/loss"]) for rs in runs.values() for r in rs)
    found = {}
    for backend, rs in runs.items():
        reached = [t for r in rs if (t := seconds_to(client, r.run_id, level)) is not None]
        found[backend] = {
            "samples_per_sec": statistics.median(r.metrics["samples_per_sec"] for r in rs),
            "step_time_ms": statistics.median(r.metrics["step_time_ms"] for r in rs),
            "compile_s": statistics.median(r.metrics["compile_s"] for r in rs) if "compile_s" in rs[0].metrics else None,
            "to_level_s": statistics.median(reached) if reached else None,
            "train_loss": rs[-1].metrics["train_loss"], "eval_loss": rs[-1].metrics.get("eval_loss", float("nan")),
            "level": level, "params": client.get_run(rs[-1].run_id).data.params,
        }
    return found


@contextlib.contextmanager
def busy(count: int):
    """`count` CPU-bound processes (a loop in Python each) running for as long as the block."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait(timeout=30)


def budget_arms(backend: str, cores: int, disk: bool, busy: int) -> tuple[dict[str, list[str]], int]:
    """A backend's settings to compare: the budget rule, its library's default, and each fixed
    thread count from 1 to `cores` but the rule's own (the loader at the rule's count), `busy`
    cores taken by other processes; and the rule's thread count."""
    rule = cpu.split(cores, "", reads_ahead=disk, busy=busy).threads
    arms = {f"{backend}|rule": [f"backend={backend}"],
            f"{backend}|library default": [f"backend={backend}", "backend.intra_op_threads=0",
                                           *(["+data.num_workers=2"] if disk else [])]}
    arms.update({f"{backend}|{t} thread(s)": [f"backend={backend}", f"backend.intra_op_threads={t}"]
                 for t in range(1, cores + 1) if t != rule})
    return arms, rule


def budget_main(args) -> None:
    """--budget: the rule against the library defaults and the fixed thread counts, for every
    backend, task, data source and load; the table, and a plot with --plot."""
    where = machine()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cores, source = cpu.cores()
    models = args.models or ["cnn"]
    results = {}  # (model, data, busy) -> arm -> measure()'s figures
    with tempfile.TemporaryDirectory() as tmp:
        png = png_digits.write(Path(tmp) / "png_digits")
        for backend in args.backends:  # first uses paid here (imports, extensions, compiler workers)
            app.train(load_config([f"backend={backend}", "data=synthetic", "trainer=quick", "trainer.max_steps=6",
                                   "trainer.progress=false", f"tracking.uri=sqlite:///{tmp}/warm_up.db"]),
                      Path(tmp) / f"warm_up-{backend}")
        for model in models:
            overrides, steps = MODELS[model][0] + args.overrides, args.steps or MODELS[model][1]
            for data in args.data:
                if data == "disk":
                    if "data=digits" not in overrides:
                        raise SystemExit(f"--data disk: the digits as PNG files, for a model on data=digits; not {model}")
                    overrides = [*overrides, "data._target_=png_digits.PngDigits", f"+data.root={png}"]
                for load in args.busy:
                    with busy(load):
                        taken = round(cpu.busy_elsewhere(0.5))  # the rule's own view of the load
                        arms, rules = {}, {}
                        for backend in args.backends:
                            found, rules[backend] = budget_arms(backend, cores, data == "disk", taken)
                            arms.update(found)
                        print(f"{model}, {data}, {load} busy process(es): {len(arms)} settings x {args.repeats}",
                              flush=True)
                        results[model, data, load] = (measure(overrides, steps, args.repeats, arms, tmp,
                                                              f"{model}-{data}-{load}"), rules, steps)
    print(f"\nmachine   {where}")
    print(f"software  Python {platform.python_version()}, torch {torch.__version__}, "
          f"onnxruntime {ort.load().__version__}")
    print(f"measured  {when}, commit {commit()}")
    print(f"{cores} cores ({source}); {args.repeats} interleaved repeats, medians. The rule: orchestrate/cpu.py; "
          "library default: PyTorch's or ORT's own threads (one per core), on disk data 2 loader processes")
    print("| model | data | busy | backend | setting | CPU: threads + loader of cores | samples/s | step ms | "
          "vs fastest fixed | rule within 5% |")
    print("|---|---|---:|---|---|---|---:|---:|---:|---|")
    verdicts = {}
    for (model, data, load), (table, rules, _steps) in results.items():
        for backend in args.backends:
            mine = {arm.split("|")[1]: r for arm, r in table.items() if arm.startswith(f"{backend}|")}
            fixed = {name: r for name, r in mine.items() if name != "library default"}  # the rule is one of them
            best = max(r["samples_per_sec"] for r in fixed.values())
            ratio = mine["rule"]["samples_per_sec"] / best
            verdicts[model, data, load, backend] = (ratio, mine["library default"]["samples_per_sec"] / best)
            for name, r in mine.items():
                shown = f"rule ({rules[backend]} thread(s))" if name == "rule" else name
                cell = cpu.shown(r["params"])
                verdict = ("yes" if ratio >= 0.95 else f"no ({ratio:.2f}x)") if name == "rule" else ""
                print(f"| {model} | {data} | {load} | {backend} | {shown} | {cell} | {r['samples_per_sec']:,.0f} | "
                      f"{r['step_time_ms']:.3f} | {r['samples_per_sec'] / best:.2f}x | {verdict} |")
    if args.plot:
        budget_plot(verdicts, args.backends, args.plot, f"{where}; {when}, commit {commit()}")
        print(f"plot: {args.plot}")


def budget_plot(verdicts: dict, backends: list[str], path: Path, title: str) -> None:
    """Per scenario (model, data, load) and backend: the rule's and the library default's
    samples/s against the fastest fixed thread count's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(key[:3] for key in verdicts))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(3.2 * len(scenarios) + 1, 4), sharey=True, squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        xs = range(len(backends))
        rule = [verdicts[(*scenario, b)][0] for b in backends]
        default = [verdicts[(*scenario, b)][1] for b in backends]
        ax.bar([x - 0.2 for x in xs], rule, 0.4, label="budget rule", color="C0")
        ax.bar([x + 0.2 for x in xs], default, 0.4, label="library default", color="C3")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.95, color="black", linewidth=0.8, linestyle=":")
        ax.set_xticks(list(xs), backends, rotation=30)
        ax.set_title(f"{scenario[0]}, {scenario[1]}, {scenario[2]} busy", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("samples/s, x the fastest fixed thread count")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(tables: dict[str, dict], path: Path, title: str) -> None:
    """Samples/s against torch's and seconds to the common eval loss, per model and backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    models = list(tables)
    backends = list(next(iter(tables.values())))
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        xs = [m + (i - (len(backends) - 1) / 2) * width for m in range(len(models))]
        ratio = [tables[m][backend]["samples_per_sec"] / tables[m]["torch"]["samples_per_sec"] for m in models]
        axes[0].bar(xs, ratio, width, label=backend, color=f"C{i}")
        waits = [tables[m][backend]["to_level_s"] or 0.0 for m in models]
        compiles = [tables[m][backend]["compile_s"] or 0.0 for m in models]
        axes[1].bar(xs, waits, width, label=backend, color=f"C{i}")  # the same colour on both panels
        axes[1].bar(xs, compiles, width, fill=False, hatch="//", edgecolor="black", linewidth=0)
    for ax, ylabel in zip(axes, ["samples/s, x torch's (steady steps)", "s to the common eval loss (hatched: compile)"]):
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the model's, MODELS)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=BACKENDS)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                        help="shipped models, each with its data (default: the digits MLP, or --overrides)")
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--plot", type=Path, default=None, help="also draw the table as a PNG here")
    parser.add_argument("--budget", action="store_true",
                        help="measure the CPU budget rule against library defaults and fixed thread counts")
    parser.add_argument("--data", nargs="+", choices=["memory", "disk"], default=["memory"],
                        help="the digits from memory, or as PNG files decoded by the loader (--budget: each)")
    parser.add_argument("--busy", nargs="+", type=int, default=[0],
                        help="N other CPU-bound processes running meanwhile (--budget: each)")
    args = parser.parse_args()
    if args.budget:
        budget_main(args)
        return

    where = machine()  # before the runs: the load average says whether the machine was idle
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    tasks = {m: (MODELS[m][0] + args.overrides, args.steps or MODELS[m][1]) for m in args.models} if args.models \
        else {" ".join(args.overrides) or "mlp": (args.overrides or MODELS["mlp"][0], args.steps or MODELS["mlp"][1])}
    tables = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Each backend's first use in this process (imports, ORTModule's extensions, Inductor's
        # compiler workers) is paid here, not by the first model's runs.
        for backend in args.backends:
            app.train(load_config([f"backend={backend}", "data=synthetic", "trainer=quick", "trainer.max_steps=6",
                                   "trainer.progress=false", f"tracking.uri=sqlite:///{tmp}/warm_up.db"]),
                      Path(tmp) / f"warm_up-{backend}")
        for label, (overrides, steps) in tasks.items():
            tables[label] = measure(overrides, steps, args.repeats, {b: [f"backend={b}"] for b in args.backends}, tmp,
                                    label.replace(" ", "_"))

    print(f"\nmachine   {where}")
    print(f"software  Python {platform.python_version()}, torch {torch.__version__}, "
          f"onnxruntime {ort.load().__version__}")
    print(f"measured  {when}, commit {commit()}")
    budgets = {cpu.shown(r["params"]) for table in tables.values() for r in table.values()}
    print(f"{args.repeats} interleaved repeats, medians; every backend on the CPU budget rule (orchestrate/cpu.py), "
          f"threads + loader processes of cores: {', '.join(sorted(budgets))}")
    print("| model | steps | backend | samples/s | vs torch | step ms | compile s | s to eval loss <= level | "
          "final train loss | eval loss | target (a goal, not a result) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, table in tables.items():
        base = table["torch"]["samples_per_sec"] if "torch" in table else float("nan")
        for backend, r in table.items():
            ratio = r["samples_per_sec"] / base
            # The targets are for the default task (digits MLP); other tasks print none.
            target = ""
            if backend in TARGETS and label == "mlp" and not args.overrides:
                target = f">= {TARGETS[backend]:.2f}x: {'met' if ratio >= TARGETS[backend] else 'not met'}"
            compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
            to_level = "-" if r["to_level_s"] is None else f"{r['to_level_s']:.1f} (<= {r['level']:.4f})"
            print(f"| {label} | {tasks[label][1]} | {backend} | {r['samples_per_sec']:,.0f} | {ratio:.2f}x | "
                  f"{r['step_time_ms']:.3f} | {compile_s} | {to_level} | {r['train_loss']:.4f} | "
                  f"{r['eval_loss']:.4f} | {target} |")
    if args.plot:
        plot(tables, args.plot, f"{where}; {when}, commit {commit()}")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
