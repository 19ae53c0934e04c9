"""What a runner worker saves by building its job without checking it (issue 32): `Job.prepare`
(ranges, build, the model's forward and loss on the sample batch, the optimizer, the engine's own
checks: for ondevice, a build of its training artifacts) against `Job.build` (the objects only),
which is what each worker now runs, the driver having checked the config. Medians, in one process,
after one warm-up of each (imports, the data set's cache).

    python benchmarks/job_checks.py
    python benchmarks/job_checks.py --repeats 9
"""

import argparse
import statistics
import tempfile
import time

from orchestrate.config import load_config
from orchestrate.job import Job

CASES = [  # (engine, overrides): the runner's engines on the default model, and the transformer
    ("torch", []),
    ("ondevice", []),
    ("ondevice", ["model=char_transformer", "data=python_source", "trainer.batch_size=16"]),
]


def median_ms(call, cfg, folder: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call(cfg, folder)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| runner config | Job.prepare (ms) | Job.build (ms) | saved per worker (ms) |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for engine, overrides in CASES:
            cfg = load_config(["backend=runner", f"backend.engine={engine}", *overrides])
            Job.prepare(cfg, folder)
            Job.build(cfg, folder)
            checked = median_ms(Job.prepare, cfg, folder, args.repeats)
            built = median_ms(Job.build, cfg, folder, args.repeats)
            print(f"| backend.engine={engine} {' '.join(overrides)} | {checked:.0f} | {built:.0f} | "
                  f"{checked - built:.0f} |")


if __name__ == "__main__":
    main()
