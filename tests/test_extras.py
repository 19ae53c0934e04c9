"""Optional parts (orchestrate/extras.py): a config that needs a package this environment lacks is
refused in one line naming the extra, before anything runs; backend=auto leaves such a backend
out and says why; a sweep refuses it after checking the other trials. Shown with a backend whose
extra is missing on every stack (tests.helpers.NeedsAMissingPackage), as ORT's are where ORT is not
installed (`make test STACK=current`)."""

import sys

import pytest

from orchestrate.cli import main
from orchestrate.extras import ORT, Extra
from tests.helpers import command_exit, exit_code

ABSENT = "backend=absent needs the package absent_pkg: pip install 'orchestrate[absent]'"
BACKEND = "defaults:\n  - torch\n  - _self_\n_target_: tests.helpers.NeedsAMissingPackage\nname: absent\n"
QUICK = ["data=synthetic", "trainer=quick", "trainer.max_steps=10"]


@pytest.fixture
def conf(tmp_path, monkeypatch):
    """A user's folder with conf/backend/absent.yaml: the torch backend behind a missing extra."""
    (tmp_path / "conf" / "backend").mkdir(parents=True)
    (tmp_path / "conf" / "backend" / "absent.yaml").write_text(BACKEND)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_present_reads_the_files_without_importing():
    assert Extra("x", "numpy", "numpy").present() and Extra("x", "numpy's linalg", "numpy.linalg").present()
    assert not Extra("x", "a missing part", "numpy.no_such_part").present()
    assert not Extra("x", "a missing package", "no_such_package_at_all").present()
    assert "no_such_package_at_all" not in sys.modules


def test_the_line_names_the_install_the_pythons_it_has_wheels_for_and_what_else_it_needs():
    extra = Extra("ort", "ORT's training build", "no_such_package_at_all", below_python=(3, 14))
    assert extra.missing("backend=ortmodule", also="torch 2.6").startswith(
        "backend=ortmodule needs ORT's training build: pip install 'orchestrate[ort]' (Python 3.11, 3.12 or 3.13, "
        "torch 2.6)")
    beyond = Extra("ort", "ORT's training build", "no_such_package_at_all", below_python=(3, 11))
    assert beyond.missing("backend=ondevice").endswith(
        f"; this is Python {sys.version_info[0]}.{sys.version_info[1]}, which it has no wheel for")
    assert Extra("x", "numpy", "numpy").missing("model=m") is None


def test_orts_line_names_the_pythons_of_its_wheels():
    assert ORT.below_python == (3, 13)
    if not ORT.present():  # the current stack: what `backend=ortmodule` says there
        assert ORT.missing("backend=ortmodule", also="torch 2.6").startswith(
            "backend=ortmodule needs ORT's training build: pip install 'orchestrate[ort]' (Python 3.11 or 3.12, "
            "torch 2.6)")


def test_a_backend_whose_extra_is_missing_is_refused_in_one_line_before_anything_is_written(conf, monkeypatch,
                                                                                             capsys):
    assert exit_code(monkeypatch, "--config-dir", "conf", "backend=absent", *QUICK) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {ABSENT}"
    assert sorted(p.name for p in conf.iterdir()) == ["conf"]  # no mlflow.db, no outputs/


def test_a_sweep_refuses_the_missing_backend_after_checking_the_others(conf, monkeypatch, capsys):
    assert exit_code(monkeypatch, "--config-dir", "conf", "-m", "backend=torch,absent,compile", *QUICK) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: trial 1 (backend=absent ") and f"): {ABSENT}" in err
    assert err.endswith("; the sweep's other 2 trial(s) were checked and train here: drop the ones named")
    assert sorted(p.name for p in conf.iterdir()) == ["conf"]


def test_a_sweep_whose_other_trial_is_wrong_names_that_one(conf, monkeypatch, capsys):
    assert exit_code(monkeypatch, "--config-dir", "conf", "-m", "backend=torch,absent", "optimizer.lr=-1", *QUICK) == 2
    assert "optimizer.lr=-1" in capsys.readouterr().err  # the other trials were checked


def test_auto_leaves_the_missing_backend_out_and_says_why(conf, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["orchestrate", "--config-dir", "conf", "backend=auto",
                                     "backend.candidates=[absent,torch]", *QUICK, f"hydra.run.dir={tmp_path / 'out'}"])
    main()
    table = (tmp_path / "out" / "auto_probe.md").read_text()
    assert "| torch " in table and "chosen" in table
    (row,) = [line for line in table.splitlines() if line.startswith("| absent ")]
    assert row.rstrip(" |").endswith(f"refused: {ABSENT}")


def test_a_model_whose_module_needs_a_missing_extra_is_refused_naming_it(tmp_path, monkeypatch):
    """model=hf_causal_lm without transformers: the module of its `_target_` imports a package an
    extra brings; the refusal names the extra instead of the ImportError."""
    from omegaconf import OmegaConf

    from orchestrate import extras, schema

    (tmp_path / "users_models.py").write_text("import absent_pkg_for_orchestrate_tests\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(extras, "EXTRAS", (*extras.EXTRAS, Extra("absent", "the package absent_pkg",
                                                                 "absent_pkg_for_orchestrate_tests")))
    with pytest.raises(schema.ConfigError) as refused:
        schema.target_of(OmegaConf.create({"_target_": "users_models.Net"}), "model")
    assert str(refused.value) == ("model._target_=users_models.Net needs the package absent_pkg: "
                                  "pip install 'orchestrate[absent]'")


def test_orchestrate_server_without_postgresqls_driver_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    from orchestrate import extras
    from orchestrate.commands import server

    monkeypatch.setattr(extras, "SERVER", Extra("server", "PostgreSQL's driver for MLflow (psycopg2)",
                                                "absent_pkg_for_orchestrate_tests"))
    assert command_exit(server.main, ["--data-dir", str(tmp_path / "server")]) == 2
    assert capsys.readouterr().err.strip() == ("error: orchestrate server needs PostgreSQL's driver for MLflow "
                                               "(psycopg2): pip install 'orchestrate[server]'")
    assert not (tmp_path / "server").exists()
