"""Large pruned sweeps on a multi-node Ray cluster: does the sweep keep every slot busy, does every
trial's every metric arrive, and does anything in the driver grow with the trial count?

    python scripts/scale.py --screenshot             # 200 and 1,000 short trials on 4 loopback nodes:
                                                     #   docs/scale.md, docs/scale.png, docs/scale_mlflow_runs.png
    python -m scripts.scale --hosts                  # the same on test hosts that share nothing (as root):
                                                     #   docs/scale_hosts.md
    python scripts/scale.py --trials 24 --out /tmp/scale.json   # a smaller one, figures as JSON

Loopback: Ray's own `ray.cluster_utils.Cluster` on 127.0.0.1, a head with no CPUs and `--nodes`
nodes of `--cpus-per-node` CPUs; the study in the PostgreSQL of an `orchestrate server` started
here (which also serves MLflow). `--hosts`: the test hosts (tests/hosts.py: network and mount
namespaces of this machine), a head with no CPUs on the driver's host and a node on each of
`--nodes` other hosts; the sweep's own SQLite store and study on the driver's host, served to the
trials by the sweep (orchestrate.sweeps.remote). A trial takes one CPU: nodes x cpus-per-node
slots. Each `--trials` count is one sweep (an Optuna one with a pruner, successive halving, its
trials on the cluster through the Ray launcher), with a store of its own. Read back through
MlflowClient and from the command's own output:

- wall time (the command, start to exit) against the ideal, trials x mean trial time / slots,
  for two trial times: the trial's job on its worker (its start there to its result, the
  launcher's `COMPLETED in ... s on its worker` line) and the trial's MLflow run (its start to its
  end: without the set-up before the run opens);
- occupancy: busy slots / slots over time, from each trial's MLflow start and end;
- the driver (the command's process): its memory (RSS) and CPU time over the sweep, sampled every
  second against the trials done; its growth per 100 trials over the second half;
- the end: the summary printed, the parent run closed and the command's exit, each after the last
  trial's result;
- the store's size (database and artifacts) per trial;
- every trial FINISHED, and each one's `train/loss` logged at every display step up to where it
  stopped (its `pruned_at`, or the last step) exactly once.

With `--screenshot`, the MLflow runs page of the largest sweep (the parent expanded over its
trials) is saved by scripts/mlflow_ui_screenshot.py (Chromium, Playwright).

Targets (issues 33, 55): wall within 1.15x the ideal, the summary within 5 s of the last trial, no
per-trial growth of the driver's memory beyond what the summary keeps.
"""

import argparse
import collections
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Every port a node opens on 127.0.0.1, and Ray's clients keep that address (orchestrate.cluster.ray_cluster).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
SWEEP_TIMEOUT_S = 3 * 3600
SAMPLE_S = 1.0
WALL_TARGET, SUMMARY_TARGET_S = 1.15, 5.0
COMPLETED = re.compile(r"#(\d+) : .* COMPLETED in ([\d.]+) s on its worker")


def load_script(name: str):
    """scripts/<name>.py, loaded from its file (the scripts are files, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
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


def sweep_command(args, trials: int, address: str, tracking: list[str]) -> list[str]:
    return [sys.executable, "-m", "orchestrate", "-m", "hydra/sweeper=orchestrate_optuna",
            "hydra/sweeper/pruner=successive_halving", f"hydra.sweeper.n_trials={trials}",
            "hydra.sweeper.sampler.seed=0", "optimizer.lr=tag(log, interval(0.0001, 0.1))",
            f"hydra.launcher.address={address}", "hydra.launcher.cpus_per_trial=1", *tracking,
            "backend=torch", "backend.intra_op_threads=1", "data=synthetic", "trainer=quick",
            f"trainer.max_steps={args.steps}", f"trainer.evaluation_period={args.eval_every}",
            "trainer.display_loss_steps=5", "trainer.checkpoint_period=0", "tracking.log_checkpoints=false",
            "trainer.progress=false", f"model.hidden=[{args.width},{args.width}]",
            f"trainer.batch_size={args.batch_size}", "sweep.name=scale"]


class Watched:
    """A running sweep command: its output lines stamped as they come (written to `log`), and its
    process's memory and CPU time sampled every SAMPLE_S against the trials done so far."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        import psutil

        self.proc, self.began = proc, time.time()
        self.lines: list[tuple[float, str]] = []
        self.samples: list[tuple[float, int, float, int]] = []  # (time, trials done, CPU s, RSS bytes)
        self.trial_s: dict[int, float] = {}
        self._process = psutil.Process(proc.pid)
        self._reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._reader.start()
        self._sampler.start()

    def _read(self, log: Path) -> None:
        with log.open("w") as out:
            for line in self.proc.stdout:
                self.lines.append((time.time(), line))
                out.write(line)
                found = COMPLETED.search(line)
                if found:
                    self.trial_s[int(found.group(1))] = float(found.group(2))

    def _sample(self) -> None:
        import psutil

        while self.proc.poll() is None:
            try:
                cpu, rss = self._process.cpu_times(), self._process.memory_info().rss
            except psutil.Error:
                return
            self.samples.append((time.time(), len(self.trial_s), cpu.user + cpu.system, rss))
            time.sleep(SAMPLE_S)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        self._sampler.join(timeout=30)
        return code

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)


def run_sweep(args, trials: int, argv: list[str], popen, cwd: Path, env: dict, log: Path) -> tuple[Watched, float]:
    began = time.monotonic()
    proc = popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watched = Watched(proc, log)
    try:
        code = watched.wait(SWEEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    if code != 0:
        raise SystemExit(f"the {trials}-trial sweep exited {code}:\n{log.read_text()[-3000:]}")
    return watched, time.monotonic() - began


def loopback(args) -> list[dict]:
    """Each sweep on one loopback cluster, each with its own `orchestrate server` (its own store)."""
    import ray
    from mlflow.tracking import MlflowClient
    from ray.cluster_utils import Cluster

    concurrency = load_script("concurrency")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
    results = []
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus_per_node, node_ip_address="127.0.0.1")
        slots = args.nodes * args.cpus_per_node
        for trials in args.trials:
            folder = Path(tempfile.mkdtemp(prefix=f"scale-{trials}-", dir="/tmp"))
            os.chmod(folder, 0o755)  # PostgreSQL runs as its own user where this runs as root
            server, uri = concurrency.start_server(folder)
            try:
                print(f"{trials} trials: {args.nodes} nodes x {args.cpus_per_node} CPU = {slots} slots "
                      f"({cluster.address}); MLflow {uri}", flush=True)
                tracking = ["tracking=server", f"tracking.uri={uri}", f"hydra.sweeper.storage='{study_storage(folder)}'"]
                watched, wall = run_sweep(args, trials, sweep_command(args, trials, cluster.address, tracking),
                                          subprocess.Popen, folder, {**os.environ, "PYTHONUNBUFFERED": "1"},
                                          folder / "sweep.out")
                figures = read_back(MlflowClient(uri), args, trials, slots, wall, watched)
                figures["store_bytes"] = folder_bytes(folder / "server")
                figures["store_what"] = "PostgreSQL's data folder and the server's artifacts"
                if args.screenshot and trials == max(args.trials):
                    figures["screenshot"] = screenshot(uri, args.out.with_name(f"{args.out.stem}_mlflow_runs.png"))
                results.append(figures)
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=120)
            kept = shutil.copy(folder / "sweep.out", Path(tempfile.gettempdir()) / f"scale-{trials}-sweep.log")
            print(f"the sweep's output: {kept}", flush=True)
            shutil.rmtree(folder, ignore_errors=True)  # PostgreSQL's files: 100 MB a sweep
    finally:
        cluster.shutdown()
        if ray.is_initialized():
            ray.shutdown()
    return results


def on_hosts(args) -> list[dict]:
    """Each sweep from the driver's test host, its trials on `--nodes` other hosts; a SQLite store
    and study of the sweep's own (a project folder each) on the driver's host."""
    from mlflow.tracking import MlflowClient

    from tests.hosts import Hosts

    results = []
    with Hosts(args.nodes + 1, ray_cpus=args.cpus_per_node) as hosts:
        slots = args.nodes * args.cpus_per_node
        for trials in args.trials:
            project = hosts.folder / f"project-{trials}"
            project.mkdir()
            print(f"{trials} trials on test hosts: {args.nodes} hosts x {args.cpus_per_node} CPU = {slots} slots "
                  f"({hosts.ray_address})", flush=True)
            watched, wall = run_sweep(args, trials, sweep_command(args, trials, hosts.ray_address, []), hosts.head.popen,
                                      project, {**os.environ, **hosts.env, "PYTHONUNBUFFERED": "1"},
                                      hosts.folder / f"sweep-{trials}.out")
            figures = read_back(MlflowClient(f"sqlite:///{project / 'mlflow.db'}"), args, trials, slots, wall, watched)
            figures["store_bytes"] = folder_bytes(project, ("mlflow.db", "mlflow-optuna.db", "mlartifacts"))
            figures["store_what"] = "the SQLite store and study and the artifacts folder"
            with contextlib.closing(sqlite3.connect(project / "mlflow.db")) as db:
                figures["runs_in_store"] = db.execute("select count(*) from runs").fetchone()[0]
            results.append(figures)
    return results


def folder_bytes(folder: Path, names: tuple[str, ...] | None = None) -> int:
    paths = [folder / n for n in names] if names else [folder]
    return sum(f.stat().st_size for p in paths if p.exists()
               for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file() and not f.is_symlink())


def screenshot(uri: str, path: Path) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "mlflow_ui_screenshot.py"), "--server", uri,
                           "--experiment", "orchestrate", "--parent", "sweep-scale", "--out", str(path)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"the screenshot failed (exit {done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        return ""
    return path.name


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


def growth_per_100(samples: list[tuple[float, int, float, int]], index: int) -> float:
    """The least-squares slope of sample[index] against trials done, per 100 trials, over the
    samples of the second half of the trials (the start's imports and first allocations left out)."""
    done = max(s[1] for s in samples)
    half = [(s[1], s[index]) for s in samples if s[1] >= done / 2]
    if len(half) < 2 or len({x for x, _ in half}) < 2:
        return 0.0
    mx, my = sum(x for x, _ in half) / len(half), sum(y for _, y in half) / len(half)
    slope = sum((x - mx) * (y - my) for x, y in half) / sum((x - mx) ** 2 for x, _ in half)
    return 100 * slope


def at_trials(samples: list[tuple[float, int, float, int]], share: float) -> int:
    """The driver's RSS at the first sample with `share` of the trials done."""
    done = max(s[1] for s in samples)
    return next(s[3] for s in samples if s[1] >= share * done)


def read_back(client, args, trials: int, slots: int, wall: float, watched: Watched) -> dict:
    (experiment,) = [e for e in client.search_experiments() if e.name == "orchestrate"]
    runs = client.search_runs([experiment.experiment_id], max_results=50_000)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    (parent,) = [r for r in runs if r.data.tags.get("orchestrate.role") == "sweep"]
    intervals = [(r.info.start_time / 1000, r.info.end_time / 1000) for r in children if r.info.end_time]
    share, busy = occupancy(intervals, slots)
    lost = twice = 0
    for r in children:
        last = int(r.data.metrics.get("final/pruned_at", args.steps))
        expected = {s for s in range(5, last + 1, 5)} | {last}
        logged = collections.Counter(m.step for m in client.get_metric_history(r.info.run_id, "train/loss"))
        lost += len(expected - set(logged))
        twice += sum(n - 1 for n in logged.values() if n > 1)
    first, last_end = min(s for s, _ in intervals), max(e for _, e in intervals)
    run_s = [e - s for s, e in intervals]
    launched_s = list(watched.trial_s.values())
    last_result = max(t for t, line in watched.lines if COMPLETED.search(line))
    summary = watched.first("sweep summary (")
    samples = watched.samples
    return {
        "trials": len(children), "asked": trials, "finished": sum(r.info.status == "FINISHED" for r in children),
        "pruned": sum("pruned" in r.data.tags for r in children), "slots": slots, "wall_s": wall,
        "head_s": first - watched.began, "tail_s": watched.began + wall - last_end,
        "mean_trial_s": sum(launched_s) / len(launched_s), "mean_run_s": sum(run_s) / len(run_s),
        "ideal_s": sum(launched_s) / slots, "ideal_run_s": sum(run_s) / slots,
        "wall_over_ideal": wall / (sum(launched_s) / slots), "wall_over_ideal_run": wall / (sum(run_s) / slots),
        "occupancy": share, "span_s": last_end - first,
        "gap_s": (slots * (last_end - first) - sum(run_s)) / len(intervals),
        "summary_after_s": summary - last_result if summary else None,
        "parent_closed_after_s": parent.info.end_time / 1000 - last_result if parent.info.end_time else None,
        "exit_after_s": watched.began + wall - last_result,
        "driver_rss_mb": {f"{p:.0%}": at_trials(samples, p) / 2**20 for p in (0.1, 0.5, 1.0)},
        "driver_peak_rss_mb": max(s[3] for s in samples) / 2**20,
        "driver_rss_mb_per_100_trials": growth_per_100(samples, 3) / 2**20,
        "driver_cpu_s": samples[-1][2], "driver_cpu_s_per_trial": samples[-1][2] / trials,
        "driver_cpu_s_per_100_trials_late": growth_per_100(samples, 2),
        "lost": lost, "twice": twice, "busy": busy,
        "memory": [(s[1], s[3] / 2**20) for s in samples],
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2))
    for figures in results:
        t, busy = zip(*figures["busy"])
        left.step(t, busy, where="post", linewidth=0.8, label=f"{figures['trials']} trials")
        done, rss = zip(*figures["memory"])
        right.plot(done, rss, linewidth=1, label=f"{figures['trials']} trials")
    left.axhline(results[0]["slots"], color="grey", linestyle="--", linewidth=1)
    left.set_xlabel("seconds since the first trial started")
    left.set_ylabel("busy slots")
    left.set_title("busy slots over time")
    right.set_xlabel("trials done")
    right.set_ylabel("driver RSS (MiB)")
    right.set_title("the driver's memory")
    for ax in (left, right):
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def page(results: list[dict], args, picture: str) -> str:
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    where = (f"the test hosts (tests/hosts.py): a head with no CPUs on the driver's host, {args.nodes} other hosts "
             f"with a node of {args.cpus_per_node} CPU each; the sweep's own SQLite store and study on the driver's "
             "host, served to the trials by the sweep" if args.hosts else
             f"Ray's `ray.cluster_utils.Cluster` on 127.0.0.1: a head with no CPUs and {args.nodes} nodes of "
             f"{args.cpus_per_node} CPU; the study in the PostgreSQL of an `orchestrate server` (which also serves "
             "MLflow), one per sweep")
    counts = " ".join(map(str, args.trials))
    head = "| what | " + " | ".join(f"{f['trials']} trials" for f in results) + " | target |"
    rows = [head, "|---|" + "---|" * len(results) + "---|"]

    def row(what: str, cell, target: str = "") -> None:
        rows.append(f"| {what} | " + " | ".join(cell(f) for f in results) + f" | {target} |")

    row("trials FINISHED (pruned)", lambda f: f"{f['finished']} of {f['asked']} ({f['pruned']})", "all")
    row("`train/loss` points lost / logged twice", lambda f: f"{f['lost']} / {f['twice']}", "0 / 0")
    row("sweep wall time", lambda f: f"{f['wall_s']:.0f} s")
    row("mean trial: its job on its worker / its MLflow run", lambda f: f"{f['mean_trial_s']:.2f} s / "
        f"{f['mean_run_s']:.2f} s")
    row("ideal: trials x mean trial / slots", lambda f: f"{f['ideal_s']:.0f} s")
    row("**wall / ideal**", lambda f: f"**{f['wall_over_ideal']:.2f}** ({verdict(f['wall_over_ideal'] <= WALL_TARGET)})",
        f"at most {WALL_TARGET}")
    row("wall / ideal by MLflow run time", lambda f: f"{f['wall_over_ideal_run']:.2f}")
    row("slot occupancy, first start to last end", lambda f: f"{f['occupancy']:.1%} of {f['span_s']:.0f} s")
    row("idle slot time per trial (its launch, its set-up before its run opens)", lambda f: f"{f['gap_s']:.2f} s")
    row("before the first trial's run", lambda f: f"{f['head_s']:.1f} s")
    row("**summary printed, after the last trial's result**",
        lambda f: f"**{f['summary_after_s']:.1f} s** ({verdict(f['summary_after_s'] <= SUMMARY_TARGET_S)})",
        f"at most {SUMMARY_TARGET_S:g} s")
    row("parent run closed / command ended, after it", lambda f: f"{f['parent_closed_after_s']:.1f} s / "
        f"{f['exit_after_s']:.1f} s")
    row("driver RSS at 10% / 50% / all trials done",
        lambda f: " / ".join(f"{v:.0f}" for v in f["driver_rss_mb"].values()) + " MiB")
    row("driver RSS growth per 100 trials, second half", lambda f: f"{f['driver_rss_mb_per_100_trials']:.1f} MiB")
    row("driver CPU time: all / per trial", lambda f: f"{f['driver_cpu_s']:.0f} s / {f['driver_cpu_s_per_trial']:.3f} s")
    row("driver CPU per 100 trials, second half", lambda f: f"{f['driver_cpu_s_per_100_trials_late']:.1f} s")
    row(f"store size ({results[0]['store_what']}): all / per trial",
        lambda f: f"{f['store_bytes'] / 2**20:.0f} MiB / {f['store_bytes'] / f['asked'] / 2**10:.0f} KiB")
    lines = [
        f"# Large pruned sweeps on {'test hosts that share nothing' if args.hosts else 'a loopback cluster'}",
        "",
        f"Written by `{'python -m scripts.scale --hosts' if args.hosts else 'python scripts/scale.py --screenshot'} "
        f"--trials {counts}` on "
        f"{datetime.date.today()} ({platform.node()}, {os.cpu_count()} cores). On {where}. Each trial takes 1 CPU: "
        f"{results[0]['slots']} slots; the cluster's nodes, the driver and the store share this machine's cores.",
        "",
        f"Trials: `backend=torch data=synthetic model.hidden=[{args.width},{args.width}] "
        f"trainer.batch_size={args.batch_size} trainer.max_steps={args.steps} trainer.evaluation_period={args.eval_every}`, "
        "the learning rate drawn by TPE, pruned by successive halving.",
        "",
        *rows,
        "",
        "A trial's time is its job on its worker, from its start there to its result, as the launcher's "
        "`COMPLETED in ... s on its worker` line says; its MLflow run is shorter by the trial's set-up (Hydra's job "
        "folder, the run opened). The wall time counts what the trials do not: the sweep's own start (Ray, the "
        "study, the first composition), Ray's dispatch of each trial, the driver's work between trials (Optuna's "
        "sampler, the next launch: the sweep keeps trials queued in Ray for the next free slot) "
        "and its end (the summary). The driver's memory keeps what the summary needs of each trial (a row each); "
        "the growth per 100 trials is that, or a leak if it is much more.",
    ]
    if picture:
        lines += ["", f"![busy slots and the driver's memory]({picture})"]
    shot = next((f["screenshot"] for f in results if f.get("screenshot")), "")
    if shot:
        lines += ["", f"The MLflow runs page with the {max(args.trials):,}-trial sweep's parent run expanded over its "
                  "trials (`scripts/mlflow_ui_screenshot.py --server`):", "", f"![MLflow runs page]({shot})"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, nargs="+", default=[200, 1000], help="one sweep per count")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="trainer.max_steps of a trial")
    p.add_argument("--eval-every", type=int, default=10, help="trainer.evaluation_period: where the pruner looks")
    p.add_argument("--width", type=int, default=64, help="the MLP's two hidden layers' width")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hosts", action="store_true", help="on the test hosts (root: network and mount namespaces)")
    p.add_argument("--screenshot", action="store_true", help="the MLflow runs page of the largest sweep (loopback)")
    p.add_argument("--out", type=Path, default=None, help="docs/scale.md (docs/scale_hosts.md with --hosts), or a .json")
    args = p.parse_args()
    args.out = args.out or ROOT / "docs" / ("scale_hosts.md" if args.hosts else "scale.md")
    results = on_hosts(args) if args.hosts else loopback(args)
    if args.out.suffix == ".json":
        args.out.write_text(json.dumps({"sweeps": results}, indent=1))
    else:
        plot(results, args.out.with_suffix(".png"))
        args.out.write_text(page(results, args, args.out.with_suffix(".png").name))
    for figures in results:
        print(json.dumps({k: v for k, v in figures.items() if k not in ("busy", "memory")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
