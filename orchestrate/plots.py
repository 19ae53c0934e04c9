"""Loss curves as PNG files (matplotlib, no display needed).

A bare `Figure` draws with the Agg renderer: no pyplot, no GUI backend chosen for the whole
process, and matplotlib is imported only when a chart is drawn (not on a command that is refused).
"""

import logging
from pathlib import Path


class _LogFileOnly(logging.Filter):
    """On a console handler: matplotlib's notices below WARNING (on a fresh machine, "generated new
    fontManager" while it builds its font cache) are left to the run's log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] != "matplotlib"


def loss_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str) -> Path:
    """`curves`: label -> metric name -> [(step, value)]. Train loss solid, eval loss dashed,
    one colour per label, so several runs overlay on one chart."""
    from orchestrate.ort import console_filtered

    with console_filtered(_LogFileOnly()):
        return _draw(curves, path, title)


def _draw(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for i, (label, history) in enumerate(curves.items()):
        colour = f"C{i % 10}"
        for metric, style in (("train/loss", "-"), ("eval/loss", "--")):
            points = history.get(metric, [])
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, style, color=colour, marker="o" if len(points) < 4 else None,
                        label=f"{label} {metric}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a sweep whose trials all failed has no curve
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
