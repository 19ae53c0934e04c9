"""The guide's pictures of the MLflow UI (docs/tracking.md, docs/compare.md), taken in a real
headless browser against a real `mlflow ui`: a backend sweep is run (`+experiment=backend_shootout
+sweep`, shortened), then the experiment's runs page and the compare view of its trials are saved
to docs/. With --compare: a comparison (`+sweep=compare`) and a two-objective sweep
(`+sweep=tradeoff`) are run instead, and their parent runs' artifacts (the comparison's table and
chart, the Pareto front's table and chart) are saved as docs/mlflow_comparison*.png and
docs/mlflow_pareto*.png.

    make screenshots            # or: .venv/bin/python scripts/mlflow_ui_screenshot.py [--steps 100] [--compare]

Needs Chromium (Debian: `apt-get install chromium`) and Playwright's Python client
(`pip install -c constraints.txt '.[docs]'`); Playwright drives the system's Chromium, it downloads
no browser. Everything binds 127.0.0.1.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrate.cluster.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXPERIMENT = "backend_shootout"
# Chromium on a machine with no route out: without these it keeps trying Google's services.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def run_sweep(folder: Path, steps: int) -> str:
    store = f"sqlite:///{folder}/mlflow.db"
    subprocess.run([sys.executable, "-m", "orchestrate", "+experiment=backend_shootout", "+sweep",
                    f"trainer.max_steps={steps}", "trainer.progress=false", f"tracking.uri={store}"],
                   cwd=folder, check=True, timeout=1200)
    return store


def run_compare_sweeps(folder: Path, steps: int) -> str:
    """A comparison (two backends, 3 repeats) and a two-objective sweep, in one store."""
    store = f"sqlite:///{folder}/mlflow.db"
    common = [f"trainer.max_steps={steps}", "trainer.progress=false", f"tracking.uri={store}",
              f"tracking.experiment={EXPERIMENT}"]
    for sweep in (["+sweep=compare", "backend=torch,ondevice"],
                  ["+sweep=tradeoff", "hydra.sweeper.n_trials=10", "backend=choice(torch,ondevice)"]):
        subprocess.run([sys.executable, "-m", "orchestrate", *sweep, *common], cwd=folder, check=True, timeout=1200)
    return store


def shoot_parents(page, url: str, experiment_id: str, parents: dict[str, str]) -> list[Path]:
    """Each parent run's artifacts in the UI: its table (the .json, as MLflow shows a logged
    table) and its chart (the .png); `parents`: picture name -> (run id, table, chart)."""
    taken = []
    for name, (run_id, table, chart) in parents.items():
        open_page(page, f"{url}/#/experiments/{experiment_id}/runs/{run_id}/artifacts", table)
        for artifact, suffix in ((table, "_table"), (chart, "")):
            page.get_by_text(artifact, exact=True).first.click()  # the artifact tree's entry
            page.wait_for_timeout(2500)
            close = page.get_by_role("button", name="Close")
            if close.count():
                close.first.click()
            path = DOCS / f"mlflow_{name}{suffix}.png"
            page.screenshot(path=path)
            taken.append(path)
    return taken


def start_ui(store: str, folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store,
                             "--host", "127.0.0.1", "--port", str(port)], cwd=folder,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"mlflow ui did not answer at {url}/health within 120 s") from None
            time.sleep(0.5)


def open_page(page, address: str, shows: str, tries: int = 3) -> None:
    """Go to `address` and wait until the page shows `shows`. The UI's first page after a start
    sometimes renders "Something went wrong" (seen with mlflow 3.17 under load): load it again."""
    for attempt in range(tries):
        page.goto(address, wait_until="commit", timeout=120_000)  # the UI keeps polling: no "load" to wait for
        try:
            page.get_by_text(shows).first.wait_for(timeout=40_000)
            return
        except Exception:
            if attempt == tries - 1:
                raise
            page.reload(wait_until="commit")


def shoot_runs(page, url: str, experiment_id: str, parent: str, path: Path) -> None:
    """The experiment's runs page with the sweep's parent run (`parent`, its name) expanded."""
    open_page(page, f"{url}/#/experiments/{experiment_id}/runs", parent)  # the runs table is there
    page.wait_for_timeout(1500)
    close = page.get_by_role("button", name="Close")  # the UI's assistant panel, if it opened
    if close.count():
        close.first.click()
    # Open the sweep's row: its trials are nested under it (the expander sits left of the name).
    box = page.get_by_text(parent).first.bounding_box()
    page.mouse.click(box["x"] - 32, box["y"] + box["height"] / 2)
    page.wait_for_timeout(1500)
    page.screenshot(path=path)


def shoot(page, url: str, experiment_id: str, trial_ids: list[str]) -> None:
    shoot_runs(page, url, experiment_id, "sweep-backends", DOCS / "mlflow_runs.png")
    query = urllib.parse.urlencode({"runs": json.dumps(trial_ids), "experiments": json.dumps([experiment_id])})
    open_page(page, f"{url}/#/compare-runs?{query}", "final/eval_loss")
    page.wait_for_timeout(2500)  # the charts draw after the data arrives
    page.screenshot(path=DOCS / "mlflow_compare.png", full_page=True)


def shoot_server(args) -> int:
    """--server: the runs page of a server that is running (a large sweep's, scripts/scale.py)."""
    from playwright.sync_api import sync_playwright

    experiment = MlflowClient(args.server).get_experiment_by_name(args.experiment)
    if experiment is None:
        print(f"error: --experiment={args.experiment}: no such experiment at {args.server}", file=sys.stderr)
        return 2
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            shoot_runs(page, args.server, experiment.experiment_id, args.parent, args.out)
        finally:
            browser.close()
    print(f"wrote {args.out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="trainer.max_steps of each trial")
    parser.add_argument("--store", help="an MLflow store that already holds a backend_shootout sweep (no new sweep)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--compare", action="store_true",
                        help="a comparison and a two-objective sweep: their parent runs' tables and charts")
    parser.add_argument("--server", help="an MLflow server already running (its URL): only its runs page, of "
                        "--experiment with the --parent run expanded, saved as --out; no sweep is run")
    parser.add_argument("--experiment", default=EXPERIMENT)
    parser.add_argument("--parent", default="sweep-backends", help="the parent run's name (with --server)")
    parser.add_argument("--out", type=Path, default=DOCS / "mlflow_runs.png", help="the picture (with --server)")
    args = parser.parse_args()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("error: Playwright's Python client is missing; pip install -c constraints.txt '.[docs]'",
              file=sys.stderr)
        return 2
    if not Path(args.chromium).exists():
        print(f"error: no Chromium at {args.chromium}; apt-get install chromium, or --chromium PATH", file=sys.stderr)
        return 2
    DOCS.mkdir(exist_ok=True)
    if args.server:
        return shoot_server(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        store = args.store or (run_compare_sweeps if args.compare else run_sweep)(folder, args.steps)
        client = MlflowClient(store)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        runs = client.search_runs([experiment.experiment_id])
        trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
        parents = {r.info.run_name: r.info.run_id for r in runs if r.data.tags.get("orchestrate.role") == "sweep"}
        ui, url = start_ui(store, folder)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                try:
                    if args.compare:
                        taken = shoot_parents(page, url, experiment.experiment_id, {
                            "comparison": (parents["sweep-compare"], "comparison.json", "comparison.png"),
                            "pareto": (parents["sweep-tradeoff"], "pareto_front.json", "pareto_front.png")})
                    else:
                        shoot(page, url, experiment.experiment_id, [r.info.run_id for r in trials])
                        taken = [DOCS / "mlflow_runs.png", DOCS / "mlflow_compare.png"]
                except Exception:
                    page.screenshot(path=folder.parent / "mlflow_ui_failed.png")
                    print(f"the page at the failure: {folder.parent / 'mlflow_ui_failed.png'}", file=sys.stderr)
                    raise
                finally:
                    browser.close()
        finally:
            ui.terminate()
            try:
                ui.wait(timeout=30)
            except subprocess.TimeoutExpired:
                ui.kill()
    print(f"wrote {', '.join(map(str, taken))} ({len(trials)} trials)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
