"""The sweep's summary table: one row per trial, read back from its MLflow child run, ranked by
`sweep.metric` in the sweep's direction, with the speed columns that tell apart trials that learn
equally well, and, for a pruning sweep, where each pruned trial stopped and how much of the full
budget (trial-steps run / trial-steps without pruning) the sweep spent.

Time to target: the target is the worst of the finished trials' best values of the metric (for a
loss, the highest of their lowest losses), so every finished trial reached it; a trial's time is
from its child run's start to the timestamp of its first point at or past the target (MLflow
keeps a timestamp with every metric point). Trials whose best values differ by less than the
tolerance (relative) are a tie, and the verdict says which of them got there first and which ran
fastest, instead of naming a winner by noise."""

from dataclasses import dataclass, field

from orchestrate import cpu

DONE = ("FINISHED", "SKIPPED")


@dataclass
class Row:
    index: int
    name: str  # the trial's own overrides
    status: str  # FINISHED, FAILED, KILLED, SKIPPED (finished in an earlier attempt), CANCELLED (stopped by the sweep)
    run_id: str | None = None
    start_ms: int | None = None
    end_ms: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the run's latest value of each metric
    max_steps: int | None = None  # the trial's trainer.max_steps
    pruned_at: int | None = None  # the step the sweep's pruner stopped it at
    curve: list[tuple[int, float]] = field(default_factory=list)  # (timestamp ms, value) of the sweep metric
    error: str = ""
    params: dict[str, str] = field(default_factory=dict)  # the run's cpu.* params: the CPU budget it trained with

    @property
    def cpu(self) -> str:
        """The CPU budget it trained with, "threads + loader processes of cores" (orchestrate.cpu.shown)."""
        return cpu.shown(self.params)

    @property
    def wall_time_s(self) -> float | None:
        return (self.end_ms - self.start_ms) / 1000 if self.start_ms and self.end_ms else None

    @property
    def steps_run(self) -> int | None:
        """Training steps this trial ran: to the end, or to where it was pruned (None: it did not finish)."""
        if self.status not in DONE:
            return None
        return self.pruned_at if self.pruned_at is not None else self.max_steps

    @property
    def shown_status(self) -> str:
        if self.pruned_at is None:
            return self.status
        return f"PRUNED at {self.pruned_at}" + (" (earlier attempt)" if self.status == "SKIPPED" else "")


def history_key(metric: str) -> str:
    """`eval_loss` (the name a trial returns) -> `eval/loss` (the curve it logs)."""
    return metric.replace("_", "/", 1)


def best(row: Row, metric: str, lower: bool) -> float | None:
    if row.curve:
        return (min if lower else max)(v for _, v in row.curve)
    return row.metrics.get(f"final/{metric}")


def time_to(row: Row, level: float, lower: bool) -> float | None:
    """Seconds from the run's start to its first point at or past `level`."""
    for stamp, value in sorted(row.curve):
        if (value <= level) if lower else (value >= level):
            return (stamp - row.start_ms) / 1000 if row.start_ms else None
    return None


def _cell(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(rows: list[Row], metric: str, tolerance: float, lower: bool = True, pruner: bool = False) -> str:
    """Markdown table, then one line: the best trial (`lower`: the metric is better low), or the
    tie and who was fastest in it; for a sweep with a pruner (`pruner`) or one that pruned, where
    and the budget spent."""
    bests = {r.index: best(r, metric, lower) for r in rows}
    reached = [r for r in rows if r.status in DONE and bests[r.index] is not None]
    target = (max if lower else min)(bests[r.index] for r in reached) if reached else None
    to_target = f"s to {metric} {'<=' if lower else '>='} {_cell(target, '.4f')}"
    head = ["trial", "overrides", "status", "final train loss", f"best {metric}", to_target, "samples/s",
            "step time (ms)", "CPU: threads + loader of cores", "wall time (s)", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: r.index):
        m = r.metrics
        cells = [str(r.index), r.name, r.shown_status, _cell(m.get("final/train_loss"), ".4f"),
                 _cell(bests[r.index], ".4f"), _cell(time_to(r, target, lower) if target is not None else None, ".1f"),
                 _cell(m.get("final/samples_per_sec"), ",.0f"), _cell(m.get("final/step_time_ms"), ".2f"), r.cpu,
                 _cell(r.wall_time_s, ".1f"), r.error.replace("\n", " ").replace("|", "/")[:120]]
        lines.append("| " + " | ".join(cells) + " |")
    if reached:
        lines += ["", verdict(reached, bests, metric, tolerance, lower)]
    if pruner or any(r.pruned_at is not None for r in rows):
        lines.append(pruning(rows))
    return "\n".join(lines)


def pruning(rows: list[Row]) -> str:
    """Which trials were pruned and where, and the trial-steps run against those of the same
    trials run to the end (trials that did not finish are left out of both)."""
    pruned = [r for r in rows if r.pruned_at is not None]
    counted = [r for r in rows if r.steps_run is not None and r.max_steps]
    run, full = sum(r.steps_run for r in counted), sum(r.max_steps for r in counted)
    where = ": " + ", ".join(f"{r.index} (step {r.pruned_at})" for r in sorted(pruned, key=lambda r: r.index)) \
        if pruned else ""
    return (f"pruned: {len(pruned)} of {len(counted)} trials{where}; trial-steps run: {run:,} of {full:,} "
            f"without pruning ({100 * run / full:.0f}% of the budget)" if full else f"pruned: {len(pruned)}{where}")


def verdict(reached: list[Row], bests: dict[int, float], metric: str, tolerance: float, lower: bool = True) -> str:
    top = (min if lower else max)(reached, key=lambda r: bests[r.index])
    optimum = bests[top.index]
    tied = sorted((r for r in reached if abs(bests[r.index] - optimum) <= tolerance * abs(optimum)),
                  key=lambda r: r.index)
    if len(tied) < 2:
        return f"best: trial {top.index} ({top.name}), {metric} = {optimum:.4f}"
    level = (max if lower else min)(bests[r.index] for r in tied)  # a value every tied trial reached
    text = (f"tie: trials {', '.join(str(r.index) for r in tied)} reach {metric} {level:.4f} "
            f"within {tolerance * 100:g}%")
    timed = [(t, r) for r in tied if (t := time_to(r, level, lower)) is not None]
    if timed:
        seconds, fastest = min(timed, key=lambda p: p[0])
        text += f"; fastest to it: trial {fastest.index} ({fastest.name}, {seconds:.1f} s)"
    rates = [r for r in tied if r.metrics.get("final/samples_per_sec") is not None]
    if rates:
        quick = max(rates, key=lambda r: r.metrics["final/samples_per_sec"])
        text += (f"; highest throughput: trial {quick.index} "
                 f"({quick.metrics['final/samples_per_sec']:,.0f} samples/s)")
    return text


def front_table(front: list[Row], objectives: list[tuple[str, bool]], finished: int) -> str:
    """The Pareto front of a sweep over several objectives: the finished trials (not pruned) that
    no other finished trial dominates (no worse on every objective, better on one)."""
    names = [f"{m} ({'min' if low else 'max'})" for m, low in objectives]
    lines = [f"Pareto front: {len(front)} of {finished} finished trials (not pruned), the ones no other "
             "trial beats on one objective without losing on another",
             "| trial | overrides | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for r in front:
        lines.append(f"| {r.index} | {r.name} | " + " | ".join(_cell(r.metrics.get(f"final/{m}"), ".4g")
                                                            for m, _ in objectives) + " |")
    return "\n".join(lines)
