"""A comparison (`+sweep=compare`): the same model and data trained by several configurations
(by default each backend), each `compare.repeats` times, and what the repeats say with how sure
they are.

The sweep varies `compare.repeat` first and the backend second, so that Hydra's grid runs repeat 0
of every backend, then repeat 1 of every backend, ...: a drift in the machine's speed lands on
every backend alike. Every run has the same seed, so the same batches: a backend's loss curve can
be set against the baseline's (eager torch) step by step.

Per configuration (its trials' overrides without compare.repeat), over its repeats: samples/s, the
seconds to the target eval loss (`compare.target`, or the baseline's: the worst of its repeats'
best, which every baseline repeat reached), the first window's warm-up, the memory peak and the
final eval metrics, each as a mean with a `compare.confidence` interval (Student's t), and the
largest gap between its train loss and the baseline's at the same steps of the same repeat. A
verdict names a winner only where its interval is clear of every other's; otherwise it says that
no difference is measurable at this many repeats.

Why a sweep config and not a command of its own: a comparison is a multirun in every respect
(trials, launcher, parent and child runs, resume, Slurm), so it is one more sweep, and its
summary is this module's instead of the ranking's (orchestrate.sweeps._runs).
"""

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from orchestrate.schema import ConfigError

REPEAT_KEY = "compare.repeat"
_REPEAT = re.compile(r"(^|,)\+?compare\.repeat=\d+")


def is_comparison(swept: Sequence[str]) -> bool:
    """Whether a sweep that varies these keys (`plan.search_space` overrides) is a comparison."""
    return any(o.split("=", 1)[0].lstrip("+~") == REPEAT_KEY for o in swept)


def check(cfg: DictConfig) -> None:
    """A comparison needs an interval per configuration: at least 2 repeats. Before anything runs."""
    from orchestrate.sweeps import plan

    if not is_comparison(plan.search_space(cfg)):
        return
    repeats = {int(t.split("=", 1)[1]) for trial in plan.trials(cfg) for t in trial
               if t.split("=", 1)[0].lstrip("+") == REPEAT_KEY}
    if len(repeats) < 2:
        raise ConfigError(f"compare.repeats={OmegaConf.select(cfg, 'compare.repeats')}: a comparison's verdict needs an "
                          "interval, so at least 2 runs of each configuration; allowed: compare.repeats=2 or more "
                          "(3 by default)")


def group_of(trial_name: str) -> str:
    """A trial's configuration: its overrides without compare.repeat."""
    return _REPEAT.sub("", trial_name).strip(",") or "(defaults)"


@dataclass
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float], confidence: float) -> "Interval | None":
        """The mean with its Student's t interval; None for no values, a point for one."""
        values = [v for v in values if v is not None and math.isfinite(v)]
        if not values:
            return None
        n, mean = len(values), sum(values) / len(values)
        if n == 1:
            return cls(mean, math.nan, math.nan, 1)
        from scipy.stats import t

        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        half = t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
        return cls(mean, mean - half, mean + half, n)

    def clear_of(self, other: "Interval") -> bool:
        """Whether the two intervals do not overlap (either has none: not clear)."""
        if math.isnan(self.low) or math.isnan(other.low):
            return False
        return self.low > other.high or self.high < other.low

    def shown(self, spec: str) -> str:
        if math.isnan(self.low):
            return format(self.mean, spec)
        return f"{format(self.mean, spec)} [{format(self.low, spec)}, {format(self.high, spec)}]"


@dataclass
class Repeat:
    """One run of a configuration, as its MLflow child run holds it."""

    group: str
    status: str
    run_id: str | None = None
    start_ms: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the final metrics, final/ left off
    losses: list[tuple[int, float]] = field(default_factory=list)  # train/loss: (step, value)
    evals: list[tuple[int, float]] = field(default_factory=list)  # eval/loss: (timestamp ms, value)
    repeat: int = 0
    params: dict[str, str] = field(default_factory=dict)  # the run's logged config

    def seconds_to(self, level: float) -> float | None:
        """Seconds from the run's start to its first evaluation at or below `level`."""
        for stamp, value in sorted(self.evals):
            if value <= level:
                return (stamp - self.start_ms) / 1000 if self.start_ms else None
        return None


# What the table and the verdicts report, per configuration: (key, column, format, higher is better).
FIGURES = [("samples_per_sec", "samples/s", ",.0f", True), ("time_to_target", "s to target", ".2f", False),
           ("warmup_s", "warm-up (s)", ".2f", False), ("peak_rss_mb", "peak RSS (MiB)", ",.0f", False),
           ("eval_loss", "eval loss", ".4f", False), ("eval_accuracy", "eval accuracy", ".4f", True)]
VERDICTS = [("samples_per_sec", "samples/s"), ("time_to_target", "time to target")]


@dataclass
class Group:
    name: str
    repeats: list[Repeat]
    figures: dict[str, Interval | None] = field(default_factory=dict)
    reached: int = 0  # repeats that reached the target
    best_eval: float | None = None  # the lowest eval loss any of its repeats reached
    deviation: float | None = None  # the largest |train loss - the baseline's| at the same step of the same repeat


@dataclass
class Comparison:
    groups: list[Group]
    baseline: str  # the baseline group's name
    target: float | None
    confidence: float

    @property
    def repeats(self) -> int:
        return min((len(g.repeats) for g in self.groups), default=0)

    def verdicts(self) -> dict[str, str]:
        return {key: verdict({g.name: g.figures.get(key) for g in self.groups}, higher, label, self.repeats)
                for (key, label), higher in zip(VERDICTS, (True, False))}

    def table(self) -> str:
        """Markdown: one row per configuration, then the target and the verdicts."""
        head = ["configuration", "runs", *(f"{label} mean [{self.confidence:.0%} CI]" for _, label, _, _ in FIGURES),
                f"max abs train-loss gap to {self.baseline}"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for g in self.groups:
            cells = [g.name, str(len(g.repeats))]
            for key, _, spec, _ in FIGURES:
                value = g.figures.get(key)
                cell = value.shown(spec) if value else ""
                if key == "time_to_target" and value and g.reached < len(g.repeats):
                    cell += f" ({g.reached} of {len(g.repeats)} reached it)"
                if key == "time_to_target" and not value and self.target is not None and g.best_eval is not None:
                    cell = f"not reached (best {g.best_eval:.4f})"
                cells.append(cell)
            cells.append("(baseline)" if g.name == self.baseline else "" if g.deviation is None else f"{g.deviation:.2e}")
            lines.append("| " + " | ".join(cells) + " |")
        target = "none (no baseline run reached an evaluation)" if self.target is None else f"eval loss <= {self.target:.4f}"
        lines += ["", f"target: {target}; intervals: Student's t at {self.confidence:.0%} over each configuration's runs"]
        lines += [f"verdict, {label}: {self.verdicts()[key]}" for key, label in VERDICTS]
        return "\n".join(lines)


def verdict(intervals: dict[str, Interval | None], higher_better: bool, what: str, repeats: int) -> str:
    """A winner only where its interval is clear of every other configuration's; otherwise the
    configurations whose intervals overlap the best one's, with no difference measurable between
    them, and the ones clearly behind."""
    known = {name: i for name, i in intervals.items() if i is not None}
    if len(known) < 2:
        return f"nothing to compare ({len(known)} configuration(s) with a {what})"
    ranked = sorted(known, key=lambda n: known[n].mean, reverse=higher_better)
    top = known[ranked[0]]
    tied = [n for n in ranked if n == ranked[0] or not top.clear_of(known[n])]
    behind = [n for n in ranked if n not in tied]
    missing = [n for n in intervals if n not in known]
    tail = (f"; behind: {', '.join(behind)}" if behind else "") + \
           (f"; none measured: {', '.join(missing)}" if missing else "")
    if len(tied) == 1:
        return f"{ranked[0]} wins ({'highest' if higher_better else 'lowest'} {what}, its interval clear of every other's){tail}"
    return f"no difference measurable at {repeats} repeats between {', '.join(tied)} (their intervals overlap){tail}"


def compare(repeats: list[Repeat], baseline_backend: str, target: float | None, confidence: float) -> Comparison:
    """The repeats grouped by configuration (in the order first run), with their figures."""
    groups: dict[str, Group] = {}
    for r in repeats:
        groups.setdefault(r.group, Group(r.group, [])).repeats.append(r)
    done = {name: [r for r in g.repeats if r.status in ("FINISHED", "SKIPPED")] for name, g in groups.items()}
    baseline = next((n for n in groups if f"backend={baseline_backend}" in n.split(",")), next(iter(groups), ""))
    if target is None and done.get(baseline):
        bests = [min(v for _, v in r.evals) for r in done[baseline] if r.evals]
        target = max(bests) if bests else None
    base_losses = {r.repeat: dict(r.losses) for r in done.get(baseline, [])}
    for name, g in groups.items():
        runs = done[name]
        g.figures = {key: Interval.of([r.metrics.get(key) for r in runs], confidence)
                     for key, _, _, _ in FIGURES if key != "time_to_target"}
        g.best_eval = min((v for r in runs for _, v in r.evals), default=None)
        times = [t for r in runs if target is not None and (t := r.seconds_to(target)) is not None]
        g.reached = len(times)
        g.figures["time_to_target"] = Interval.of(times, confidence)
        gaps = [abs(v - base_losses[r.repeat][s]) for r in runs if r.repeat in base_losses
                for s, v in r.losses if s in base_losses[r.repeat]]
        g.deviation = max(gaps) if gaps and name != baseline else None
    return Comparison(list(groups.values()), baseline, target, confidence)


def differing(params: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The config keys whose values differ between configurations (`params`: configuration ->
    its logged config), each with every configuration's value ("-" where it has no such key):
    what tells the configurations apart, and nothing else."""
    keys = sorted({k for p in params.values() for k in p} - {REPEAT_KEY})
    out = {}
    for key in keys:
        values = {name: p.get(key, "-") for name, p in params.items()}
        if len(set(values.values())) > 1:
            out[key] = values
    return out
