"""Loss curves as PNG files (matplotlib, no display needed)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def loss_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str) -> Path:
    """`curves`: label -> metric name -> [(step, value)]. Train loss solid, eval loss dashed,
    one colour per label, so several runs overlay on one chart."""
    fig, ax = plt.subplots(figsize=(8, 5))
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
    plt.close(fig)
    return path
