"""trainer.resume's lookup: which run and checkpoint a resume continues, and its plain errors."""

import pytest

from orchestrate import app
from orchestrate.schema import ConfigError
from orchestrate.tracking.resume import find_resume


def test_resume_errors_name_the_key(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="trainer.resume=abc: no MLflow store at"):
        find_resume(make_cfg("trainer.resume=abc"))
    assert not (tmp_path / "mlflow.db").exists()  # asking created nothing

    same = ("backend=torch", "trainer.checkpoint_period=0")
    finished = app.train(make_cfg(*same), tmp_path / "out")
    with pytest.raises(ConfigError, match="trainer.resume=abc: no such run in .*; allowed: auto or a run id"):
        find_resume(make_cfg("trainer.resume=abc"))
    with pytest.raises(ConfigError, match=r"another config \(differs at optimizer.lr\)"):
        find_resume(make_cfg(*same, "optimizer.lr=0.5", f"trainer.resume={finished.run_id}"))
    point = find_resume(make_cfg(*same, f"trainer.resume={finished.run_id}"))
    assert point.run_id == finished.run_id and point.step == 30  # its last (and only) checkpoint
    assert find_resume(make_cfg(*same, "trainer.resume=auto")) is None  # finished: nothing to go on with


def test_a_checkpoint_only_in_mlflow_is_downloaded(make_cfg, tmp_path):
    import shutil

    run = app.train(make_cfg("backend=torch"), tmp_path / "out")
    shutil.rmtree(tmp_path / "out")  # another machine: only the MLflow store has the checkpoint
    point = find_resume(make_cfg("backend=torch", f"trainer.resume={run.run_id}"))
    assert point.local is None and point.artifact == "checkpoints/step_0000030.pt"
    assert point.fetch(tmp_path / "new").read_bytes()[:2] == b"PK"  # a torch zip file
