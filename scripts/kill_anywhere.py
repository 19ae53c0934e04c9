"""Kill -9 anywhere, then `trainer.resume=auto`: does the resumed run equal one that never stopped?

    python scripts/kill_anywhere.py --backends torch ortmodule ondevice runner --points 10 --seed 0

For each backend, one uninterrupted reference run, then `--points` runs each killed with SIGKILL
at one randomly drawn point of five kinds:

  before-ckpt  a step before the first checkpoint (nothing to resume: a new run starts, and
               ends the killed one KILLED)
  ckpt-write   inside a checkpoint write: the temporary file half written (`ckpt-partial`), or
               written but not yet renamed (`ckpt-tmp`), or just after the save (`ckpt-done`)
  eval         during an evaluation, before its metrics are logged
  mid-run      a random step between checkpoints (the runner: on a random rank, or the driver)
  last-steps   one of the last steps, or just after the final checkpoint

and resumed by the same command with `trainer.resume=auto`, as a user would. Then MLflow is read
back: each `train/loss` and `eval/loss` step exactly once in the resumed run (the same run as the
killed one once a checkpoint exists), the losses against the reference run's, and the final
checkpoint's weights against the reference's. The table goes to stdout and docs/kill_anywhere.md.

The kill is not a hook in orchestrate: the runs' data set is `KillingData` (below), the synthetic
data set with a kill point in its config. It kills at its own batches, and for the other points
it wraps orchestrate's checkpoint writer and evaluation in the process it is built in, which is
the training process itself, also on the runner's Ray workers (importable there because
PYTHONPATH holds the repository). It kills only while its marker file exists, so the resumed
command, identical to the killed one, runs through. tests/test_kill_anywhere.py runs a few points.
"""

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrate.tasks.data import Synthetic

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS, CHECKPOINT_PERIOD, EVAL_PERIOD = 30, 10, 8
CHECKPOINTS = list(range(CHECKPOINT_PERIOD, MAX_STEPS + 1, CHECKPOINT_PERIOD))
EVALS = sorted({*range(EVAL_PERIOD, MAX_STEPS + 1, EVAL_PERIOD), MAX_STEPS})
# A tiny run with a learning-rate warm-up and decay and dropout, so that a resume must bring back
# the schedule and the random stream as well as the weights.
COMMON = ["data=synthetic", "trainer=quick", f"trainer.max_steps={MAX_STEPS}",
          f"trainer.checkpoint_period={CHECKPOINT_PERIOD}", f"trainer.evaluation_period={EVAL_PERIOD}",
          "trainer.display_loss_steps=1", "trainer.lr_schedule=linear", "trainer.warmup_steps=12",
          "model._target_=tests.helpers.DropoutMLP", "model.hidden=[32]",
          "data._target_=scripts.kill_anywhere.KillingData"]
BACKEND_OVERRIDES = {
    "torch": ["backend=torch"], "ortmodule": ["backend=ortmodule"], "ondevice": ["backend=ondevice"],
    # Two workers on the plain PyTorch engine; max_failures=0: a dead worker fails the run (Ray
    # Train's own restart is tests/backends/test_runner.py's subject), and the user resumes it.
    "runner": ["backend=runner", "backend.engine=torch", "backend.max_failures=0", "trainer.num_workers=2",
               "trainer.batch_size=16"],
}
CATEGORIES = ("before-ckpt", "ckpt-write", "eval", "mid-run", "last-steps")


# ---- the kill, inside the training process -------------------------------------------------------
class KillingData(Synthetic):
    """The synthetic data set, which SIGKILLs its process once, at `kill` (`step`, `ckpt-partial`,
    `ckpt-tmp`, `ckpt-done`, `eval` or `driver`) of step `at` on rank `rank`, while `marker`
    exists. The marker is removed and `<marker>.killed` written (JSON: point, step, pid) first."""

    def __init__(self, kill: str = "", at: int = 0, rank: int = 0, marker: str = "", **kwargs):
        super().__init__(**kwargs)
        self.kill, self.at, self.rank, self.marker = kill, at, rank, marker
        if marker and kill not in ("step", "driver"):
            _wrap_training(self)

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        # Batch `position` (0-based) is step position + 1's: the steps before it are done.
        if self.kill in ("step", "driver") and rank == self.rank and position + 1 == self.at:
            if self.kill == "driver":  # the runner's driver, whose pid the harness left beside the marker
                self.fire(int(Path(f"{self.marker}.driver").read_text()))
            else:
                self.fire()
        return super().train_batch(position, batch_size, seed, rank, world_size)

    def fire(self, pid: int | None = None) -> None:
        marker = Path(self.marker)
        if not self.marker or not marker.exists():
            return
        marker.unlink()
        Path(f"{marker}.killed").write_text(json.dumps({"point": self.kill, "step": self.at, "pid": os.getpid()}))
        os.kill(pid or os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the driver's death takes this worker down with it


def _wrap_training(data: KillingData) -> None:
    """Wrap orchestrate's checkpoint writer and evaluation in this process (once) so that they
    call `data.fire()` at the chosen point of step `data.at`."""
    from orchestrate import checkpoints, meter

    if getattr(checkpoints.Checkpoints.save, "kill_anywhere", False):
        return
    save, evaluate = checkpoints.Checkpoints.save, meter.Meter.evaluate

    def killing_save(self, step, write, suffix, **options):
        def killing_write(tmp: Path) -> None:
            write(tmp)
            if step == data.at and data.kill == "ckpt-partial":  # a write cut off half-way
                with open(tmp, "r+b") as f:
                    f.truncate(tmp.stat().st_size // 2)
                data.fire()
            if step == data.at and data.kill == "ckpt-tmp":  # written, not yet renamed
                data.fire()
        path = save(self, step, killing_write, suffix, **options)
        if step == data.at and data.kill == "ckpt-done" and path is not None:
            data.fire()
        return path

    def killing_evaluate(self, step, run_eval):
        def killing_eval():
            result = run_eval()
            if step == data.at and data.kill == "eval":  # evaluated, its metrics not yet logged
                data.fire()
            return result
        return evaluate(self, step, killing_eval)

    killing_save.kill_anywhere = True
    checkpoints.Checkpoints.save, meter.Meter.evaluate = killing_save, killing_evaluate


# ---- drawing the points ------------------------------------------------------------------------------
@dataclass
class Point:
    backend: str
    category: str
    kill: str  # KillingData's kill
    at: int  # the step
    rank: int = 0

    @property
    def label(self) -> str:
        where = f" rank {self.rank}" if self.backend == "runner" and self.kill == "step" else ""
        return f"{self.category}: {self.kill}{where} @ {self.at}"


def draw(backend: str, category: str, rng: random.Random) -> Point:
    """One kill point of `category`, its details drawn by `rng`."""
    ranks = 2 if backend == "runner" else 1
    if category == "before-ckpt":
        return Point(backend, category, "step", rng.randint(2, CHECKPOINTS[0]), rng.randrange(ranks))
    if category == "ckpt-write":
        return Point(backend, category, rng.choice(["ckpt-partial", "ckpt-tmp", "ckpt-done"]),
                     rng.choice(CHECKPOINTS[:-1]))
    if category == "eval":
        return Point(backend, category, "eval", rng.choice(EVALS))
    if category == "mid-run":
        kill = rng.choice(["step", "driver"]) if backend == "runner" else "step"
        return Point(backend, category, kill, rng.randint(CHECKPOINTS[0] + 2, MAX_STEPS - 5), rng.randrange(ranks))
    if rng.random() < 0.25:  # last-steps: after the final checkpoint, before the export and summary
        return Point(backend, category, "ckpt-done", MAX_STEPS)
    return Point(backend, category, "step", rng.randint(MAX_STEPS - 4, MAX_STEPS), rng.randrange(ranks))


def draw_points(backends: list[str], points: int, seed: int) -> list[Point]:
    """`points` per backend: every category in turn (in a shuffled order), details at random."""
    rng = random.Random(seed)
    drawn = []
    for backend in backends:
        order = rng.sample(CATEGORIES, len(CATEGORIES))
        drawn += [draw(backend, order[i % len(order)], rng) for i in range(points)]
    return drawn


# ---- running, resuming and checking ----------------------------------------------------------------
@dataclass
class Outcome:
    point: Point
    killed: bool = False
    resumed: bool = False
    same_run: bool = False
    steps_once: bool = False
    none_running: bool = False
    loss_diff: float = float("nan")
    weight_diff: float = float("nan")
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.killed and self.resumed and self.steps_once and self.none_running and self.loss_diff == 0
                and self.weight_diff == 0)


def orchestrate(folder: Path, name: str, overrides: list[str], driver_pid_file: Path | None = None):
    """`python -m orchestrate OVERRIDES` in `folder`, its store `folder/mlflow.db`, its outputs
    `folder/name`; returns (return code, output)."""
    command = [sys.executable, "-m", "orchestrate", *overrides, f"tracking.uri=sqlite:///{folder / 'mlflow.db'}",
               f"hydra.run.dir={folder / name}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(folder / f"{name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        if driver_pid_file is not None:
            driver_pid_file.write_text(str(proc.pid))
        rc = proc.wait(timeout=900)
    return rc, (folder / f"{name}.log").read_text()


def overrides_for(backend: str, point: Point | None, marker: Path | None) -> list[str]:
    kill = [] if point is None else [f"+data.kill={point.kill}", f"+data.at={point.at}", f"+data.rank={point.rank}",
                                     f"+data.marker={marker}"]
    return [*COMMON, *BACKEND_OVERRIDES[backend], *kill]


def final_checkpoint(out_dir: Path) -> Path:
    return next((out_dir / "checkpoints").glob(f"step_{MAX_STEPS:07d}*"))


_HYDRA = threading.Lock()  # composing configs in this process: Hydra's global state, one at a time


def weights(backend: str, path: Path) -> dict[str, np.ndarray]:
    from orchestrate import schema
    from orchestrate.config import load_config

    with _HYDRA:
        reader = schema.build(load_config(BACKEND_OVERRIDES[backend]).backend, "backend")
    return reader.read_checkpoint(path)


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def reference(backend: str, work: Path) -> Path:
    """The uninterrupted run: its folder holds the store that each point's store starts as a copy of."""
    folder = work / backend / "reference"
    folder.mkdir(parents=True)
    rc, out = orchestrate(folder, "out", overrides_for(backend, None, None))
    if rc != 0:
        raise RuntimeError(f"{backend}'s reference run failed (rc {rc}): {out[-2000:]}")
    return folder


def run_point(index: int, point: Point, ref: Path, work: Path) -> Outcome:
    from mlflow.tracking import MlflowClient

    folder = work / point.backend / f"point{index:02d}"
    folder.mkdir(parents=True)
    shutil.copy2(ref / "mlflow.db", folder / "mlflow.db")  # a store with the reference run in it: no setup to pay
    marker = folder / "kill_while_this_exists"
    marker.touch()
    overrides = overrides_for(point.backend, point, marker)
    outcome = Outcome(point)
    rc, out = orchestrate(folder, "first", overrides,
                          driver_pid_file=folder / "kill_while_this_exists.driver" if point.kill == "driver" else None)
    outcome.killed = not marker.exists() and rc != 0
    if not outcome.killed:
        outcome.notes.append(f"not killed (rc {rc})")
        return outcome
    rc, out = orchestrate(folder, "second", [*overrides, "trainer.resume=auto"])
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("orchestrate").experiment_id
    # This point's runs: its marker is in their config (the reference run has none).
    runs = [r for r in client.search_runs([experiment]) if r.data.params.get("data.marker") == str(marker)]
    finished = [r for r in runs if r.info.status == "FINISHED"]
    outcome.resumed = rc == 0 and len(finished) == 1
    if not outcome.resumed:
        outcome.notes.append(f"resume failed (rc {rc}): {out[-300:]!r}")
        return outcome
    run_id = finished[0].info.run_id
    outcome.same_run = len(runs) == 1
    # A killed run that the resume did not go on in is ended by it (KILLED), not left RUNNING.
    outcome.none_running = all(r.info.status != "RUNNING" for r in runs)
    if not outcome.same_run:
        left = [f"{r.info.run_id[:8]} {r.info.status}" for r in runs if r.info.run_id != run_id]
        outcome.notes.append(f"new run; the killed one left: {', '.join(left)}")
    reference_run = next(r.info.run_id for r in client.search_runs([experiment])
                         if "data.marker" not in r.data.params)
    diffs = []
    outcome.steps_once = True
    for key, expected in (("train/loss", list(range(1, MAX_STEPS + 1))), ("eval/loss", EVALS)):
        got, want = history(client, run_id, key), history(client, reference_run, key)
        if [s for s, _ in got] != expected:
            outcome.steps_once = False
            outcome.notes.append(f"{key} steps {[s for s, _ in got]}")
            continue
        diffs += [abs(a - b) for (_, a), (_, b) in zip(got, want)]
    outcome.loss_diff = max(diffs) if diffs else float("nan")
    trained, uninterrupted = (weights(point.backend, final_checkpoint(d)) for d in (folder / "second", ref / "out"))
    outcome.weight_diff = (max(float(np.max(np.abs(trained[k] - uninterrupted[k]))) for k in uninterrupted)
                           if trained.keys() == uninterrupted.keys() else float("inf"))
    return outcome


def run_all(points: list[Point], work: Path, parallel: int = 2) -> list[Outcome]:
    """The reference runs, then the points, `parallel` processes at a time (the references are
    queued first, so a point never waits for one that has not started)."""
    with ThreadPoolExecutor(parallel) as pool:
        refs = {b: pool.submit(reference, b, work) for b in dict.fromkeys(p.backend for p in points)}
        futures = [pool.submit(lambda i, p: run_point(i, p, refs[p.backend].result(), work), i, p)
                   for i, p in enumerate(points)]
        return [f.result() for f in futures]


def table(outcomes: list[Outcome]) -> str:
    def diff(x: float) -> str:
        return "bit for bit" if x == 0 else f"{x:.1e}"

    rows = ["| backend | point | step killed | resumed ok | same run | none left RUNNING | steps exactly once "
            "| max \\|loss diff\\| | weights equal | notes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        p = o.point
        rows.append(f"| {p.backend} | {p.label} | {p.at} | {'yes' if o.resumed else 'NO'} | "
                    f"{'yes' if o.same_run else 'no'} | {'yes' if o.none_running else 'NO'} | "
                    f"{'yes' if o.steps_once else 'NO'} | {diff(o.loss_diff)} | "
                    f"{diff(o.weight_diff)} | {'; '.join(o.notes)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKEND_OVERRIDES), choices=list(BACKEND_OVERRIDES))
    parser.add_argument("--points", type=int, default=10, help="kill points per backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "kill_anywhere.md")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (their path is printed)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kill_anywhere_"))
    began = time.perf_counter()
    try:
        outcomes = run_all(draw_points(args.backends, args.points, args.seed), work, args.parallel)
    finally:
        if args.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    minutes = (time.perf_counter() - began) / 60
    command = "python scripts/kill_anywhere.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = "\n".join([
        "# Kill -9 anywhere, then `trainer.resume=auto`", "",
        f"`{command.strip()}` on {platform.machine()} ({os.cpu_count()} cores, CPU only, shared), "
        f"{minutes:.1f} minutes. Each run: {MAX_STEPS} steps of `{' '.join(COMMON[:2])}`, checkpoints at "
        f"{', '.join(map(str, CHECKPOINTS))}, evaluations at {', '.join(map(str, EVALS))}, every step's loss logged; "
        "losses and final weights against an uninterrupted run's. The runner: 2 workers, engine torch.", "",
        table(outcomes), "",
        f"{sum(o.killed for o in outcomes)} killed, {sum(o.resumed for o in outcomes)} resumed, "
        f"{sum(o.steps_once for o in outcomes)} with every step exactly once, "
        f"{sum(o.none_running for o in outcomes)} with no run left RUNNING, "
        f"{sum(o.loss_diff == 0 and o.weight_diff == 0 for o in outcomes)} equal to the uninterrupted run bit for "
        f"bit; {sum(o.ok for o in outcomes)} of {len(outcomes)} all of these.", ""])
    print(report)
    args.out.write_text(report)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
