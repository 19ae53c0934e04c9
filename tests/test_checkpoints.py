"""Checkpoints: written at their period and after the last step, atomically, the newest kept;
every worker's `on_save` is called, only the writer writes."""

from pathlib import Path

from orchestrate.checkpoints import Checkpoints
from orchestrate.schema import TrainerConf


def test_period_last_step_and_rotation(tmp_path):
    saved = []
    ckpt = Checkpoints(TrainerConf(max_steps=25, checkpoint_period=10, max_num_checkpoints=2), tmp_path)
    ckpt.on_save = lambda step, path: saved.append((step, path))
    for step in range(1, 26):
        ckpt.save(step, lambda path: Path(path).write_text("weights"), suffix=".pt")
    assert [s for s, _ in saved] == [10, 20, 25]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000020.pt", "step_0000025.pt"]


def test_a_failed_write_leaves_the_last_finished_checkpoint(tmp_path):
    ckpt = Checkpoints(TrainerConf(max_steps=20, checkpoint_period=10), tmp_path)
    ckpt.save(10, lambda path: Path(path).write_text("step 10"), suffix=".pt")

    def crash(path):
        Path(path).write_text("half")
        raise OSError("disk full")

    try:
        ckpt.save(20, crash, suffix=".pt")
    except OSError:
        pass
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_0000010.pt"]
    assert (tmp_path / "step_0000010.pt").read_text() == "step 10"


def test_only_the_writer_writes_but_every_worker_reports(tmp_path):
    saved = []
    ckpt = Checkpoints(TrainerConf(max_steps=10, checkpoint_period=5), tmp_path, writer=False)
    ckpt.on_save = lambda step, path: saved.append((step, path))
    for step in range(1, 11):
        ckpt.save(step, lambda path: Path(path).write_text("x"), suffix=".pt")
    assert saved == [(5, None), (10, None)]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
