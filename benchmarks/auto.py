"""backend=auto against a backend shootout: on each shipped model, auto's choice (from its probes)
next to the backend whose run of the same steps ended soonest, a compile or an export included
(what `+experiment=backend_shootout +sweep` runs: the same model, data and seed, 300 steps), and
what the probing cost.

    python benchmarks/auto.py                        # every shipped model, then the cost on the digits MLP
    python benchmarks/auto.py --models mlp cnn --no-cost
    python benchmarks/auto.py --models --cost-steps 3000 --repeats 3     # the cost alone

The shootout runs in this process, through `orchestrate.app.train` as users run it (default
trainer, MLflow on a throwaway SQLite store, no progress bar), after a 2-step run of each backend
that pays for their imports: for each model first backend=auto, then each single-process backend
for the same steps. Samples/s are each run's steady figure (`final/samples_per_sec`: the steps
after the first display window). Probing's cost is the auto run's wall time less the chosen
backend's own run's (the same steps, the same process).

The cost on the issue's reference, a 3,000-step digits MLP run, is measured as a user pays it:
`python -m orchestrate backend=auto trainer.max_steps=3000` against `backend=<its choice>`, each a
fresh process in a fresh folder, interleaved `--repeats` times (medians).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrate import app
from orchestrate.backends.base import backends
from orchestrate.config import load_config

# Each shipped model with the data it is made for (conf/model/*.yaml's comments); the sequence
# models at batch 16, as conf/experiment/char_lm.yaml trains the character transformer.
MODELS = {
    "mlp": ["model=mlp", "data=digits"],
    "cnn": ["model=cnn", "data=digits"],
    "char_transformer": ["model=char_transformer", "data=python_source", "trainer.batch_size=16"],
    "hf_causal_lm": ["model=hf_causal_lm", "data=python_source", "trainer.batch_size=16"],
    "hf_classifier": ["model=hf_classifier", "data=python_files", "trainer.batch_size=16"],
}
QUIET = ["trainer.progress=false", "tracking.experiment=auto_benchmark", "tracking.log_checkpoints=false"]


def train(overrides: list[str], store: str, out: Path) -> tuple[dict, dict, float]:
    """One run through the app: its final metrics, its MLflow tags, and its wall seconds."""
    cfg = load_config([*overrides, *QUIET, f"tracking.uri={store}"])
    began = time.perf_counter()
    result = app.train(cfg, out)
    wall = time.perf_counter() - began
    return result.metrics, MlflowClient(store).get_run(result.run_id).data.tags, wall


def shootout(model: str, steps: int, candidates: list[str], folder: Path) -> dict:
    store = f"sqlite:///{folder}/shootout.db"
    common = [*MODELS[model], f"trainer.max_steps={steps}", "trainer.seed=0"]
    auto, tags, auto_wall = train(["backend=auto", *common], store, folder / f"{model}-auto")
    speed, walls = {}, {}
    for backend in candidates:
        metrics, _, walls[backend] = train([f"backend={backend}", *common], store, folder / f"{model}-{backend}")
        speed[backend] = metrics["samples_per_sec"]
    chosen = tags["backend"]
    return {"model": model, "steps": steps, "chosen": chosen, "fastest": min(walls, key=walls.get), "speed": speed,
            "probing": auto["auto_probe_s"], "cost": auto_wall - walls[chosen], "run": walls[chosen]}


def command(args: list[str], folder: Path) -> tuple[float, dict, dict]:
    """`python -m orchestrate ARGS` in `folder`: wall seconds, the run's final metrics and tags."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrate", *args, *QUIET], cwd=folder, capture_output=True,
                          text=True)
    wall = time.perf_counter() - began
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("auto_benchmark").experiment_id])
    return wall, run.data.metrics, run.data.tags


def cost(steps: int, repeats: int) -> None:
    """backend=auto against its choice on the default experiment (digits MLP), as commands."""
    walls: dict[str, list[float]] = {"auto": [], "chosen": []}
    probing, training, chosen = [], [], None
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            wall, metrics, tags = command(["backend=auto", f"trainer.max_steps={steps}"], Path(tmp))
        walls["auto"].append(wall)
        probing.append(metrics["final/auto_probe_s"])
        chosen = chosen or tags["backend"]
        with tempfile.TemporaryDirectory() as tmp:
            wall, metrics, _ = command([f"backend={chosen}", f"trainer.max_steps={steps}"], Path(tmp))
        walls["chosen"].append(wall)
        training.append(metrics["final/wall_time_s"])
    auto, alone = statistics.median(walls["auto"]), statistics.median(walls["chosen"])
    print(f"\n`python -m orchestrate backend=auto trainer.max_steps={steps}` against `backend={chosen}` (its choice), "
          f"fresh processes, {repeats} interleaved repeats, medians:")
    print("| command | wall s | of which probing (in the run) s | training s |\n|---|---:|---:|---:|")
    print(f"| backend=auto | {auto:.1f} | {statistics.median(probing):.2f} | - |")
    print(f"| backend={chosen} | {alone:.1f} | - | {statistics.median(training):.1f} |")
    print(f"probing cost {auto - alone:.1f} s: {(auto - alone) / alone:.0%} of the {chosen} command's wall time, "
          f"{(auto - alone) / statistics.median(training):.0%} of its training time "
          f"(walls of each repeat: auto {', '.join(f'{w:.1f}' for w in walls['auto'])}; "
          f"{chosen} {', '.join(f'{w:.1f}' for w in walls['chosen'])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=300, help="steps of mlp and cnn (backend_shootout's 300)")
    parser.add_argument("--sequence-steps", type=int, default=100,
                        help="steps of the three sequence models (fewer: 2 cores)")
    parser.add_argument("--cost-steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cost", action="store_true", help="skip the 3,000-step cost measurement")
    args = parser.parse_args()

    candidates = backends(unless=("distributed", "chooses"))  # what backend=auto probes by default
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.models:
            # Each backend's first use in this process (imports: ORT, torch's optimizers) is paid
            # here, not by the first model's auto run.
            for backend in candidates:
                train([f"backend={backend}", "data=synthetic", "trainer=quick", "trainer.max_steps=2"],
                      f"sqlite:///{tmp}/warm_up.db", Path(tmp) / f"warm_up-{backend}")
        for model in args.models:
            steps = args.steps if model in ("mlp", "cnn") else args.sequence_steps
            rows.append(shootout(model, steps, candidates, Path(tmp)))
    if rows:
        # probing s: the probes in the auto run (final/auto_probe_s); cost: the auto run's wall time
        # less the chosen backend's own run's (the probes, the up-front check of each candidate,
        # each backend's first use in this process), in seconds and as a share of that run.
        print(f"\n| model | steps | auto's choice | fastest in the shootout | "
              f"{' | '.join(f'{b} samples/s' for b in candidates)} | agree | probing s | cost s | cost % of the run |")
        print("|---|---:|---|---|" + "---:|" * len(candidates) + "---|---:|---:|---:|")
        for r in rows:
            speeds = " | ".join(format(r["speed"][b], ",.0f") for b in candidates)
            print(f"| {r['model']} | {r['steps']} | {r['chosen']} | {r['fastest']} | {speeds} | "
                  f"{'yes' if r['chosen'] == r['fastest'] else 'no'} | {r['probing']:.1f} | {r['cost']:.1f} | "
                  f"{r['cost'] / r['run']:.0%} |")
    if not args.no_cost:
        cost(args.cost_steps, args.repeats)


if __name__ == "__main__":
    main()
