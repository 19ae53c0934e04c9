"""Start-up: how long `python -m orchestrate backend=torch trainer.max_steps=1` takes, against the
floor of importing what it needs, and where the time goes.

    python benchmarks/startup.py                   # 5 repeats, a markdown table, docs/startup.png
    python benchmarks/startup.py --repeats 9 --overrides backend=ondevice

Three commands are timed alternately (so that drift on a shared machine hits them alike), each in a
fresh process, in a fresh folder with its own MLflow store:
  - floor:   `python -c "import torch, sklearn.datasets, mlflow, hydra"` (the issue's floor), and
             the same plus torch._dynamo (which every torch optimizer imports on construction);
  - command: the real command line, as users run it;
  - phases:  the same command in a child of this script that first imports every module the
             command ends up importing (the "imports" phase), then runs `orchestrate.cli.main`
             with timers around the functions that make up each phase. The timers are this
             script's: orchestrate itself is unchanged. Times are exclusive (a phase nested in
             another is taken out of it); what no timer covers is "other".
"""

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "import torch, sklearn.datasets, mlflow, hydra"
FLOOR_DYNAMO = FLOOR + ", torch._dynamo"
COMMAND = ["backend=torch", "trainer.max_steps=1"]
PHASES = ["imports", "composition", "up-front check", "MLflow set-up", "environment capture", "model build",
          "training (first step)", "shutdown", "other"]


# ---- the child: one command with phase timers ------------------------------------------------

class Timers:
    """Exclusive wall time per phase: entering a phase pauses the one it is nested in."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {p: 0.0 for p in PHASES}
        self.stack: list[tuple[str, float]] = []

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        if self.stack:
            outer, since = self.stack[-1]
            self.spent[outer] += now - since
        self.stack.append((phase, now))

    def leave(self) -> None:
        now = time.perf_counter()
        phase, since = self.stack.pop()
        self.spent[phase] += now - since
        if self.stack:
            self.stack[-1] = (self.stack[-1][0], now)

    def wrap(self, owner, name: str, phase) -> None:
        """Time owner.name as `phase` (a name, or a function of the timer stack giving one)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            self.enter(phase(self.stack) if callable(phase) else phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, name, timed)


def child(argv: list[str], modules_file: Path, result_file: Path) -> None:
    began = time.perf_counter()
    timers = Timers()
    timers.enter("imports")
    for name in json.loads(modules_file.read_text()):
        with contextlib.suppress(Exception):
            __import__(name)
    timers.leave()

    import hydra._internal.hydra

    from orchestrate import cli, job
    from orchestrate.backends.torch import TorchBackend
    from orchestrate.tracking import run

    in_check = lambda stack: "up-front check" if any(p == "up-front check" for p, _ in stack) else "model build"
    timers.wrap(cli, "validate", "up-front check")
    timers.wrap(hydra._internal.hydra.Hydra, "compose_config", "composition")
    timers.wrap(job.Job, "prepare", in_check)
    timers.wrap(run.Run, "__init__", "MLflow set-up")
    timers.wrap(run, "installed_packages", "environment capture")
    timers.wrap(run.Run, "__exit__", "shutdown")
    timers.wrap(TorchBackend, "fit", "training (first step)")
    sys.argv = ["orchestrate", *argv]
    try:
        cli.main()
    finally:
        total = time.perf_counter() - began
        timers.spent["other"] = total - sum(timers.spent.values())
        result_file.write_text(json.dumps({"total": total, **timers.spent}))


# ---- the parent ------------------------------------------------------------------------------

def timed(cmd: list[str], cwd: Path) -> float:
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - began


def imported_modules(argv: list[str], folder: Path) -> list[str]:
    """The modules the command imports, in the order it first imports them."""
    out = folder / "modules.json"
    code = (f"import atexit, json, sys; atexit.register(lambda: open({str(out)!r}, 'w').write(json.dumps("
            f"[m for m in sys.modules if not m.startswith('__')]))); sys.argv = ['orchestrate', *{argv!r}]; "
            "from orchestrate.cli import main; main()")
    subprocess.run([sys.executable, "-c", code], cwd=folder, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--png", default=str(ROOT / "docs" / "startup.png"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return child(rest, Path(args.child[0]), Path(args.child[1]))

    argv = [*COMMAND, "trainer.progress=false", *args.overrides]
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "modules.json").write_text(json.dumps(imported_modules(argv, tmp)))
        floor, floor_dynamo, command, phases = [], [], [], []
        for rep in range(args.repeats):
            folder = tmp / f"run{rep}"
            folder.mkdir()
            floor.append(timed([py, "-c", FLOOR], folder))
            floor_dynamo.append(timed([py, "-c", FLOOR_DYNAMO], folder))
            command.append(timed([py, "-m", "orchestrate", *argv], folder))
            result = folder / "phases.json"
            (folder / "p").mkdir()
            timed([py, __file__, "--child", str(tmp / "modules.json"), str(result), *argv], folder / "p")
            phases.append(json.loads(result.read_text()))
            print(f"repeat {rep + 1}/{args.repeats}: floor {floor[-1]:.2f} s, command {command[-1]:.2f} s",
                  file=sys.stderr, flush=True)

    med = statistics.median
    shown = " ".join(["python -m orchestrate", *argv])
    print(f"\n`{shown}`: median of {args.repeats}, {os.cpu_count()} CPUs\n")
    print("| what | s | vs floor |")
    print("|---|---:|---:|")
    base = med(floor)
    for label, values in [(f"floor: `{FLOOR}`", floor), ("floor + torch._dynamo", floor_dynamo),
                          ("the command", command)]:
        print(f"| {label} | {med(values):.2f} | {med(values) / base:.2f}x |")
    print("\n| phase (in-process timers) | s | share |")
    print("|---|---:|---:|")
    total = med(p["total"] for p in phases)
    for phase in PHASES:
        value = med(p[phase] for p in phases)
        print(f"| {phase} | {value:.2f} | {value / total:.0%} |")
    print(f"| total (timed child) | {total:.2f} | |")
    print(f"\ntime to the first step's end: {med(p['total'] - p['shutdown'] - p['other'] for p in phases):.2f} s; "
          f"after the imports: {med(p['total'] - p['imports'] - p['shutdown'] - p['other'] for p in phases):.2f} s")
    plot(phases, args.png, shown)


def plot(phases: list[dict], png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    left = 0.0
    for phase in PHASES:
        value = statistics.median(p[phase] for p in phases)
        ax.barh([0], [value], left=left, label=f"{phase} {value:.2f} s")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"\nwrote {png}")


if __name__ == "__main__":
    main()
