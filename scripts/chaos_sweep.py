"""Kill a sweep anywhere, then the same command: does every trial run once, and does every run close?

    python -m scripts.chaos_sweep --trials 50 --kills 6 --seed 0    # from the checkout (tests.helpers' cluster)

A pruned Optuna sweep (`--trials` trials of a small MLP on synthetic data, successive halving, an
evaluation every 25 steps) on a Ray cluster of two nodes on this machine (127.0.0.1, one CPU each),
hit `--kills` times, each at a random moment, by a kind drawn at random:

  driver   SIGKILL of the command's whole process group (a lost login shell, a killed job): the
           next attempt is the same command, started at once
  worker   SIGKILL of the process of a trial that is running (a Ray worker): the sweep goes on,
           the trial's point run again as a new trial (once)
  server   SIGKILL of the sweep's MLflow server (its process group): the sweep starts it again on
           its port at its next heartbeat (orchestrate.sweeps._runs.Sweep.keep_server)

then the same command once more, to the end. (The Ray head killed under a sweep has a test of its
own, tests/sweeps/test_runs.py: the command ends in one line, and the same command continues the
sweep on the head started again.) Read back through MLflow's and Optuna's clients: the
last command's exit code; every trial of the study once in its summary; no run RUNNING; every run a
killed attempt left closed KILLED by the next one, saying so; the study's finished trials each a
FINISHED child run with the same parameters; no point finished twice (the sampler's history
intact). Per kill: whether the command survived it, the work it lost (the steps of the trials
running at that moment that did not finish), and after a driver kill the seconds from the next
command's start to its first trial. The table goes to stdout and docs/chaos_sweep.md (docs/reliability.md
links it).

tests/sweeps/test_runs.py runs the issue's case (three driver kills, then the command) in CI's tier;
tests/test_chaos_sweep.py runs this script with fewer trials in the long tier.
"""

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("driver", "worker", "server")


def command(trials: int, address: str) -> list[str]:
    return [sys.executable, "-m", "orchestrate", "+sweep=lr_optuna", "backend=torch", "data=synthetic", "trainer=quick",
            "model.hidden=[32]", "trainer.max_steps=200", "trainer.evaluation_period=25", "trainer.progress=false",
            "hydra/sweeper/pruner=successive_halving", f"hydra.sweeper.n_trials={trials}",
            f"hydra.launcher.address={address}"]


@dataclass
class Kill:
    kind: str
    at: float  # seconds since the epoch
    attempt: int
    survived: bool = False
    lost_steps: int = 0
    restart_to_first_trial_s: float | None = None
    note: str = ""


@dataclass
class Chaos:
    folder: Path
    argv: list[str]
    env: dict
    kills: list[Kill] = field(default_factory=list)
    attempt_starts: list[float] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # how each command ended: its exit code and error line

    def start(self) -> subprocess.Popen:
        self.attempt_starts.append(time.time())
        self.ended.append("killed")
        log = open(self.folder / f"attempt-{len(self.attempt_starts)}.log", "w")
        return subprocess.Popen(self.argv, cwd=self.folder, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=f"sqlite:///{self.folder}/mlflow.db")

    def running_trials(self) -> list:
        if not (self.folder / "mlflow.db").exists():
            return []
        client = self.client()
        found = client.get_experiment_by_name("orchestrate")
        if found is None:
            return []
        return [r for r in client.search_runs([found.experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
                if "mlflow.parentRunId" in r.data.tags and r.data.tags.get("pid")]

    def hit(self, proc: subprocess.Popen, kind: str) -> str:
        """One kill of `kind`; what it hit, or "" if there was nothing of that kind to hit."""
        import psutil

        if kind == "driver":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=120)
            return f"the command's process group ({proc.pid})"
        if kind == "worker":
            running = self.running_trials()
            if not running:
                return ""
            pid = int(running[0].data.tags["pid"])
            with_suppressed(lambda: os.kill(pid, signal.SIGKILL))
            return f"trial {running[0].data.tags.get('orchestrate.trial', '?')} (pid {pid})"
        servers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "mlflow" in " ".join(p.cmdline()) and "server" in p.cmdline() and p.pid == os.getpgid(p.pid)]
        if not servers:
            return ""
        with_suppressed(lambda: os.killpg(servers[0].pid, signal.SIGKILL))
        return f"the sweep's MLflow server (pid {servers[0].pid})"


def with_suppressed(call) -> None:
    try:
        call()
    except (ProcessLookupError, PermissionError):
        pass


def run(trials: int, kills: int, seed: int, folder: Path, address: str, env: dict, window_s: float = 20.0) -> dict:
    rng = random.Random(seed)
    chaos = Chaos(folder, command(trials, address), {**env, "PYTHONUNBUFFERED": "1"})
    proc = chaos.start()
    while len(chaos.kills) < kills:
        wait = rng.uniform(0.5, window_s)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        if proc.poll() is not None:  # it ended before the kill (done, or failed): the same command again
            chaos.ended[-1] = outcome(chaos, proc.returncode)
            proc = chaos.start()
            continue
        kind = rng.choice(KINDS)
        kill = Kill(kind, time.time(), len(chaos.attempt_starts))
        kill.note = chaos.hit(proc, kind)
        if not kill.note:
            continue  # nothing of that kind to hit now (no trial running yet): another draw
        chaos.kills.append(kill)
        print(f"kill {len(chaos.kills)}: {kind} at {kill.at - chaos.attempt_starts[-1]:.1f} s into attempt "
              f"{kill.attempt}: {kill.note}", flush=True)
        if kind == "driver":
            proc = chaos.start()
    # The last attempt: the command runs to its end (the one running now, and again if it ended early).
    chaos.ended[-1] = outcome(chaos, proc.wait(timeout=3600))
    last = chaos.start()
    code = last.wait(timeout=3600)
    chaos.ended[-1] = outcome(chaos, code)
    return read_back(chaos, trials, code)


def outcome(chaos: Chaos, code: int) -> str:
    """How the latest command ended: its exit code, and its `error:` line if it printed one."""
    log = (chaos.folder / f"attempt-{len(chaos.attempt_starts)}.log").read_text()
    said = [line for line in log.splitlines() if line.startswith("error: ")]
    return f"exit {code}" + (f": {said[-1][:300]}" if said else "")


def read_back(chaos: Chaos, trials: int, code: int) -> dict:
    import optuna

    client = chaos.client()
    experiment = client.get_experiment_by_name("orchestrate").experiment_id
    runs = client.search_runs([experiment], max_results=5000)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    steps = {r.info.run_id: max((m.step for m in client.get_metric_history(r.info.run_id, "train/loss")), default=0)
             for r in children}
    for kill in chaos.kills:
        at_ms = kill.at * 1000
        hit = [r for r in children if r.info.start_time <= at_ms and (r.info.end_time or 1e20) >= at_ms
               and r.info.status != "FINISHED"]
        kill.lost_steps = sum(steps[r.info.run_id] for r in hit)
        # Survived: its command went on (ended later by another kill, or to its end with exit 0). A
        # command that ended with an error after this kill and before another ended by it.
        later = [k for k in chaos.kills if k.attempt == kill.attempt and k.at > kill.at]
        ended = chaos.ended[kill.attempt - 1]
        kill.survived = kill.kind != "driver" and (bool(later) or not ended.startswith("exit") or ended == "exit 0")
        if kill.kind != "driver" and not kill.survived:
            kill.note += f"; its command ended: {ended}"
        if kill.kind == "driver":
            nxt = kill.attempt + 1
            first = [r.info.start_time / 1000 for r in children if r.data.tags.get("orchestrate.sweep.attempt") == str(nxt)]
            if first and nxt <= len(chaos.attempt_starts):
                kill.restart_to_first_trial_s = min(first) - chaos.attempt_starts[nxt - 1]
    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{chaos.folder}/mlflow-optuna.db")
    study = optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{chaos.folder}/mlflow-optuna.db")
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    # The study's trials, each a point: a killed attempt's running trial is failed and run again with the
    # same point (one trial of the summary); a proposal that repeated a finished point is not one.
    points = {tuple(sorted(t.params.items())) for t in study.trials if "duplicate_of" not in t.user_attrs}
    finished_runs = {tuple(sorted((k, str(v)) for k, v in r.data.params.items() if k in ("optimizer.lr", "trainer.batch_size")))
                     for r in children if r.info.status == "FINISHED"}
    log = (chaos.folder / f"attempt-{len(chaos.attempt_starts)}.log").read_text()
    rows = [line for line in log.splitlines() if re.match(r"\| \d+ \| ", line)]
    left = [r for r in children if r.info.status == "KILLED" and "closed by attempt" in r.data.tags.get("error", "")]
    return {
        "exit_code": code,
        "attempts": len(chaos.attempt_starts),
        "kills": chaos.kills,
        "runs_running": sum(r.info.status == "RUNNING" for r in runs),
        "summary_rows": len(rows),
        "study_points": len(points),
        "ended": chaos.ended,
        "study_finished": len(finished),
        "study_running": sum(t.state.name == "RUNNING" for t in study.trials),
        "points_twice": len(finished) - len({tuple(sorted(t.params.items())) for t in finished}),
        "study_without_run": sum(tuple(sorted((k, str(v)) for k, v in t.params.items())) not in finished_runs
                                 for t in finished),
        "closed_by_next_attempt": len(left),
        "trials": trials,
    }


def table(result: dict) -> str:
    lines = ["| kill | kind | attempt | survived | trial-steps lost | s from restart to first trial | what |",
             "|---:|---|---:|---|---:|---:|---|"]
    for i, k in enumerate(result["kills"], 1):
        restart = f"{k.restart_to_first_trial_s:.1f}" if k.restart_to_first_trial_s is not None else "-"
        lines.append(f"| {i} | {k.kind} | {k.attempt} | {'yes' if k.survived else 'no: the next command goes on'} | "
                     f"{k.lost_steps} | {restart} | {k.note} |")
    checks = [("the last command's exit code", result["exit_code"], 0),
              ("runs left RUNNING", result["runs_running"], 0),
              ("trials in the last summary (each point of the study once)", result["summary_rows"], result["study_points"]),
              ("study trials finished (COMPLETE or PRUNED)", result["study_finished"], result["trials"]),
              ("study trials left RUNNING", result["study_running"], 0),
              ("points finished twice", result["points_twice"], 0),
              ("finished study trials without a FINISHED run", result["study_without_run"], 0)]
    lines += ["", "| check | found | expected |", "|---|---:|---:|"]
    lines += [f"| {what} | {found} | {expected} |" for what, found, expected in checks]
    lines.append(f"\n{result['attempts']} commands in all; {result['closed_by_next_attempt']} run(s) a killed "
                 "attempt left RUNNING, closed KILLED by the next. How each command ended:\n")
    lines += [f"{i}. {how}" for i, how in enumerate(result["ended"], 1)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "chaos_sweep.md")
    parser.add_argument("--keep", type=Path, help="a folder to run in and keep (the commands' logs, the stores)")
    args = parser.parse_args()
    from tests.helpers import loopback_cluster

    began = time.time()
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp, loopback_cluster(nodes=2, cpus_per_node=1) as (address, env):
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        result = run(args.trials, args.kills, args.seed, folder, address, env)
    text = table(result)
    print(text)
    args.out.write_text(
        "# Sweeps killed anywhere\n\n"
        f"{time.strftime('%Y-%m-%d')}, 2 cores, a 2-node Ray cluster on 127.0.0.1 (one CPU each); "
        f"{time.time() - began:.0f} s in all.\n\n```\npython -m scripts.chaos_sweep --trials {args.trials} "
        f"--kills {args.kills} --seed {args.seed}\n```\n\n" + "\n\n".join(__doc__.split("\n\n")[2:5]) + "\n\n"
        + text + "\n")


if __name__ == "__main__":
    main()
