"""The runner and sweeps on a cluster whose hosts share nothing, against the same on one machine:
the figures of docs/cluster.md.

    python -m benchmarks.cluster                    # from the checkout, as root (the test hosts: tests/hosts.py)
    python -m benchmarks.cluster --steps 600 --out docs/cluster.md

On test hosts (network and mount namespaces of this machine, tests/hosts.py: a driver's host with
the Ray head of no CPUs, three others with a 1-CPU Ray node each, an S3 API server on the
driver's host), from a user's project folder on the driver's host only (its own model module and
`--config-dir`), with the commands a user types:
- the runner's 2 workers (torch engine) on 2 other hosts, checkpoints on S3, against the same run
  on one host (a local Ray of the driver's host): wall time, samples/s, and the largest difference
  between the two runs' train/loss at the same steps;
- a 3-trial Optuna sweep on the other hosts (Ray launcher) against the same on one machine:
  wall time and the largest difference between the same trials' evaluations;
- a worker host lost mid-run (its Ray node and the worker on it killed; a third host takes its
  place): the time from the kill to the next step the run logs (Ray Train's restart from the
  latest checkpoint in the bucket, and the steps redone since it).

Each host's Ray node has one CPU, as the one-machine runs' workers and trials do; the one-machine
runs share this machine's cores, the hosts' nodes too (the hosts are namespaces of one machine):
the figures show what the network path and the lack of a shared disk cost, not a real cluster's speed.
"""

import argparse
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.hosts import Hosts, s3_server, write_project

RUNNER = ["--config-dir", "conf", "model=usernet", "backend=runner", "backend.engine=torch", "trainer.num_workers=2",
          "trainer.progress=false", "trainer.display_loss_steps=10", "trainer.checkpoint_period=100"]
SWEEP = ["--config-dir", "conf", "model=usernet", "backend=torch", "trainer.progress=false", "+sweep=lr_optuna",
         "hydra.sweeper.n_trials=3", "trainer.evaluation_period=20"]


def orchestrate(hosts: Hosts, project: Path, overrides: list[str], env: dict, wait=True):
    """`python -m orchestrate OVERRIDES` on the driver's host, from the project's folder."""
    argv = [sys.executable, "-m", "orchestrate", *overrides]
    if not wait:
        return hosts.head.popen(argv, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    began = time.monotonic()
    done = hosts.head.run(argv, timeout=900, cwd=project, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)}: exit {done.returncode}\n{(done.stdout + done.stderr)[-4000:]}")
    return time.monotonic() - began


@functools.cache
def client(project: Path):
    """One client per project's store (the loops below ask it every half second)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{project / 'mlflow.db'}")


def runs(project: Path, experiment: str, role: str | None = None) -> list:
    found = client(project).get_experiment_by_name(experiment)
    if found is None:
        return []
    where = f"tags.`orchestrate.role` = '{role}'" if role else ""
    return client(project).search_runs([found.experiment_id], where)


def history(project: Path, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client(project).get_metric_history(run_id, key)}


def largest_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    common = sorted(set(a) & set(b))
    return max((abs(a[s] - b[s]) for s in common), default=float("nan")), len(common)


def runner_figures(hosts, project, env, local_env, steps: int) -> list[str]:
    there = orchestrate(hosts, project, [*RUNNER, f"trainer.max_steps={steps}", f"backend.ray_address={hosts.ray_address}",
                                         "backend.storage_path=s3://checkpoints/hosts", "tracking.experiment=hosts"], env)
    here = orchestrate(hosts, project, [*RUNNER, f"trainer.max_steps={steps}", "tracking.experiment=one_host"],
                       local_env)
    (a,), (b,) = runs(project, "hosts"), runs(project, "one_host")
    diff, points = largest_difference(history(project, a.info.run_id, "train/loss"),
                                      history(project, b.info.run_id, "train/loss"))
    where = sorted({a.data.tags[f"worker.{r}"].split()[1] for r in (0, 1)})
    return [f"| runner, 2 workers on 2 other hosts ({', '.join(where)}), checkpoints on S3 | {there:.1f} "
            f"| {a.data.metrics['final/samples_per_sec']:,.0f} | {diff:.1e} over {points} steps |",
            f"| the same on one host (a local Ray, 2 workers, checkpoints in the run's folder) | {here:.1f} "
            f"| {b.data.metrics['final/samples_per_sec']:,.0f} | (the reference) |"]


def sweep_figures(hosts, project, env, local_env, steps: int) -> list[str]:
    there = orchestrate(hosts, project, [*SWEEP, f"trainer.max_steps={steps}",
                                         f"hydra.launcher.address={hosts.ray_address}",
                                         "tracking.experiment=sweep_hosts"], env)
    here = orchestrate(hosts, project, [*SWEEP, f"trainer.max_steps={steps}", "tracking.experiment=sweep_one"],
                       local_env)
    a = {r.data.tags["orchestrate.trial"]: r for r in runs(project, "sweep_hosts", "trial")}
    b = {r.data.tags["orchestrate.trial"]: r for r in runs(project, "sweep_one", "trial")}
    diffs = [largest_difference(history(project, a[t].info.run_id, "eval/loss"),
                                history(project, b[t].info.run_id, "eval/loss"))[0] for t in sorted(set(a) & set(b))]
    return [f"| sweep, 3 Optuna trials on the other hosts (Ray launcher) | {there:.1f} | | "
            f"{max(diffs):.1e} (eval/loss, {len(diffs)} trials) |",
            f"| the same on one machine (Ray launcher, a local Ray) | {here:.1f} | | (the reference) |"]


def loss_figures(hosts, project, env, steps: int) -> list[str]:
    """A worker host lost mid-run: the time from its kill to the run's next new step in MLflow."""
    running = orchestrate(hosts, project, [*RUNNER, f"trainer.max_steps={steps}",
                                           f"backend.ray_address={hosts.ray_address}",
                                           "backend.storage_path=s3://checkpoints/lost", "tracking.experiment=lost"],
                          env, wait=False)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and running.poll() is None:  # past the first checkpoint
            found = runs(project, "lost") if (project / "mlflow.db").exists() else []
            if found and "worker.1" in found[0].data.tags and client(project).list_artifacts(
                    found[0].info.run_id, "checkpoints"):
                break
            time.sleep(0.5)
        else:
            running.kill()  # stalled or ended: its output is complete once it is gone
            raise SystemExit("the host-loss run ended or stalled before its first checkpoint:\n"
                             f"{running.communicate(timeout=60)[0][-4000:]}")
        run_id = found[0].info.run_id
        address = found[0].data.tags["worker.1"].split()[1]
        (lost,) = [h for h in hosts.hosts if h.address == address]
        before = max(history(project, run_id, "train/loss"))
        killed = time.time()
        lost.signal_all(signal.SIGKILL)
        while time.time() < killed + 300 and running.poll() is None:
            if max(history(project, run_id, "train/loss")) > before:
                break
            time.sleep(0.2)
        out, _ = running.communicate(timeout=600)
    finally:
        if running.poll() is None:
            running.kill()
    if running.returncode != 0:
        raise SystemExit(f"the host-loss run failed:\n{out[-4000:]}")
    points = client(project).get_metric_history(run_id, "train/loss")
    after = [p.timestamp for p in points if p.step > before]
    if not after:
        raise SystemExit(f"the host-loss run logged no step after {before}:\n{out[-4000:]}")
    again = min(after) / 1000
    steps_logged = sorted(p.step for p in points)
    assert steps_logged == list(range(10, steps + 1, 10)), steps_logged  # every display step once
    return [f"| a worker host lost at step {before} (its Ray node killed), the run on a third host | "
            f"**{again - killed:.1f} s** to the next new step | | every display step once, run FINISHED |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="the runner's steps (the sweep's trials: a third)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "cluster.md")
    args = parser.parse_args()
    began = time.monotonic()
    with Hosts(4, ray_cpus=1) as hosts, s3_server(hosts) as s3, tempfile.TemporaryDirectory() as folder:
        project = write_project(Path(folder))
        env = {**os.environ, **hosts.env, **s3}
        local_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
        rows = runner_figures(hosts, project, env, local_env, args.steps)
        rows += sweep_figures(hosts, project, env, local_env, max(60, args.steps // 3))
        rows += loss_figures(hosts, project, env, args.steps * 2)
    table = ["| what | wall s | samples/s | largest loss difference against one machine |", "|---|---:|---:|---|", *rows]
    text = "\n\n".join([
        "# The runner and sweeps on hosts that share nothing",
        "Figures of `benchmarks/cluster.py` (its docstring says what each row runs); the tests run a "
        "representative subset (tests/backends/test_runner_hosts.py, tests/sweeps/test_sweeps_hosts.py).",
        f"`python -m benchmarks.cluster --steps {args.steps}` on a {os.cpu_count()}-core machine, "
        f"{time.strftime('%Y-%m-%d')}, {time.monotonic() - began:.0f} s in all:",
        "\n".join(table),
        "The test hosts are network and mount namespaces of one machine (tests/hosts.py): each host's Ray "
        "node has one CPU, as the one-machine runs' workers and trials do, and all share this machine's "
        "cores. The figures show what the network path and the lack of a shared disk cost, and that the "
        "results do not change; not a real cluster's speed."]) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
