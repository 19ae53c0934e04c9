"""The boundary's table (orchestrate.boundary), row by row: what each entry point's stage turns an
exception into (the line, the exit code, the traceback kept or not). The commands end to end are
tests/test_errors.py's and tests/test_cli.py's."""

import re

import pytest

from orchestrate import signals
from orchestrate.boundary import CHECK, COMMAND, RUN, TABLE, TOOL, Where, boundary
from orchestrate.errors import mark
from orchestrate.schema import ConfigError


def exits(where: Where, error: BaseException, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped, boundary(where):
        raise error
    return stopped.value.code, capsys.readouterr().err.strip()


def test_a_refusal_is_its_own_line_exit_2_with_the_trial_it_came_from(capsys):
    code, said = exits(Where(CHECK, trial="trial 3 (optimizer.lr=-1): "), ConfigError("optimizer.lr=-1: below 0"),
                       capsys)
    assert (code, said) == (2, "error: trial 3 (optimizer.lr=-1): optimizer.lr=-1: below 0")


def test_a_run_stopped_by_a_signal_exits_as_a_shell_reports_it(capsys):
    code, said = exits(Where(RUN), signals.Stopped(15), capsys)
    assert code == 128 + 15 and said.startswith("stopped by SIGTERM: the MLflow run is marked KILLED")


def test_a_command_stopped_by_ctrl_c_or_a_signal_says_so_in_one_line(capsys):
    assert exits(Where(TOOL), KeyboardInterrupt(), capsys) == (130, "stopped by Ctrl-C")
    assert exits(Where(TOOL, prefix="orchestrate slurm-ray: "), signals.Stopped(15), capsys) == \
        (143, "orchestrate slurm-ray: stopped by SIGTERM")


def test_a_failed_run_names_its_mlflow_run_and_keeps_the_traceback(tmp_path, capsys):
    error = RuntimeError("deliberate")
    mark(error, run="abc123")
    code, said = exits(Where(RUN, log_file=str(tmp_path / "app.log")), error, capsys)
    assert code == 1
    # The line names where the error came from: here, this file (the user's code, to the boundary).
    assert re.fullmatch(r"error: RuntimeError: deliberate \(tests/test_boundary\.py:\d+\); the MLflow run abc123 is "
                        rf"marked FAILED; full traceback in {re.escape(str(tmp_path / 'app.log'))}", said)
    assert "Traceback" in (tmp_path / "app.log").read_text()


def test_ctrl_c_ends_a_sweep_with_130_and_goes_on_up_from_a_single_run(capsys):
    where = Where(COMMAND, multirun=True)
    code, said = exits(where, KeyboardInterrupt(), capsys)
    assert code == 130 and said.startswith("stopped by Ctrl-C") and isinstance(where.handled, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt), boundary(Where(COMMAND, multirun=False)):
        raise KeyboardInterrupt


def test_every_stage_ends_in_a_row_for_any_exception():
    """No exception of any stage leaves as a traceback: each stage's last row takes them all."""
    for stage in (CHECK, RUN, COMMAND):
        rows = [row for row in TABLE if stage in row.stages]
        assert rows[-1].types == (Exception,) and rows[-1].traceback, stage


def test_a_sweep_whose_tracking_cannot_start_is_failed_s_row_past_hydra(tmp_path, monkeypatch, capsys):
    """The sweep callback's error passes Hydra's `except Exception` around callbacks (errors.Escaped)
    and gets errors.Failed's row: one line, exit 1, the cause's traceback kept."""
    from omegaconf import OmegaConf

    from orchestrate.errors import Escaped
    from orchestrate.sweeps import _runs, callbacks

    def refuse(*args):
        raise RuntimeError("the store is read-only")

    monkeypatch.setattr(_runs, "Sweep", refuse)
    tracking = callbacks.SweepTracking(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="x")
    with pytest.raises(Escaped) as escaped:
        tracking.on_multirun_start(config=OmegaConf.create({}))
    assert not isinstance(escaped.value, Exception)  # what Hydra's callback wrapper would catch
    code, said = exits(Where(COMMAND, log_file=str(tmp_path / "sweep.log")), escaped.value, capsys)
    assert code == 1 and said == ("error: the sweep's MLflow tracking could not start: RuntimeError: the store is "
                                  f"read-only; full traceback in {tmp_path / 'sweep.log'}")
    assert "the store is read-only" in (tmp_path / "sweep.log").read_text()
