"""A Slurm sweep's job states where `sacct` does not answer (orchestrate/sweeps/slurm.py,
_squeue.py), against a stand-in `squeue` that prints what Slurm 22.05's prints: the controller's
states, a job it has forgotten, its own failure. On a real cluster: tests/launch/test_slurm.py."""

import logging
import os
import stat

import pytest
from submitit.core.utils import UncompletedJobError

from orchestrate.sweeps._squeue import ENDED, QueueWatcher
from orchestrate.sweeps.slurm import ended_without_result


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """squeue(stdout, stderr, code): the `squeue` on PATH prints them and exits with `code`."""

    def answer(stdout: str = "", stderr: str = "", code: int = 0) -> None:
        (tmp_path / "out").write_text(stdout)
        (tmp_path / "err").write_text(stderr)
        script = tmp_path / "squeue"
        script.write_text(f"#!/bin/sh\ncat {tmp_path / 'out'}\ncat {tmp_path / 'err'} >&2\nexit {code}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)

    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return answer


def watching(*job_ids: str) -> QueueWatcher:
    watcher = QueueWatcher(delay_s=600, squeue=True)
    for job_id in job_ids:
        watcher.register_job(job_id)
    return watcher


def test_states_come_from_squeue_and_a_forgotten_job_has_ended(squeue):
    squeue("JOBID|STATE|NODELIST\n7_0|RUNNING|vm\n7_1|CANCELLED|vm\n")
    watcher = watching("7_0", "7_1", "7_2")  # 7_2 ended long enough ago for the controller to drop it
    assert watcher.unfinished() == ["7_0"]
    assert [watcher.get_state(j, mode="cache") for j in ("7_0", "7_1", "7_2")] == ["RUNNING", "CANCELLED", ENDED]


def test_a_single_forgotten_job_is_squeues_error_and_has_ended(squeue):
    squeue(stderr="slurm_load_jobs error: Invalid job id specified", code=1)
    watcher = watching("9")
    assert watcher.unfinished() == [] and watcher.get_state("9", mode="cache") == ENDED


def test_a_failing_squeue_leaves_the_states_unknown_and_says_so(squeue, caplog):
    squeue(stderr="squeue: error: Unable to contact slurm controller", code=1)
    watcher = watching("7_0")
    with caplog.at_level(logging.WARNING):
        assert watcher.unfinished() == ["7_0"]
    assert "Unable to contact slurm controller" in caplog.text and "asked again at the next poll" in caplog.text


def test_a_job_that_ended_without_its_result_is_one_line():
    error = UncompletedJobError("Job 7_0 (task: 0) with path /sweep/.submitit/7_0/7_0_0_result.pkl\n"
                                "has not produced any output (state: CANCELLED)\nError stream produced:\n"
                                "----------------------------------------\nTraceback (most recent call last): ...")
    assert ended_without_result(error) == ("Slurm job 7_0 ended CANCELLED without its result (scancel, its time "
                                           "limit, its memory, a lost node); its output: /sweep/.submitit/7_0")
    assert ended_without_result(RuntimeError("Job 7_0 (task: 0) with path x has not produced any output")) is None
