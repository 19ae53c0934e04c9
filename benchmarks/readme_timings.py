"""The guide's timing claims, measured: each command as the guide shows it, in a fresh folder,
median of --repeats, on this machine. Writes docs/readme-timings.md (the table, the machine, the
date) and puts the same rounded figures into the guide's sentences that state them (in README.md
or a docs/ page: tests/guide.py's pages, wherever the sentence now stands), so that a change that
moves a figure moves the guide with it (tests/test_readme.py keeps the two equal).

    python benchmarks/readme_timings.py               # 3 repeats each
    python benchmarks/readme_timings.py --repeats 1 --no-write   # print only

Claims (the guide's sentence, where it stands now -> command):
  default   "the default experiment (...) takes about N seconds" (README.md)     python -m orchestrate
  doctor    "orchestrate doctor ... (about N seconds on C cores)" (docs/doctor.md) python -m orchestrate doctor
  no_smoke  "orchestrate doctor --no-smoke ...: about N seconds" (docs/doctor.md) python -m orchestrate doctor --no-smoke
"""

import argparse
import datetime
import importlib.util
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _guide():
    """tests/guide.py (the guide's pages: README.md, then docs/*.md), loaded from its file: this
    script runs from a checkout, where `tests` is no package on the import path."""
    spec = importlib.util.spec_from_file_location("guide", ROOT / "tests" / "guide.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guide = _guide()

TABLE = ROOT / "docs" / "readme-timings.md"
COMMANDS = {
    "default": [sys.executable, "-m", "orchestrate"],
    "doctor": [sys.executable, "-m", "orchestrate", "doctor"],
    "no_smoke": [sys.executable, "-m", "orchestrate", "doctor", "--no-smoke"],
}
# Each claim's sentence in the guide, its figure as group 1.
CLAIMS = {
    "default": r"steps\) takes about (\d+) seconds",
    "doctor": r"smoke runs included \(about (\d+) seconds on \d+ cores\)",
    "no_smoke": r"the same without the smoke runs: about (\d+) seconds",
}


def measure(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            began = time.perf_counter()
            done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "ORCHESTRATE_STATE_DIR": folder})  # cold: no warm stack
            times.append(time.perf_counter() - began)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(argv[1:])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return statistics.median(times)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}"


def read_claims(text: str) -> dict[str, int]:
    """The figures `text` (the guide's: `guide.text()`) states, by claim; a SystemExit naming a
    sentence that is missing."""
    found = {}
    for name, pattern in CLAIMS.items():
        match = re.search(pattern, text)
        if match is None:
            raise SystemExit(f"the guide (README.md, docs/*.md) no longer says /{pattern}/: "
                             f"update CLAIMS in {__file__}")
        found[name] = int(match.group(1))
    return found


def write_claim(name: str, rounded: int) -> None:
    """Put `rounded` into the first of the guide's pages that states claim `name`."""
    for page in guide.pages():
        text = page.read_text()
        if re.search(CLAIMS[name], text):
            page.write_text(re.sub(CLAIMS[name], lambda m: m.group(0).replace(m.group(1), str(rounded)), text,
                                   count=1))
            return


def read_table(text: str) -> dict[str, int]:
    """docs/readme-timings.md's rounded figures, by claim."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| (\w+) \| `[^`]*` \| [\d.]+ \| (\d+) \|$", text,
                                                            re.MULTILINE)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    read_claims(guide.text())  # before minutes of measuring
    rows = []
    for name, argv in COMMANDS.items():
        seconds = measure(argv, args.repeats)
        rows.append((name, " ".join(["python", *argv[1:]]), seconds, round(seconds)))
        print(f"{name}: {seconds:.1f} s", flush=True)
    table = "\n".join(["| claim | command | median (s) | the guide says (s) |", "|---|---|---|---|",
                       *[f"| {n} | `{c}` | {s:.1f} | {r} |" for n, c, s, r in rows]])
    print(table)
    if args.no_write:
        return
    TABLE.write_text(
        "# The guide's timings\n\n"
        f"Measured by `python benchmarks/readme_timings.py` (median of {args.repeats}, each command in a fresh "
        f"folder, cold: no warm stack) on {machine()}, {datetime.date.today().isoformat()}. The guide (README.md, "
        "docs/doctor.md) states the rounded figures; this script writes both, and tests/test_readme.py keeps them "
        "equal.\n\n"
        f"{table}\n")
    for name, _, _, rounded in rows:
        write_claim(name, rounded)


if __name__ == "__main__":
    main()
