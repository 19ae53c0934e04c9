"""Charts as PNG files (matplotlib, no display needed): loss curves, a comparison, a Pareto front.

A bare `Figure` draws with the Agg renderer: no pyplot, no GUI backend chosen for the whole
process, and matplotlib is imported only when a chart is drawn (not on a command that is refused).
"""

import logging
from pathlib import Path

LOSSES = ("train/loss", "eval/loss")
LEGEND_MAX = 20  # curves on a chart with a legend; past it, none (a large sweep's chart of its trials)


class _LogFileOnly(logging.Filter):
    """On a console handler: matplotlib's notices below WARNING (on a fresh machine, "generated new
    fontManager" while it builds its font cache) are left to the run's log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] != "matplotlib"


def loss_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str,
                metrics: tuple[str, ...] = LOSSES) -> Path:
    """`curves`: label -> metric name -> [(step, value)], of which `metrics` are drawn: train loss
    solid, eval loss (or another metric) dashed, one colour per label, so several runs overlay on
    one chart."""
    from orchestrate.ort import console_filtered

    with console_filtered(_LogFileOnly()):
        return _draw(curves, path, title, metrics)


def _draw(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str,
          metrics: tuple[str, ...]) -> Path:
    """Every run draws one, at its end: the loss axis is labelled in plain numbers (0.2, 1), not
    matplotlib's mathtext powers of ten, and the margins are fixed (no tight layout, which measures
    every label): 0.05 s instead of 0.15 s of each run's end."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for i, (label, history) in enumerate(curves.items()):
        colour = f"C{i % 10}"
        for metric in metrics:
            points, style = history.get(metric, []), "-" if metric.startswith("train/") else "--"
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, style, color=colour, marker="o" if len(points) < 4 else None,
                        label=f"{label} {metric}", linewidth=1.5 if len(curves) <= LEGEND_MAX else 0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss" if all("loss" in m for m in metrics) else ", ".join(metrics))
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)  # the powers of ten; within a decade the 2, 3, ... 9 between them too
    low, high = ax.get_ylim()
    ax.yaxis.set_minor_formatter(plain if high < 10 * low else NullFormatter())
    many = len(curves) > LEGEND_MAX  # a large sweep's: a legend of every trial would cover the chart
    ax.set_title(f"{title}: {len(curves)} runs (no legend: MLflow's chart view tells them apart)" if many else title)
    ax.grid(True, alpha=0.3)
    if not many and ax.get_legend_handles_labels()[0]:  # a sweep whose trials all failed has no curve
        ax.legend(fontsize="small")
    fig.subplots_adjust(left=0.09, right=0.97, bottom=0.1, top=0.93)
    fig.savefig(path, dpi=100)
    return path


def comparison(result, path: Path) -> Path:
    """A comparison (orchestrate.sweeps.compare.Comparison): the eval loss against the seconds
    since each run started, every repeat a line in its configuration's colour (their spread is the
    spread of the runs), beside each configuration's samples/s with its interval."""
    from orchestrate.ort import console_filtered

    with console_filtered(_LogFileOnly()):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(12, 5))
        curves, rates = fig.subplots(1, 2)
        for i, g in enumerate(result.groups):
            colour = f"C{i % 10}"
            for k, r in enumerate(g.repeats):
                if r.evals and r.start_ms:
                    points = sorted(r.evals)
                    curves.plot([(t - r.start_ms) / 1000 for t, _ in points], [v for _, v in points], "-o",
                                color=colour, alpha=0.6, markersize=3, label=g.name if k == 0 else None)
            rate = g.figures.get("samples_per_sec")
            if rate is not None:
                error = [[rate.mean - rate.low], [rate.high - rate.mean]] if rate.n > 1 else None
                rates.bar(i, rate.mean, yerr=error, color=colour, capsize=6)
        if result.target is not None:
            curves.axhline(result.target, color="grey", linestyle=":", label=f"target {result.target:.4f}")
        curves.set(xlabel="seconds since the run started", ylabel="eval loss", yscale="log",
                   title=f"eval loss against wall time ({result.repeats} repeats each)")
        curves.grid(True, alpha=0.3)
        if curves.get_legend_handles_labels()[0]:
            curves.legend(fontsize="small")
        rates.set_xticks(range(len(result.groups)), [g.name for g in result.groups], rotation=20, fontsize="small")
        rates.set(ylabel="samples/s", title=f"throughput, mean and {result.confidence:.0%} interval")
        rates.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    return path


def pareto(points: dict[int, list[float]], front: set[int], names: list[str], path: Path) -> Path:
    """A sweep over several objectives: every finished trial by its first two objectives, the
    Pareto front's trials marked, labelled and joined."""
    from orchestrate.ort import console_filtered

    with console_filtered(_LogFileOnly()):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 5))
        ax = fig.subplots()
        others = [v for i, v in points.items() if i not in front]
        if others:
            ax.scatter([v[0] for v in others], [v[1] for v in others], color="grey", alpha=0.6, label="trials")
        ours = sorted((points[i], i) for i in front)
        if ours:
            ax.plot([v[0] for v, _ in ours], [v[1] for v, _ in ours], "o-", color="C3", label="Pareto front")
            for v, i in ours:
                ax.annotate(f"#{i}", (v[0], v[1]), textcoords="offset points", xytext=(4, 4), fontsize="small")
        ax.set(xlabel=names[0], ylabel=names[1], title="trials by objective")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    return path
