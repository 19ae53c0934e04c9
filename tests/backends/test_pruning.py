"""Every single-process backend's loop stops where a pruning sweep's pruner says (Meter.stop_early
after the evaluation), reports the step, and exports no model (it lost). The runner's ranks:
tests/test_meter.py (rank 1 takes rank 0's answer) and, end to end in a sweep,
tests/sweeps/test_optuna_sweeper.py::test_the_runners_workers_stop_together_where_the_pruner_says."""

import pytest

from orchestrate import process
from orchestrate.config import load_config
from orchestrate.job import Job
from tests.backends.test_contract import backend_target
from tests.conftest import BACKENDS
from tests.test_meter import StopAt

SINGLE = [b for b in BACKENDS if not backend_target(b).distributed and b != "auto"]


@pytest.mark.parametrize("backend", SINGLE)
def test_the_loop_stops_at_the_pruned_step(backend, tmp_path):
    job = Job.prepare(load_config([f"backend={backend}", "data=synthetic", "trainer=quick", "trainer.max_steps=40",
                                   "trainer.evaluation_period=10", "trainer.checkpoint_period=0"]), tmp_path)
    job.meter.trial = StopAt(20)
    with process.kept(), job.backend.connect(job):
        job.backend.fit(job)
    assert job.meter.pruned_at == 20 and job.meter.step == 20
    assert [s for s, _ in job.meter.history["eval/loss"]] == [10, 20]
    assert max(s for s, _ in job.meter.history["train/loss"]) == 20
    assert not (tmp_path / "model.onnx").exists()
