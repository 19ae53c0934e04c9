"""Test helpers: models and data that fail or kill their process on purpose, a model with dropout
(importable as `tests.helpers` by Ray workers when PYTHONPATH holds the repository), backends that
are slow or wrong on purpose (backend=auto must not choose them), and a real multi-node Ray cluster
on 127.0.0.1."""

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from orchestrate.backends.torch import TorchBackend
from orchestrate.cluster.ports import free_port  # noqa: F401 - the tests take it from here
from orchestrate.tasks.data import Digits, Synthetic
from orchestrate.tasks.models import MLP


class FailingMLP(MLP):
    """An MLP whose forward raises at call `fail_at_call`, but only while `marker` exists
    (so the same command fails once, then succeeds after the marker is removed)."""

    def __init__(self, in_features: int, out_features: int, hidden=(32,), fail_at_call: int = 10**9,
                 marker: str = ""):
        super().__init__(in_features, out_features, hidden)
        self.fail_at_call, self.marker, self.calls = fail_at_call, marker, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.fail_at_call and (not self.marker or Path(self.marker).exists()):
            raise RuntimeError(f"deliberate failure at call {self.calls}")
        return super().forward(x)


class CountingMLP(MLP):
    """An MLP that appends a line to `count_file` each time it is built."""

    def __init__(self, in_features: int, out_features: int, hidden=(32,), count_file: str = ""):
        super().__init__(in_features, out_features, hidden)
        with open(count_file, "a") as f:
            f.write("built\n")


class FftMLP(MLP):
    """An MLP over the features' Fourier transform: torch runs it, ONNX has no operator for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.fft.fft(x).real)


class FailingInitMLP(MLP):
    """An MLP whose constructor raises: a bug in a user's model code."""

    def __init__(self, in_features: int, out_features: int, hidden=(32,)):
        raise RuntimeError("deliberate failure in the model's constructor")


class FailingData(Synthetic):
    """A data set whose constructor raises: a bug in a user's data code."""

    def __init__(self, **kwargs):
        raise RuntimeError("deliberate failure in the data set's constructor")


class KillingData(Synthetic):
    """The synthetic data set, which kills its own process with SIGKILL when rank `rank` asks for
    global batch `kill_at` (0-based: step kill_at + 1 without accumulation), once (the marker
    file is removed first, and the pid written to `<marker>.killed`). Batches are served in
    Python by every backend, so this also kills an on-device run, whose model runs inside ORT.
    Every batch it serves on that rank is appended to `<marker>.served` (`served_twice`)."""

    def __init__(self, kill_at: int = 10**9, rank: int = 0, marker: str = "", **kwargs):
        super().__init__(**kwargs)
        self.kill_at, self.rank, self.marker = kill_at, rank, marker

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if rank == self.rank and self.marker:
            if position == self.kill_at and Path(self.marker).exists():
                Path(self.marker).unlink()
                Path(f"{self.marker}.killed").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            with open(f"{self.marker}.served", "a") as f:
                f.write(f"{position}\n")
        return super().train_batch(position, batch_size, seed, rank, world_size)


class SlowData(Synthetic):
    """The synthetic data set, `delay_ms` slower for every training batch: a run that is still
    training a known time after it started, however fast the machine is."""

    def __init__(self, delay_ms: float = 100.0, **kwargs):
        super().__init__(**kwargs)
        self.delay_ms = delay_ms

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        time.sleep(self.delay_ms / 1000)
        return super().train_batch(position, batch_size, seed, rank, world_size)


def served_twice(marker: Path, readers: int = 1) -> list[int]:
    """The batches KillingData served twice: those between the checkpoint a killed run went on
    from and the kill (a run that started over would serve every earlier one twice too). Batch 0
    is left out: building a job also reads it, to check the data against the model. `readers`:
    the ranks that read each batch (pipeline stages: every stage of a replica)."""
    served = [int(p) for p in Path(f"{marker}.served").read_text().split()]
    return sorted({p for p in served if p and served.count(p) == 2 * readers})


class DropoutMLP(MLP):
    """An MLP with dropout before its last layer: every training step draws random masks, so a
    resumed run repeats one that never stopped only if the random stream is resumed too."""

    def __init__(self, in_features: int, out_features: int, hidden=(32,), p: float = 0.2):
        super().__init__(in_features, out_features, hidden)
        self.net.insert(len(self.net) - 1, torch.nn.Dropout(p))


class NanFrom(Synthetic):
    """The synthetic task whose training batches from global position `start` on are nan (on the
    runner: rank 0's share only, the other ranks' stay finite), so a run diverges at step
    `start` + 1 on every backend, whatever its optimizer."""

    def __init__(self, start: int, **kwargs):
        super().__init__(**kwargs)
        self.start = start

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        x, y = super().train_batch(position, batch_size, seed, rank, world_size)
        if position >= self.start and rank == 0:
            x = torch.full_like(x, float("nan"))
        return x, y


# ---- a real multi-node Ray cluster on this machine ---------------------------------------------
# `ray start` swaps 127.0.0.1 for the machine's network address, and refuses to add a node when
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (the setting that keeps a head on loopback). The extra
# nodes are therefore started through Ray's own CLI with that one swap turned off.
RAY_CLI_ON_LOOPBACK = (
    "import sys; from ray._private import services; services.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv = ['ray', *sys.argv[1:]]; main()"
)


def alive_nodes(address: str, env: dict) -> list[str]:
    """Node ids of the cluster's live nodes, asked through Ray's public API in a fresh process."""
    code = (f"import json, ray; ray.init(address={address!r}, configure_logging=False); "
            "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else []


@contextlib.contextmanager
def loopback_cluster(nodes: int = 2, cpus_per_node: int = 1, dashboard_port: int | None = None,
                     env: dict | None = None):
    """A head and `nodes - 1` more nodes, each its own `ray start --block` process, all bound to
    127.0.0.1 and guarded by a fresh auth token; with `dashboard_port`, the head's dashboard (and
    job submission) there. `env`: the environment the nodes start in (their jobs' `python`).
    Yields (address, env for clients)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM a node otherwise waits up to 30 s for the
    # detached actor Ray Train leaves behind.
    env = {**(env or os.environ), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    # Its own temp folder (short: Ray's socket paths are length-limited), so that the address file
    # `ray start` leaves behind does not lead a later plain `ray.init()` to this cluster.
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    common = ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus_per_node}", "--num-gpus=0",
              f"--temp-dir={temp_dir}"]
    ray_cli = [sys.executable, "-c", RAY_CLI_ON_LOOPBACK]
    # Job submission goes through the head's dashboard agent: on a free port, not Ray's fixed 52365,
    # which another Ray on this machine may hold (the head's job API then has no agent to use).
    dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
                  f"--dashboard-agent-listen-port={free_port()}"]
                 if dashboard_port else ["--include-dashboard=false"])
    procs = [subprocess.Popen([*ray_cli, "start", "--head", f"--port={port}", *dashboard, *common],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        node_env = {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not alive_nodes(address, env):
            time.sleep(1)
        for _ in range(nodes - 1):
            procs.append(subprocess.Popen([*ray_cli, "start", f"--address={address}", *common], env=node_env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        while time.monotonic() < deadline and len(alive_nodes(address, env)) < nodes:
            time.sleep(1)
        yield address, env
    finally:
        for proc in reversed(procs):  # `ray start --block` stops its node's processes on SIGTERM
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


class CumulativeMLP(MLP):
    """An MLP whose last layer reads the running sum of the hidden features (torch.cumsum, the
    ONNX op CumSum), for which ORT 1.19 has no gradient builder."""

    def __init__(self, in_features: int, out_features: int, hidden=(32,)):
        super().__init__(in_features, out_features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[-1](torch.cumsum(self.net[:-1](x), dim=-1))


class NeedsAMissingPackage(TorchBackend):
    """The torch backend behind an extra this environment lacks: what an ORT backend is where ORT
    is not installed (orchestrate.extras), on every stack."""

    from orchestrate.extras import Extra

    extra = Extra("absent", "the package absent_pkg", "absent_pkg_for_orchestrate_tests")
    del Extra


def fit_untracked(overrides: list[str], out_dir: Path):
    """Build the job `overrides` compose and run its backend's loop alone, without an MLflow run
    (one costs seconds of its own), connected as `app.train` connects it (the runner: a Ray
    instance, shut down when it started one); the process settings the loop changes are put back. Returns
    the Job: `job.meter.final` holds the final metrics, `job.out_dir / "model.onnx"` the export."""
    from orchestrate import process
    from orchestrate.config import load_config
    from orchestrate.job import Job

    job = Job.prepare(load_config(overrides), out_dir)
    with process.kept(), job.backend.connect(job):  # the runner's Ray, started and shut down here
        job.backend.fit(job)
    return job


# ---- backends backend=auto must not choose (each gets a conf/backend file in the test's own folder) ---
@dataclass
class SlowTorchBackend(TorchBackend):
    """The PyTorch loop, `delay_ms` slower every step: the same losses as torch, lower samples/s."""

    delay_ms: float = 5.0

    def seed_step(self, step: int, job) -> None:
        time.sleep(self.delay_ms / 1000)


@dataclass
class OffTorchBackend(TorchBackend):
    """The PyTorch loop on the model's logits with `shift` added to the first class's: it trains,
    but another model than torch's (its losses disagree)."""

    shift: float = 3.0

    def wrap(self, model: torch.nn.Module, job) -> torch.nn.Module:
        return Shifted(model, self.shift)


class Shifted(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, shift: float):
        super().__init__()
        self.model, self.shift = model, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return torch.cat([logits[..., :1] + self.shift, logits[..., 1:]], dim=-1)


class DtypeMLP(MLP):
    """The MLP, noting the dtype of its first layer's output and the TF32 flag on each training
    forward (the test reads them back: what autocast and trainer.tf32 did inside the loop)."""

    seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():  # a training step (not the check, an evaluation, the export)
            DtypeMLP.seen.append((self.net[0](x).dtype, torch.backends.cuda.matmul.allow_tf32))
        return super().forward(x)


def exit_code(monkeypatch, *argv: str) -> int:
    """`python -m orchestrate ARGV` run in this process: its exit code (what it printed is the
    test's capsys)."""
    import pytest

    from orchestrate.__main__ import main
    from tests.conftest import here

    monkeypatch.setattr(sys, "argv", ["orchestrate", *here(argv)])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code


def refused_in_one_line(monkeypatch, capsys, folder: Path, *argv: str) -> str:
    """`python -m orchestrate ARGV` run in this process from `folder` as bad input is refused: exit
    2, one line on stderr (returned), nothing written to `folder`."""
    monkeypatch.chdir(folder)
    assert exit_code(monkeypatch, *argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert list(folder.iterdir()) == []
    return err


def command_exit(main, argv: list[str]) -> int:
    """A command's `main(argv)` (orchestrate.commands) as `orchestrate` runs it: its exit code,
    returned, or raised by the boundary."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@functools.cache
def prints_no_cuda_notice() -> bool:
    """Whether torch prints "No CUDA runtime is found" on this machine when ORT imports torch's C++
    extension helpers (a CUDA toolkit and no GPU): only then is there a line to find in a log."""
    done = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], capture_output=True, text=True,
                          timeout=300)
    return "No CUDA runtime is found" in done.stdout + done.stderr


class NanColumnDigits(Digits):
    """The digits with one input column of nan, as a user's data set with a missing feature."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.x_train[:, 3] = float("nan")
        self._x = self.x_train.numpy()


class LongerThanItsArrays(Synthetic):
    """A TensorData subclass whose num_train says more samples than its arrays hold."""

    @property
    def num_train(self) -> int:
        return len(self.x_train) + 2021


class TiedEncoderLM(torch.nn.Module):
    """A character LM as a user writes one: torch's own nn.TransformerEncoder with a causal mask
    sliced to the sequence length, input and output embeddings tied (CharTransformer's
    arguments). torch, compile and ORT's on-device API train it; ORT's symbolic shape inference,
    which ORTModule runs on its export, fails on it (a Reshape, ORT 1.19.2)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 32):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab_size, n_embd)
        self.pos = torch.nn.Parameter(torch.zeros(block_size, n_embd))
        layer = torch.nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = torch.nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(block_size), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        return self.head(self.encoder(x, mask=self.mask[:t, :t], is_causal=True))
