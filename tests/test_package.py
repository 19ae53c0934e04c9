"""The package as pyproject.toml ships it: this checkout's wheel installed into a fresh venv
(tests/conftest.py: installed_wheel), run from an empty folder, far from the checkout. Training
from the wheel, with `python -m orchestrate` and with the `orchestrate` console script, on every
backend and from a user's own config folder, is what tests/test_readme.py runs: the guide's
commands, with this same environment."""

import subprocess
import tomllib
import zipfile

from tests.conftest import ROOT

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


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


def test_console_script_refuses_bad_input(installed_wheel, tmp_path):
    done = run(installed_wheel, "orchestrate", "backend=nope", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: backend=nope: no such choice; "
                                   "allowed: auto, compile, ondevice, ortmodule, runner, torch")
    assert list(tmp_path.iterdir()) == []
