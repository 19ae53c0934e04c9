"""Checkpoints: written at their period and after the last step, atomically, the newest kept;
every worker's `on_save` is called, only the writer writes; every backend's loads back as a
state that can travel to the runner's workers."""

import errno
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch

from orchestrate import checkpoints, process, signals
from orchestrate.checkpoints import CheckpointError, Checkpoints
from orchestrate.job import Job
from orchestrate.schema import ConfigError, TrainerConf


def test_period_last_step_and_rotation(tmp_path):
    saved = []
    ckpt = Checkpoints(TrainerConf(max_steps=25, checkpoint_period=10, max_num_checkpoints=2), tmp_path)
    ckpt.on_save = lambda step, path: saved.append((step, path))
    for step in range(1, 26):
        ckpt.save(step, lambda path: Path(path).write_text("weights"), suffix=".pt")
    assert [s for s, _ in saved] == [10, 20, 25]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000020.pt", "step_0000025.pt"]


def test_a_failed_write_leaves_the_last_finished_checkpoint_and_says_why_in_one_line(tmp_path):
    ckpt = Checkpoints(TrainerConf(max_steps=20, checkpoint_period=10), tmp_path)
    ckpt.save(10, lambda path: Path(path).write_text("step 10"), suffix=".pt")

    def full_disk(path):
        Path(path).write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError) as failed:
        ckpt.save(20, full_disk, suffix=".pt")
    message = str(failed.value)
    assert message.startswith(f"checkpoint step 20 not written to {tmp_path}: No space left on device (")
    assert message.endswith("KiB free on its file system); the last finished one, step_0000010.pt, is kept")
    assert "\n" not in message
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000010.pt"]  # no temporary file left either
    assert (tmp_path / "step_0000010.pt").read_text() == "step 10"


def test_torch_full_disk_error_names_the_cause(tmp_path):
    """torch's zip writer reports a failed write by its position only; the OSError under it says why."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 448 vs 342")
        except RuntimeError as e:
            error = e
    assert checkpoints.write_cause(error, tmp_path).startswith("No space left on device (")
    assert checkpoints.write_cause(RuntimeError("ORT: FAIL : cannot write\nmore"), tmp_path) in (
        "cannot write", *(f"cannot write ({n} KiB free on its file system)" for n in range(1024)))


def test_a_write_cut_off_by_ctrl_c_leaves_no_file(tmp_path):
    """A signal's KeyboardInterrupt (orchestrate.signals.Stopped) in the middle of a write goes on
    up as it is, and neither a half file nor its temporary name stays behind."""
    ckpt = Checkpoints(TrainerConf(max_steps=20, checkpoint_period=10), tmp_path)
    ckpt.save(10, lambda path: Path(path).write_text("step 10"), suffix=".pt")

    def cut_off(path):
        Path(path).write_text("half")
        raise signals.Stopped(signal.SIGTERM)

    with pytest.raises(signals.Stopped):
        ckpt.save(20, cut_off, suffix=".pt")
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000010.pt"]


def test_a_stop_signal_that_torch_save_turns_into_its_own_error_still_stops_the_run(tmp_path):
    """torch's zip writer turns the KeyboardInterrupt raised in its write callback into a
    RuntimeError ("unexpected pos"): a signal that landed inside the write is still a stop (the
    run ends KILLED), not a checkpoint that could not be written (FAILED)."""
    ckpt = Checkpoints(TrainerConf(max_steps=20, checkpoint_period=10), tmp_path)

    def interrupted(path):
        Path(path).write_bytes(b"half")
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Stopped here, inside the write
            signal.sigtimedwait([], 1)
        except signals.Stopped:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 26432 vs 26324") from None

    with signals.stop_on_signals(), pytest.raises(signals.Stopped) as stopped:
        ckpt.save(10, interrupted, suffix=".pt")
    assert stopped.value.signum == signal.SIGTERM and list(tmp_path.iterdir()) == []


def test_a_writer_killed_midway_leaves_no_half_file_under_the_final_name(tmp_path):
    """SIGKILL cannot be cleaned up after: the half file stays under its temporary name, which a
    resume never takes (it looks for step_*), and the last finished checkpoint still loads."""
    ckpt = Checkpoints(TrainerConf(max_steps=20, checkpoint_period=10), tmp_path)
    ckpt.save(10, lambda path: torch.save({"step": 10}, path), suffix=".pt")

    def killed(path):
        with open(path, "wb") as f:
            f.write(b"PK half a zip")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    pid = os.fork()  # the writer is a process of its own, killed in the middle of its write
    if pid == 0:
        try:
            ckpt.save(20, killed, suffix=".pt")
        finally:
            os._exit(1)  # not reached: the write kills it
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_step_0000020.pt", "step_0000010.pt"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000010.pt"]
    assert checkpoints.load_torch(tmp_path / "step_0000010.pt")["step"] == 10


def test_only_the_writer_writes_but_every_worker_reports(tmp_path):
    saved = []
    ckpt = Checkpoints(TrainerConf(max_steps=10, checkpoint_period=5), tmp_path, writer=False)
    ckpt.on_save = lambda step, path: saved.append((step, path))
    for step in range(1, 11):
        ckpt.save(step, lambda path: Path(path).write_text("x"), suffix=".pt")
    assert saved == [(5, None), (10, None)]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("backend", ["torch", "ondevice"])
def test_every_backend_loads_its_checkpoint_as_a_picklable_state_with_where_the_run_stands(backend, make_cfg, tmp_path):
    """From the file or its bytes (as the runner's workers get it from Ray), a backend's checkpoint
    loads as a state that pickles (Ray's object store) and holds the same counts in every format."""
    job = Job.prepare(make_cfg(f"backend={backend}", "trainer.max_steps=7", "trainer.checkpoint_period=0"), tmp_path)
    with process.kept():  # as app.train runs it: ORT's logging settings are put back afterwards
        job.backend.fit(job)
    (path,) = (tmp_path / "checkpoints").glob("step_0000007*")
    state = job.backend.load_checkpoint(path)
    assert pickle.loads(pickle.dumps(state)).keys() == state.keys()
    where = checkpoints.progress(7, job)
    assert where == {"step": 7, "micro_steps": 7, "round": 0, "data_index": 7, "world_size": 1}
    assert {k: state[k] for k in where} == where
    assert job.backend.load_checkpoint(path.read_bytes())["step"] == 7

    # What a resume loads is checked whole first: a truncated file and another model's weights are
    # refused with one message naming the file, and the other model is left untouched.
    truncated = tmp_path / f"truncated{path.suffix}"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConfigError, match=f"checkpoint {truncated}: not a readable backend={backend} checkpoint"):
        checkpoints.load_checked(job.backend, job.model, truncated)
    other = Job.prepare(make_cfg(f"backend={backend}", "model.hidden=[32]"), tmp_path / "other")
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"holds another model's weights \(.*\(model: \("):
        checkpoints.load_checked(other.backend, other.model, path)
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())
    assert checkpoints.load_checked(job.backend, job.model, path)["step"] == 7


def test_a_restored_optimizer_takes_the_config_s_learning_rate():
    """A diverged run goes on with a lower optimizer.lr (trainer.resume): the restored optimizer
    and schedule use the config's rate, not the one stored with their state."""
    from types import SimpleNamespace

    import torch

    from orchestrate.checkpoints import restore_torch
    from orchestrate.schema import TrainerConf

    model = torch.nn.Linear(3, 2)
    before = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    before.step()
    import random

    import numpy as np

    kind, key, *rest = np.random.get_state()  # the process's own RNG states: restoring changes nothing
    state = {"optimizer": before.state_dict(), "scheduler": None, "step": 5,
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                     "numpy": (kind, torch.from_numpy(key.astype(np.int64)), *rest), "cuda": []}}
    after = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(after, lambda step: 0.5)
    state["scheduler"] = schedule.state_dict()
    job = SimpleNamespace(lr=0.01, trainer=TrainerConf(lr_schedule="linear", max_steps=10))
    assert restore_torch(state, after, schedule, job=job) == 5
    assert after.param_groups[0]["lr"] == pytest.approx(0.01 * job.trainer.lr_factor(5))
    assert schedule.base_lrs == [0.01] and after.state_dict()["state"]  # AdamW's moments kept
