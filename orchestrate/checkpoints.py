"""Checkpoints: when to write them, how (atomically, the newest few kept, each logged to MLflow),
where a run stands at one (`progress`, in every backend's checkpoints), and what a PyTorch
checkpoint holds so that a run resumes exactly where it stopped. Each backend reads its own
format back (`Backend.load_checkpoint`): the on-device API's is ORT's CheckpointState
(`orchestrate.backends.ondevice`).

A checkpoint is written to a temporary name and renamed, so a crash never leaves a half-written
file where a finished one was expected: the last finished checkpoint always survives. A write that
fails (a full disk) or is cut off (Ctrl-C, SIGTERM) removes its temporary file; a failed one stops
the run with one line naming the folder and the cause (CheckpointError).
"""

import errno
import io
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchestrate import signals
from orchestrate.errors import CheckpointError
from orchestrate.schema import ConfigError, TrainerConf


class Checkpoints:
    """Writes `<out_dir>/checkpoints/step_NNNNNNN<suffix>` at `trainer.checkpoint_period` and after
    the last step. Only the writer (rank 0 of the runner's workers) writes; every worker calls
    `save`, so that `on_save` (the runner's report to Ray Train) is called on all of them alike."""

    def __init__(self, trainer: TrainerConf, folder: Path | None, tracker: Any = None, log_to_tracker: bool = True,
                 writer: bool = True, sample: Callable[[], Any] | None = None):
        self.trainer, self.folder, self.tracker = trainer, folder, tracker
        self.log_to_tracker, self.writer = log_to_tracker, writer
        self.sample = sample  # the data's sample batch (numpy), for the signature of each checkpoint's model
        self.on_save: Callable[[int, Path | None], None] | None = None
        self.seconds = 0.0  # time spent writing: the meter leaves it out of the step times
        self.requested: int | None = None  # a step made a checkpoint step (`request`)

    def save(self, step: int, write: Callable[[Path], None], suffix: str,
             export: Callable[[Path], None] | None = None) -> Path | None:
        """At checkpoint steps, `write(path)` a checkpoint; returns its path (None elsewhere, and
        on workers that do not write). Logged to MLflow (tracking.log_checkpoints), the checkpoint
        is also a model: `export(path)` writes it as ONNX, logged as the LoggedModel
        `checkpoint-<step>` linked to its step and last evaluation, as MLflow's deep-learning guide
        logs checkpoints (the last step's is the run's own model: Job.export_model)."""
        if not (self.trainer.due(step, self.trainer.checkpoint_period) or step == self.requested):
            return None
        began = time.perf_counter()
        path = None
        if self.writer:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"step_{step:07d}{suffix}"
            tmp = self.folder / f".tmp_step_{step:07d}{suffix}"
            try:
                write(tmp)
                if self.tracker is not None:
                    # Every step up to this checkpoint reaches MLflow before the checkpoint counts (the
                    # rename below): a run resumed from it logs only the steps after it, so none may
                    # still be queued. Flushed after the rename, a kill in between lost steps 390-1000
                    # of a run resumed from step 1000.
                    self.tracker.flush()
                os.replace(tmp, path)
            except BaseException as e:
                # Cut off (a signal's KeyboardInterrupt) or failed: no half file stays behind, and
                # a full disk gets back the space the partial file took.
                tmp.unlink(missing_ok=True)
                stopped = signals.stopped_by() if isinstance(e, Exception) else None
                if stopped is not None:
                    # A stop signal that landed inside torch.save: its zip writer turns the
                    # KeyboardInterrupt raised in its write callback into a RuntimeError ("unexpected
                    # pos"). The run was stopped (KILLED), not failed.
                    raise stopped from e
                if isinstance(e, Exception):
                    raise CheckpointError(self._not_written(step, suffix, e)) from e
                raise
            for old in sorted(self.folder.glob(f"step_*{suffix}"))[: -self.trainer.max_num_checkpoints]:
                old.unlink()
            if self.tracker is not None and self.log_to_tracker:
                self.tracker.log_artifact(path, "checkpoints")
                if export is not None and self.sample is not None and step < self.trainer.max_steps:
                    with tempfile.TemporaryDirectory() as tmp:
                        export(Path(tmp) / "model.onnx")  # the weights of this step: exported now
                        self.tracker.log_model(Path(tmp) / "model.onnx", self.sample(), step,
                                               name=f"checkpoint-{step}")
        if self.on_save is not None:
            self.on_save(step, path)
        self.seconds += time.perf_counter() - began
        return path


    def request(self, step: int) -> None:
        """Make `step` a checkpoint step too (its `save`, later in the same step, writes one): the
        runner's just-in-time checkpoint when a node of the run is about to go."""
        self.requested = step

    def _not_written(self, step: int, suffix: str, error: Exception) -> str:
        kept = latest(self.folder)
        return (f"checkpoint step {step} not written to {self.folder}: {write_cause(error, self.folder)}; "
                f"{f'the last finished one, {kept.name}, is kept' if kept else 'no earlier checkpoint there'}")


def latest(folder: Path) -> Path | None:
    """The newest finished checkpoint in `folder` (a file being written is named .tmp_*), if any."""
    kept = sorted(Path(folder).glob("step_*"))
    return kept[-1] if kept else None


def write_cause(error: BaseException, folder: Path) -> str:
    """Why a write failed, in words: the OSError under the writer's own error when there is one
    (torch's zip writer reports a full disk as "unexpected pos 448 vs 342", with the OSError as its
    context), else the writer's first line; the space left on the file system when it is nearly full."""
    seen, found = error, None
    while seen is not None and found is None:
        found = seen if isinstance(seen, OSError) and seen.errno else None
        seen = seen.__cause__ or seen.__context__
    if found is not None:
        cause = os.strerror(found.errno)
    else:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0].rsplit("FAIL : ", 1)[-1][:300]
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return cause
    if found is not None and found.errno in (errno.ENOSPC, errno.EDQUOT) or free < 1 << 20:
        cause += f" ({free // 1024} KiB free on its file system)"
    return cause


def load_checked(backend, model: torch.nn.Module, path: Path) -> dict:
    """`backend.load_checkpoint(path)` for a resume, refused with one plain message (ConfigError)
    when the file cannot be continued from: truncated, another format, or another model's weights
    (the model's code changed since the run began). Checked whole before any weight is loaded, so
    a refusal never leaves a half-loaded model."""
    try:
        stored = backend.read_checkpoint(path)
        state = backend.load_checkpoint(path)
    except Exception as e:  # torch's zip reader, pickle, ORT's flatbuffers: each says it differently
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cause = cause.rsplit("FAIL : ", 1)[-1]  # ORT's errors begin with the C++ source location
        raise ConfigError(f"checkpoint {path}: not a readable backend={backend.name} checkpoint (truncated, "
                          f"or written by another backend): {cause[:300]}") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    differ = [f"{name} {tuple(v.shape)} (model: {expected[name]})" for name, v in stored.items()
              if name in expected and tuple(v.shape) != expected[name]]
    differ += [f"{name} (not in the model)" for name in stored if name not in expected]
    differ += [f"{name} (not in the checkpoint)" for name, _ in model.named_parameters() if name not in stored]
    if differ:
        raise ConfigError(f"checkpoint {path}: holds another model's weights ({'; '.join(differ[:3])}"
                          f"{'; ...' if len(differ) > 3 else ''}); resume with the model it was written by")
    return state


def progress(step: int, job) -> dict[str, int]:
    """Where the run stands after `step`, as ORT's TrainingRunner counts it: plain ints, which
    every checkpoint format holds (ORT's CheckpointState as properties)."""
    t = job.trainer
    micro_steps = step * t.gradient_accumulation_steps
    round_, index = job.data.epoch_of(micro_steps, t.batch_size, t.replicas)  # at any worker count
    return {
        "step": step,  # weight updates done (ORT: weight_update_step_count_)
        "micro_steps": micro_steps,  # forward/backward passes done (ORT: step_), also the data position
        "round": round_,  # passes over the training data (ORT: round_)
        "data_index": index,  # next batch within this pass (ORT: training_data_set_index_)
        "world_size": job.parallel.world_size,  # the workers that wrote it (an elastic run's changes)
    }


# ---- what a PyTorch checkpoint holds --------------------------------------------------------------
def save_torch(path: Path, step: int, model: torch.nn.Module, optimizer, scheduler, job, scaler=None) -> None:
    """Everything a resume needs (the list of ORT's TrainingRunner): the `progress` counts,
    weights, optimizer, schedule and loss-scaler state, and every RNG state."""
    # Through a Python file: a failed write then raises an OSError that says why (torch's own
    # writer would report only its position), found by write_cause.
    with open(path, "wb") as f:
        torch.save({
            **progress(step, job),
            "model": model.state_dict(),
            "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),  # or its state
            "scheduler": scheduler.state_dict() if scheduler else None,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "rng": rng_state(),
            **job.parallel.checkpoint_extra(),  # pipeline stages: each stage's RNG state
        }, f)


def rng_state() -> dict:
    """Every RNG state of the process (torch's, CUDA's, numpy's, Python's), as torch.save keeps it."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(rng: dict) -> None:
    """Put back what `rng_state` returned."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state((rng["numpy"][0], rng["numpy"][1].numpy().astype(np.uint32), *rng["numpy"][2:]))
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def load_torch(source: Path | bytes) -> dict:
    """A checkpoint written by `save_torch`, from a file or its bytes (weights only: no code runs
    on load)."""
    f = io.BytesIO(source) if isinstance(source, bytes) else source
    return torch.load(f, map_location="cpu", weights_only=True)


def restore_torch(state: dict, optimizer, scheduler, scaler=None, job=None) -> int:
    """Put optimizer, schedule, loss scaler and RNG back as they were; returns the step to go on
    from. With `job`, the learning rate is the config's (the stored one, unless a run that
    diverged goes on with a lower one: trainer.resume)."""
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if job is not None:
        if scheduler is not None:
            scheduler.base_lrs = [job.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"] = job.lr
            group["lr"] = job.lr * job.trainer.lr_factor(state["step"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return state["step"]


def torch_parameters(path: Path) -> dict[str, np.ndarray]:
    """The model parameters in a PyTorch checkpoint, by name."""
    return {k: v.numpy() for k, v in load_torch(path)["model"].items()}
