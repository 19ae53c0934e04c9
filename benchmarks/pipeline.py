"""Pipeline stages against data parallelism on the same workers: per-worker peak memory, the
pipeline's idle share against its schedule's theory, and throughput. Writes docs/pipeline.md's
table (printed too; between its markers) and docs/pipeline.png.

    python benchmarks/pipeline.py                    # the figures of docs/pipeline.md (about 20 minutes)
    python benchmarks/pipeline.py --hidden 1024 --layers 4 --repeats 1    # a quick look

Every run goes through `orchestrate.app.train` as a user's command does: backend=runner with the
torch engine, 2 workers of 1 CPU each on a local Ray, AdamW, the synthetic data set (its features
widened to the model's width), the same seed and the same global batch (64 samples a step) in
every configuration; MLflow on a throwaway SQLite store. Each run starts a local Ray of its own, so
its workers are new processes (an RSS high-water mark is a process's, whatever it ran before), and
the configurations take turns `--repeats` times (medians; samples/s with its range). The model is an MLP of `--layers` square
layers of `--hidden` units: its parameters and AdamW's two moments dominate a worker's memory.

- D = 2: two data-parallel workers, each holding the whole model (and its optimizer state): what
  one process needs, on a worker like a stage's. P = 2: the model cut in 2 stages (balanced by
  parameters), one per worker, the same micro-batch count M for GPipe and for 1F1B.
- Peak memory: each worker's RSS high-water mark while training (`perf/peak_rss_mb/rank_<r>`, read
  at the last display step), the largest of the two; the ratio P = 2 / D = 2 is "per-worker peak
  memory against one process". Beside it the peak at the end (`perf/peak_rss_end_mb`), which adds
  the model assembled on rank 0 and its ONNX export.
- Idle share: each stage's time waiting in a receive (or for its sends) over its schedule time,
  the steps after the first (`perf/pipeline_idle_share`, the mean of the stages), against
  (P-1)/(M+P-1), GPipe's bubble with equal stages and free communication.
- Throughput: samples/s over the steps after the first display window (`final/samples_per_sec`).
"""

import argparse
import contextlib
import shutil
import statistics
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrate import app
from orchestrate.config import load_config

DOCS = Path(__file__).resolve().parents[1] / "docs"
TABLE_BEGIN, TABLE_END = "<!-- measured: benchmarks/pipeline.py writes this table -->", "<!-- /measured -->"


def run(folder: Path, name: str, args, *overrides: str) -> dict[str, float]:
    width = args.hidden
    cfg = load_config([
        "backend=runner", "backend.engine=torch", "data=synthetic", f"data.num_features={width}",
        "model=mlp", f"model.hidden=[{','.join([str(width)] * args.layers)}]", "optimizer=adamw",
        f"trainer.max_steps={args.steps}", "trainer.display_loss_steps=1", "trainer.evaluation_period=0",
        "trainer.checkpoint_period=0", "trainer.progress=false", "trainer.num_workers=2",
        "tracking.log_checkpoints=false", f"tracking.uri=sqlite:///{folder}/mlflow.db", *overrides])
    result = app.train(cfg, folder / name)
    metrics = MlflowClient(f"sqlite:///{folder}/mlflow.db").get_run(result.run_id).data.metrics
    print(f"  {name}: {', '.join(f'{k}={v:.4g}' for k, v in sorted(metrics.items()) if k.startswith(('perf/', 'final/')))}")
    shutil.rmtree(result.out_dir)  # its last checkpoint, Ray Train's copy and model.onnx: 3.6 GB a run at the defaults
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 4], help="micro-batches M per step (P = 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved (medians)")
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args()
    params = args.layers * args.hidden * (args.hidden + 1) + args.hidden * 2 + 2
    print(f"MLP {args.layers} x {args.hidden} ({params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MiB in fp32)")
    configs = [("D = 2 (data-parallel)", "-", ["trainer.batch_size=32"])]
    configs += [(f"P = 2, {schedule}", m, ["trainer.pipeline_parallel_size=2", f"trainer.pipeline_schedule={schedule}",
                                           f"trainer.gradient_accumulation_steps={m}", f"trainer.batch_size={64 // m}"])
                for schedule in ("gpipe", "1f1b") for m in args.micro]
    runs: dict[tuple, list[dict[str, float]]] = {(label, m): [] for label, m, _ in configs}
    # In a folder of its own: MLflow keeps a SQLite store's artifacts (each run's 0.5 GB model) under the working folder.
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        for repeat in range(args.repeats):  # interleaved: the machine's drift lands on every configuration alike
            for label, m, overrides in configs:
                runs[label, m].append(run(Path(tmp), f"{label} M{m} #{repeat}".replace(" ", "_"), args, *overrides))
    rows = [(label, m, runs[label, m]) for label, m, _ in configs]
    base = median(rows[0][2], "perf/peak_rss_mb"), median(rows[0][2], "final/samples_per_sec")
    lines = [f"MLP of {args.layers} layers x {args.hidden} ({params / 1e6:.1f}M parameters), AdamW, global batch 64, "
             f"{args.steps} steps, 2 workers x 1 CPU, torch engine; medians of {args.repeats} interleaved runs "
             "(samples/s: median, min-max).", "",
             "| run | M | idle, theory (P-1)/(M+P-1) | idle, measured | peak RSS per worker, training (MiB) | x D = 2 "
             "| with the final eval and export (MiB) | samples/s | x D = 2 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, m, got in rows:
        idle = median(got, "perf/pipeline_idle_share") if m != "-" else None
        mem, speed = median(got, "perf/peak_rss_mb"), median(got, "final/samples_per_sec")
        spread = [r["final/samples_per_sec"] for r in got]
        lines.append(f"| {label} | {m} | {f'{1 / (m + 1):.2f}' if m != '-' else '-'} | "
                     f"{f'{idle:.2f}' if idle is not None else '-'} | {mem:,.0f} | {mem / base[0]:.2f} | "
                     f"{median(got, 'perf/peak_rss_end_mb'):,.0f} | {speed:,.1f} ({min(spread):,.1f}-{max(spread):,.1f}) | "
                     f"{speed / base[1]:.2f} |")
    print("\n".join(lines))
    page = args.out / "pipeline.md"  # the table between its markers; the page's words are kept
    if page.exists():
        text = page.read_text()
        begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN) + 1, text.index(TABLE_END)
        page.write_text(text[:begin] + "\n".join(lines) + "\n" + text[end:])
    draw(rows, args.out / "pipeline.png")


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def draw(rows, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6))
    idle, memory = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for schedule, marker in (("gpipe", "o"), ("1f1b", "s")):
        pts = [(m, median(got, "perf/pipeline_idle_share")) for label, m, got in rows if label.endswith(schedule)]
        idle.plot([m for m, _ in pts], [v for _, v in pts], marker=marker, label=f"measured, {schedule}")
    ms = sorted({m for _, m, _ in rows if m != "-"})
    idle.plot(ms, [1 / (m + 1) for m in ms], "k--", label="theory (P-1)/(M+P-1)")
    idle.set(xlabel="micro-batches M", ylabel="idle share of a stage", title="P = 2: the pipeline's bubble")
    idle.legend()
    labels = [f"{label}{'' if m == '-' else f' M={m}'}" for label, m, _ in rows]
    memory.barh(labels, [median(got, "perf/peak_rss_mb") for _, _, got in rows])
    memory.set(xlabel="peak RSS per worker, training (MiB)", title="memory: stages against replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
