"""The package as pyproject.toml ships it: this checkout's wheel installed into a fresh venv
(tests/conftest.py: installed_wheel), run from an empty folder, far from the checkout."""

import subprocess
import tomllib
import zipfile

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, metric_steps

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# train/loss is logged every 25 steps by default: once in a 20-step run, too few to see it fall.
LOSS_EVERY_5 = ("trainer.display_loss_steps=5",)


def run(installed_wheel, *args: str, cwd) -> subprocess.CompletedProcess:
    """A bare command (`python`, `orchestrate`) as the venv's PATH resolves it."""
    return subprocess.run(args, cwd=cwd, env={**installed_wheel.env, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                          text=True, timeout=600)


def test_imports_orchestrate_from_the_wheel(installed_wheel, tmp_path):
    done = run(installed_wheel, "python", "-c", "import orchestrate; print(orchestrate.__file__, orchestrate.__version__)",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    file, version = done.stdout.split()
    venv = installed_wheel.bin.parent
    assert file.startswith(f"{venv}/") and not file.startswith(f"{ROOT}/"), file
    assert version == VERSION


def test_wheel_holds_the_configs_and_the_ray_launcher(installed_wheel):
    names = set(zipfile.ZipFile(installed_wheel.wheel).namelist())
    shipped = [*(ROOT / "orchestrate" / "conf").rglob("*.yaml"),
               *(ROOT / "hydra_plugins" / "orchestrate_ray_launcher").glob("*.py")]
    assert len(shipped) > 20
    missing = sorted(str(p.relative_to(ROOT)) for p in shipped if str(p.relative_to(ROOT)) not in names)
    assert not missing, f"not in {installed_wheel.wheel.name}: {missing}"
    assert "orchestrate/conf/__init__.py" in names
    # hydra_plugins is a namespace package shared with other plugins (optuna, submitit): no __init__.py.
    assert "hydra_plugins/__init__.py" not in names


def finished_run(folder, experiment: str):
    """The one run in the MLflow store that the command created in `folder`."""
    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {folder}/mlflow.db"
    (found,) = client.search_runs([exp.experiment_id])
    assert found.info.status == "FINISHED"
    assert found.data.tags["version.orchestrate"] == VERSION
    assert "final/eval_accuracy" in found.data.metrics
    losses = [v for _, v in metric_steps(client, found.info.run_id, "train/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    return found


@pytest.mark.slow
def test_python_m_orchestrate_trains(installed_wheel, tmp_path):
    done = run(installed_wheel, "python", "-m", "orchestrate", "backend=torch", "trainer.max_steps=20",
               "trainer.progress=false", *LOSS_EVERY_5, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert finished_run(tmp_path, "orchestrate").data.tags["backend"] == "torch"


@pytest.mark.slow
def test_console_script_trains_a_shipped_experiment(installed_wheel, tmp_path):
    done = run(installed_wheel, "orchestrate", "backend=ondevice", "+experiment=backend_shootout",
               "trainer.max_steps=20", "trainer.progress=false", *LOSS_EVERY_5, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert finished_run(tmp_path, "backend_shootout").data.tags["backend"] == "ondevice"


def test_console_script_refuses_bad_input(installed_wheel, tmp_path):
    done = run(installed_wheel, "orchestrate", "backend=nope", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: backend=nope: no such choice; allowed: ondevice, ortmodule, runner, torch"
    assert list(tmp_path.iterdir()) == []
