"""Which pruner settings keep the best trial: every shipped sweep that can prune, and the pruning
benchmark's search, replayed under candidate settings of Optuna's pruners.

  curves  each shipped sweep run once to the end (hydra/sweeper/pruner=none), as a user runs it,
          with an evaluation every 25 steps: every trial's eval loss at every evaluation and how
          long its steps took (lr_search: digits on the on-device API, a few minutes on 2 cores);
          the benchmark's 16-trial character-model search is read from docs/pruning.json, which
          `python benchmarks/sweeps.py --parts prune --eval-every 25` wrote
  replay  Optuna's own pruner, built from each candidate's settings as every trial builds it
          (`pruner_settings`: `auto` resources from the trainer), told those curves as the sweep
          tells it: two slots, a trial's evaluations at the times its steps reach them, a pruned
          trial's slot going to the next trial at once. Each sweep in the order its trials ran and
          in 20 other seeded orders (the order a grid or a sampler proposes is arbitrary)

    python benchmarks/pruner_defaults.py                   # curves and replay: docs/performance.md, "Pruning"
    python benchmarks/pruner_defaults.py --parts replay    # again, on the curves kept in docs/pruner-curves.json

A sweep's best is the lowest final eval loss of the trials that ran to the end (the sweep summary's
best); trial-steps are the steps every trial ran, a pruned one's up to where it was pruned.
"""

import argparse
import heapq
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CURVES = ROOT / "docs" / "pruner-curves.json"
EVERY = 25  # the curves' evaluation period: replays evaluate at any multiple of it
ORDERS = 20  # seeded orders per sweep, beside the order its trials ran in
SLOTS = 2  # trials at once (the Ray launcher on 2 cores)

# Every shipped sweep that can prune: Optuna's sweeper with a search (lr_search is the guide's
# pruning command, docs/sweeps.md), with the keys it searches. Its own settings; the curve run
# evaluates every EVERY steps and prunes nothing.
SHIPPED = {"lr_search": (["+experiment=lr_search", "+sweep"], ["optimizer.lr", "trainer.batch_size"])}

# Candidates: hydra/sweeper/pruner=NAME with these settings (the group's defaults for the rest;
# "Nx": N evaluation periods). The first rung of successive halving is `min_resource`.
CANDIDATES = {
    "successive_halving (rf 4, first rung 1 eval)": ("successive_halving", {"min_resource": "1x"}),
    "successive_halving (rf 3, first rung 1 eval)": ("successive_halving", {"reduction_factor": 3, "min_resource": "1x"}),
    "successive_halving (rf 2, first rung 1 eval)": ("successive_halving", {"reduction_factor": 2, "min_resource": "1x"}),
    "successive_halving (rf 4, first rung 2 evals: the default)": ("successive_halving", {}),
    "successive_halving (rf 3, first rung 2 evals)": ("successive_halving", {"reduction_factor": 3}),
    "successive_halving (rf 2, first rung 2 evals)": ("successive_halving", {"reduction_factor": 2}),
    "successive_halving (rf 4, first rung 1 eval, early stopping rate 1)": (
        "successive_halving", {"min_resource": "1x", "min_early_stopping_rate": 1}),
    "median (4 startup trials)": ("median", {}),
    "median (4 startup, 2 evals warm-up)": ("median", {"n_warmup_steps": "2x"}),
    "hyperband (rf 3, smallest first rung 2 evals)": ("hyperband", {}),
}


@dataclass
class Sweep:
    """One search's trials run to the end: curve[i] maps step -> eval loss, seconds[i] is the time
    one step of trial i took; `period` is the evaluation period the replay evaluates at."""

    name: str
    steps: int
    period: int
    curves: list[dict[int, float]]
    seconds: list[float]


def pruner_config(name: str, settings: dict, period: int, steps: int) -> dict:
    """The pruner as hydra/sweeper/pruner=NAME composes it, with the settings given ("2x": two
    evaluation periods), made concrete as every trial makes it (pruner_settings)."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from orchestrate.config import load_config
    from orchestrate.sweeps.pruning import pruner_settings

    cfg = load_config(["sweep=lr_optuna", f"hydra/sweeper/pruner={name}"], run_mode=RunMode.MULTIRUN, with_hydra=True)
    pruner = OmegaConf.to_container(cfg.hydra.sweeper.pruner, resolve=True)
    pruner.update({k: int(v[:-1]) * period if str(v).endswith("x") else v for k, v in settings.items()})
    return pruner_settings(pruner, OmegaConf.create({"evaluation_period": period, "max_steps": steps}))


def replay(sweep: Sweep, pruner: dict, order: list[int]) -> tuple[float, int, int]:
    """(best final eval loss of the trials that finished, trial-steps, trials pruned) of `sweep`'s
    trials run in `order` under `pruner`, SLOTS at a time, as a sweep would run them."""
    import optuna
    from hydra.utils import instantiate

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", pruner=instantiate(pruner))
    evaluations = list(range(sweep.period, sweep.steps + 1, sweep.period))
    if evaluations[-1] != sweep.steps:
        evaluations.append(sweep.steps)
    events, waiting, trials = [], list(order), {}  # events: (time, trial index, evaluation step)
    finals, trial_steps, pruned = [], 0, 0

    def start(now: float) -> None:
        if waiting:
            i = waiting.pop(0)
            trials[i] = study.ask()
            for step in evaluations:
                heapq.heappush(events, (now + step * sweep.seconds[i], i, step))

    for _ in range(SLOTS):
        start(0.0)
    while events:
        now, i, step = heapq.heappop(events)
        if i not in trials:
            continue  # pruned earlier: its later evaluations never happen
        value = sweep.curves[i][step]
        trials[i].report(value, step)
        if step == sweep.steps:  # the last evaluation: the trial's result, not asked (as the meter does)
            study.tell(trials.pop(i), value)
            finals.append(value)
        elif trials[i].should_prune():
            study.tell(trials.pop(i), state=optuna.trial.TrialState.PRUNED)
            pruned += 1
        else:
            continue
        trial_steps += step
        start(now)
    return min(finals), trial_steps, pruned


def orders(sweep: Sweep) -> list[list[int]]:
    """The order the trials ran in, then ORDERS seeded shuffles of it."""
    ran = list(range(len(sweep.curves)))
    shuffles = []
    for seed in range(ORDERS):
        shuffled = ran[:]
        random.Random(seed).shuffle(shuffled)
        shuffles.append(shuffled)
    return [ran, *shuffles]


def part_curves() -> dict:
    """Each shipped sweep's trials run to the end with an evaluation every EVERY steps, and the
    benchmark's search from docs/pruning.json."""
    from mlflow.tracking import MlflowClient
    from sweeps import run_sweep  # benchmarks/sweeps.py (beside this script): a sweep run as a user runs it

    from orchestrate.config import load_config

    kept = {}
    for name, (args, searched) in SHIPPED.items():
        shipped = load_config(args[:1])  # the experiment's own trainer settings
        steps, period = shipped.trainer.max_steps, shipped.trainer.evaluation_period
        with tempfile.TemporaryDirectory() as tmp:
            run_sweep([*args, "hydra/sweeper/pruner=none", f"trainer.evaluation_period={EVERY}",
                       "trainer.checkpoint_period=0", "trainer.progress=false"], Path(tmp))
            client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
            (experiment,) = [e for e in client.search_experiments() if e.name == shipped.tracking.experiment]
            runs = [r for r in client.search_runs([experiment.experiment_id], max_results=1000)
                    if "mlflow.parentRunId" in r.data.tags]
            runs.sort(key=lambda r: r.info.start_time)  # the order they ran in
            kept[name] = {"steps": steps, "period": period, "trials": [
                {"params": {k: r.data.params[k] for k in searched},
                 "curve": {m.step: m.value for m in client.get_metric_history(r.info.run_id, "eval/loss")},
                 "seconds_per_step": (r.info.end_time - r.info.start_time) / 1000 / steps} for r in runs]}
    bench = json.loads((ROOT / "docs" / "pruning.json").read_text())
    unpruned = bench["curves"]["none"][::-1]  # MLflow lists the newest run first
    kept["benchmark (char LM, 16-trial grid)"] = {"steps": bench["steps"], "period": EVERY, "trials": [
        {"params": {"optimizer.lr": lr, "model.n_embd": width}, "curve": dict(history),
         "seconds_per_step": 1.0} for lr, width, history, _ in unpruned]}  # no per-trial time kept: equal
    CURVES.write_text(json.dumps(kept, indent=1))
    print(f"wrote {CURVES}")
    return kept


def sweeps_of(kept: dict, periods: list[int]) -> list[Sweep]:
    """Each kept sweep evaluated as shipped, and every `periods` it is not (a multiple of EVERY)."""
    found = []
    for name, k in kept.items():
        curves = [{int(s): v for s, v in t["curve"].items()} for t in k["trials"]]
        for period in dict.fromkeys([k["period"], *(p for p in periods if p < k["steps"])]):
            found.append(Sweep(name, k["steps"], period, curves, [t["seconds_per_step"] for t in k["trials"]]))
    return found


def part_replay(kept: dict, periods: list[int]) -> list[dict]:
    rows = []
    for sweep in sweeps_of(kept, periods):
        base_best = min(c[sweep.steps] for c in sweep.curves)
        base_steps = sweep.steps * len(sweep.curves)
        for label, (name, settings) in {"none": ("none", {}), **CANDIDATES}.items():
            pruner = pruner_config(name, settings, sweep.period, sweep.steps)
            results = [replay(sweep, pruner, order) for order in orders(sweep)]
            worst = max(best for best, _, _ in results)
            rows.append({"sweep": sweep.name, "period": sweep.period, "pruner": label,
                         "best, as it ran": results[0][0] / base_best - 1, "worst of the orders": worst / base_best - 1,
                         "orders within 1%": sum(best <= 1.01 * base_best for best, _, _ in results) / len(results),
                         "trial-steps saved": 1 - sum(s for _, s, _ in results) / len(results) / base_steps})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| sweep (evaluated every) | pruner | best vs unpruned, as it ran | worst of 21 orders | orders within 1% | "
             "trial-steps saved (mean) |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['sweep']} ({r['period']}) | {r['pruner']} | {100 * r['best, as it ran']:+.2f}% | "
                     f"{100 * r['worst of the orders']:+.2f}% | {100 * r['orders within 1%']:.0f}% | "
                     f"{100 * r['trial-steps saved']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["curves", "replay"], choices=["curves", "replay"])
    parser.add_argument("--periods", type=int, nargs="*", default=[25, 50],
                        help="replay: evaluation periods to try beside each sweep's own (multiples of 25)")
    args = parser.parse_args()
    kept = part_curves() if "curves" in args.parts else json.loads(CURVES.read_text())
    if "replay" in args.parts:
        print(table(part_replay(kept, args.periods)), flush=True)


if __name__ == "__main__":
    main()
