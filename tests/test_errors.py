"""The error boundary (orchestrate.errors): an ordinary exception raised in each phase of a command
in turn ends in one `error:` line that names what failed and where, the exit code says whether
anything ran (2: no, 1: a run failed), the full traceback is in the run's log or a crash file,
and no MLflow run is left RUNNING."""

import re
import sys
from pathlib import Path

import pytest

from orchestrate.__main__ import main
from tests.conftest import client_for

BASE = ["backend=torch", "data=synthetic", "trainer=quick", "trainer.progress=false", "trainer.max_steps=6"]
FAILING_MODEL = ["model._target_=tests.helpers.FailingMLP"]

# (phase, overrides, the line's beginning as a regex, exit code, where the traceback goes)
PHASES = [
    ("a user's YAML file", ["--config-dir", "conf", "model=broken"],
     r"conf/model/broken\.yaml:3:1: not valid YAML \(while parsing a flow sequence; ", 2, None),
    ("a data set's constructor", ["data._target_=tests.helpers.FailingData"],
     r"data \(tests\.helpers\.FailingData\): RuntimeError: deliberate failure in the data set's constructor "
     r"\(.*tests/helpers\.py:\d+\)", 2, "crash"),
    ("a model's constructor", ["model._target_=tests.helpers.FailingInitMLP"],
     r"model \(tests\.helpers\.FailingInitMLP\): RuntimeError: deliberate failure in the model's constructor "
     r"\(.*tests/helpers\.py:\d+\)", 2, "crash"),
    ("the up-front check (the model's forward)", [*FAILING_MODEL, "+model.fail_at_call=1"],
     r"model \(tests\.helpers\.FailingMLP\) cannot run on data's sample batch of shape \[2, 16\] \(float32\): "
     r"deliberate failure at call 1; check the model's sizes", 2, None),
    ("making the output folder", ["hydra.run.dir=a_file/run"],
     r"NotADirectoryError: \[Errno 20\] Not a directory: 'a_file/run'", 2, "crash"),
    ("the run (the model's forward at a step)", [*FAILING_MODEL, "+model.fail_at_call=4"],
     r"RuntimeError: deliberate failure at call 4 \(.*tests/helpers\.py:\d+\) at step \d; "
     r"the MLflow run \w+ is marked FAILED", 1, "log"),
    ("a sweep's trial", ["-m", "hydra/launcher=basic", "hydra.callbacks.sweep_tracking.tracking_server=false",
                         "optimizer.lr=0.01", *FAILING_MODEL, "+model.fail_at_call=4"],
     r"the sweep: RuntimeError: deliberate failure at call 4 \(.*tests/helpers\.py:\d+\) at step \d", 1, "crash"),
]


@pytest.mark.parametrize("phase,overrides,line,code,traceback_in", PHASES, ids=[p[0] for p in PHASES])
def test_an_error_in_any_phase_is_one_line_an_exit_code_and_a_traceback_file(
        phase, overrides, line, code, traceback_in, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "broken.yaml").write_text("_target_: orchestrate.tasks.models.MLP\nhidden: [1, 2\n")
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(sys, "argv", ["orchestrate", *BASE, *overrides])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == code
    stderr = capsys.readouterr().err
    said = [s for s in stderr.splitlines() if s.startswith("error")]  # MLflow's own INFO lines aside
    assert "Traceback" not in stderr and len(said) == 1, stderr
    assert re.match(f"error: {line}", said[0]), said[0]
    if traceback_in is None:
        assert "full traceback" not in said[0]  # input, not a crash: the line is all there is
    else:
        path = Path(said[0].rsplit("; full traceback in ", 1)[1])
        text = path.read_text()
        assert "Traceback (most recent call last)" in text and "deliberate failure" in text or "Errno 20" in text
        if traceback_in == "log":
            assert path.is_relative_to(tmp_path / "outputs")  # the run's own log
        else:
            assert path.name.startswith("orchestrate-crash-")
            path.unlink()
    if (tmp_path / "mlflow.db").exists():  # no run left RUNNING
        client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert [r.info.status for r in runs if r.info.status == "RUNNING"] == []
        assert code == 1  # a run was opened only where one failed
        failed = [r for r in runs if r.info.status == "FAILED" and "deliberate failure" in r.data.tags.get("error", "")]
        assert failed, [(r.info.status, r.data.tags.get("error")) for r in runs]
        assert re.search(r"\(.*tests/helpers\.py:\d+\) at step \d", failed[0].data.tags["error"])


def test_hydra_full_error_prints_the_traceback_too(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["orchestrate", *BASE, "model._target_=tests.helpers.FailingInitMLP"])
    with pytest.raises(SystemExit):
        main()
    stderr = capsys.readouterr().err
    assert "Traceback (most recent call last)" in stderr and stderr.strip().splitlines()[-1].startswith("error: ")
    Path(stderr.strip().rsplit("; full traceback in ", 1)[1]).unlink()
