"""MapData (orchestrate/tasks/loader.py): a map-style torch Dataset served by position, read by
loader processes; and the shipped on-disk example, token shards (orchestrate/tasks/shards.py),
trained on every backend, resumed exactly, with the process's memory independent of the data's
size."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from orchestrate import app, schema
from orchestrate.job import Job
from orchestrate.tasks.data import TensorData
from orchestrate.tasks.loader import ItemError, MapData
from orchestrate.tasks.shards import ShardWindows, write_shards
from tests.conftest import BACKENDS, ROOT, client_for, metric_steps
from tests.helpers import exit_code

# ---- MapData on small in-memory Datasets -----------------------------------------------------------


class Pairs(Dataset):
    """n items (x, y): x a 4-vector holding the index, y the index mod 3; `slow_ms` per item.
    (Other keys, such as the synthetic data's left in a test's config, are taken and ignored.)"""

    def __init__(self, n: int = 100, slow_ms: float = 0.0, **kwargs):
        self.n, self.slow_ms = n, slow_ms

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000)
        return torch.full((4,), float(i)), i % 3


class Ragged(Pairs):
    def __getitem__(self, i):
        return torch.zeros(1 + i % 2), 0  # items 0 and 99 differ in length


class CountsTooMany(Pairs):
    def __len__(self):
        return self.n + 5

    def __getitem__(self, i):
        return np.ones(4, dtype=np.float32)[: 4 if i < self.n else 0], 0  # past n: empty windows


class NotPairs(Pairs):
    def __getitem__(self, i):
        return torch.zeros(4)


def taken(data, positions, batch_size=8, seed=0, rank=0, world_size=1) -> list[list[int]]:
    return [data.train_batch(p, batch_size, seed, rank, world_size)[0][:, 0].int().tolist() for p in positions]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_order_is_tensor_datas_whatever_the_loader(workers):
    """Global batch N holds the items TensorData's order gives, read in the loop or by 2 loader
    processes; a jump back (a resume, auto's next probe) reads the same batches again."""
    data = MapData(Pairs(), eval_fraction=0.2, num_workers=workers)
    x = torch.stack([Pairs()[i][0] for i in data.train_indices])
    reference = TensorData(x, torch.zeros(len(x)), x[:1], torch.zeros(1), "cross_entropy")
    expected = [reference.train_batch(p, 8, 0)[0][:, 0].int().tolist() for p in range(25)]  # 3 epochs of 10
    assert taken(data, range(25)) == expected
    assert taken(data, range(7, 12)) == expected[7:12]
    data.close()


def test_each_rank_takes_its_own_slice_of_the_global_batch():
    data = MapData(Pairs(), num_workers=0)
    ranks = [taken(data, range(4), batch_size=4, rank=r, world_size=2) for r in (0, 1)]
    whole = taken(data, range(4), batch_size=8)
    assert [a + b for a, b in zip(*ranks)] == whole


def test_the_eval_split_is_never_trained_on():
    data = MapData(Pairs(), eval_fraction=0.2, num_workers=0)
    held_out = sorted(int(x[0]) for batch, _ in data.eval_batches(7) for x in batch)
    assert len(held_out) == 20 and not set(held_out) & set(data.train_indices.tolist())


def test_a_slow_getitem_is_read_ahead_by_the_loader_processes():
    """20 ms an item, 8 items a batch: 160 ms a batch in the loop; 4 loader processes reading
    ahead serve each batch after the first in a fraction of that while the step computes."""
    data = MapData(Pairs(slow_ms=20), num_workers=4, prefetch_factor=2)
    data.train_batch(0, 8, 0)  # the loader starts (its processes' first batches)
    time.sleep(1.0)  # a step's compute: the loader fills its queue meanwhile
    began = time.perf_counter()
    for p in range(1, 5):
        data.train_batch(p, 8, 0)
    waited = (time.perf_counter() - began) / 4
    data.close()
    assert waited < 0.5 * 0.160, waited


@pytest.mark.parametrize("dataset,message", [
    (Ragged(), r"^data \(tests.tasks.test_loader.Ragged\): data: Ragged\[0\] and Ragged\[99\] do not stack into a "
               r"batch \(\[\(1,\), \(\)\] against \[\(2,\), \(\)\]"),
    (CountsTooMany(), r"CountsTooMany\[0\] and CountsTooMany\[104\] do not stack into a batch .*__len__ must count "
                      r"only whole items$"),
    (NotPairs(), r"NotPairs\[0\] is a Tensor, not an \(input, target\) pair$"),
])
def test_a_dataset_that_does_not_serve_what_it_promises_is_refused_naming_the_class_and_index(
        dataset, message, make_cfg):
    """`data._target_` at a Dataset of the user's own: wrapped in MapData, refused before any run."""
    with pytest.raises(schema.ConfigError, match=message):
        Job.prepare(make_cfg(f"data._target_={__name__}.{type(dataset).__name__}"))


class FailsAt(Pairs):
    """Item 57 is a file that cannot be read."""

    def __getitem__(self, i):
        if i == 57:
            raise OSError(f"[Errno 5] Input/output error: '/data/items/{i}.npy'\n(more lines of the error)")
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_item_that_fails_mid_run_is_named_with_its_class_index_and_error(workers, monkeypatch, tmp_path, capsys):
    """The run ends with one line naming the Dataset's class, the index and the original error,
    whether a loader process read the item or the run's own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "failing.yaml").write_text(
        f"_target_: orchestrate.tasks.loader.MapData\ndataset: {{_target_: {__name__}.FailsAt}}\nnum_workers: {workers}\n")
    assert exit_code(monkeypatch, "--config-dir", "conf", "data=failing", "model.in_features=4", "model.out_features=3",
                     "backend=torch", "trainer=quick", "hydra.run.dir=out") == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert re.match(r"error: ItemError: FailsAt\[57\]: OSError: \[Errno 5\] Input/output error: "
                    r"'/data/items/57\.npy'( \(.*test_loader\.py:\d+\))? at step \d+; ", line), line
    assert "the MLflow run" in line and "marked FAILED" in line, line


class BatchedPairs(Pairs):
    """Pairs with a batched read of its own (`__getitems__`), counted; a batch holding 57 fails."""

    def __init__(self, n: int = 100, **kwargs):
        super().__init__(n)
        self.batches = 0

    def __getitems__(self, indices):
        self.batches += 1
        if 57 in indices:
            raise OSError("[Errno 5] Input/output error: 'shard_3.bin'")
        return [self[i] for i in indices]


def test_a_datasets_own_batched_read_is_the_one_the_loader_uses():
    dataset = BatchedPairs()
    data = MapData(dataset, eval_fraction=0.2, num_workers=0)
    assert data.train_batch(0, 8, seed=0)[0].shape == (8, 4) and dataset.batches == 1
    with pytest.raises(ItemError, match=r"BatchedPairs\[.*\] \(read together\): OSError: \[Errno 5\]"):
        for position in range(20):  # an epoch of 80 items reaches the batch that holds 57
            data.train_batch(position, 8, seed=0)


class Float64Pairs(Pairs):
    def __getitem__(self, i):
        return np.full(4, float(i)), i % 3  # numpy's default: float64


def test_float64_inputs_to_a_float32_model_are_refused_saying_what_to_cast(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_code(monkeypatch, f"data._target_={__name__}.Float64Pairs", "model.in_features=4",
                     "model.out_features=3", "backend=torch", "trainer=quick") == 2
    err = capsys.readouterr().err
    assert "error: model (orchestrate.tasks.models.MLP) cannot run on data's sample batch of shape [2, 4] (float64): " \
           in err, err
    assert err.rstrip().endswith("the data's inputs are float64 and the model's parameters float32: cast the inputs "
                                 "to float32 in the data set (numpy: x.astype(np.float32); torch: x.to(torch.float32))"), err
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a folder


# ---- token shards on disk ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """4 MB of shards (2 million tokens) in 1 MB files."""
    folder = tmp_path_factory.mktemp("shards")
    write_shards(folder, 4, shard_megabytes=1)
    return folder


def shard_overrides(folder, *more: str) -> list[str]:
    return ["model=char_transformer", "data=token_shards", f"data.folder={folder}", "model.n_layer=1",
            "model.n_embd=64", "trainer.batch_size=16", "trainer.display_loss_steps=5", "optimizer.lr=0.003", *more]


def test_windows_are_read_from_the_files_and_never_cross_a_shard(shards):
    windows = ShardWindows(str(shards), block_size=64)
    tokens = np.fromfile(sorted(shards.glob("*.bin"))[1], dtype=np.uint16)
    per_shard = (len(tokens) - 1) // 64
    assert len(windows) == 4 * per_shard
    x, y = windows[per_shard + 3]  # shard 1's fourth window
    assert x.tolist() == tokens[192:256].tolist() and y.tolist() == tokens[193:257].tolist()


def test_missing_shards_are_refused_with_the_command_that_writes_them(make_cfg, tmp_path):
    with pytest.raises(schema.ConfigError, match=rf"data.folder={tmp_path}: no \*.bin token shards there; write "
                                                 rf"them with python -m orchestrate.tasks.shards {tmp_path}$"):
        Job.prepare(make_cfg(*shard_overrides(tmp_path)))


SINGLE = [b for b in BACKENDS if b not in ("runner", "auto")]


@pytest.mark.slow
def test_every_backend_trains_on_the_shards_from_the_same_batches(shards, make_cfg, tmp_path, request):
    """Every single-process backend and the runner's two workers: the loss goes down, and the
    same first losses as torch (the same windows in the same order, each rank its slice)."""
    losses = {}
    for backend in [*SINGLE, "runner"]:
        extra = ["backend.engine=torch", "trainer.num_workers=2", "trainer.batch_size=8"] if backend == "runner" else []
        if backend == "runner":
            request.getfixturevalue("ray_shared")
        cfg = make_cfg(*shard_overrides(shards, f"backend={backend}", "trainer.max_steps=30",
                                        "trainer.evaluation_period=30", *extra))
        result = app.train(cfg, tmp_path / backend)
        losses[backend] = [v for _, v in metric_steps(client_for(cfg.tracking.uri), result.run_id, "train/loss")]
        assert losses[backend][-1] < 0.8 * losses[backend][0], (backend, losses[backend])
    for backend, curve in losses.items():
        assert curve[0] == pytest.approx(losses["torch"][0], rel=1e-3), backend


def test_a_resumed_run_on_the_shards_reads_the_batches_it_would_have(shards, make_cfg, tmp_path, monkeypatch):
    """Interrupted in step 25 (after the checkpoint at 20), then trainer.resume=auto: the losses
    and weights of the run that never stopped, the loader started again at step 21's batch."""
    overrides = shard_overrides(shards, "backend=torch", "trainer.max_steps=40", "trainer.checkpoint_period=10",
                                "trainer.evaluation_period=0", "trainer.display_loss_steps=1")
    reference = app.train(make_cfg(*overrides), tmp_path / "reference")
    real = MapData.train_batch

    def interrupted(self, position, *args, **kwargs):
        if position == 24:
            raise KeyboardInterrupt
        return real(self, position, *args, **kwargs)

    monkeypatch.setattr(MapData, "train_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        app.train(make_cfg(*overrides, "tracking.experiment=resumed"), tmp_path / "first")
    monkeypatch.setattr(MapData, "train_batch", real)
    resumed = app.train(make_cfg(*overrides, "tracking.experiment=resumed", "trainer.resume=auto"), tmp_path / "second")
    client = client_for(make_cfg().tracking.uri)
    steps = metric_steps(client, resumed.run_id, "train/loss")
    assert [s for s, _ in steps] == list(range(1, 41))
    assert [v for _, v in steps] == pytest.approx([v for _, v in metric_steps(client, reference.run_id,
                                                                              "train/loss")], abs=1e-6)


PEAK = """
import resource, sys
from orchestrate.__main__ import main
main()
print(f"peak_rss_kb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
"""


@pytest.mark.slow
def test_the_process_memory_does_not_grow_with_the_shards(shards, tmp_path):
    """The same 60 steps and the same 256 evaluated windows over 4 MB and over 256 MB of shards
    (sampled across all of them): the training process's peak memory differs by far less than the
    data (the loader processes read windows from the files; nothing keeps the shards in the
    process). What does grow is the index of the windows: 2 M of them, 4 bytes each, twice (the
    training indices and an epoch's permutation), 16 MB; and the allocator's spread between
    identical runs of the large case was up to 65 MB. A process that kept the shards would be
    256 MB above."""
    large = tmp_path / "large"
    write_shards(large, 256, shard_megabytes=32)
    peaks = {}
    for name, folder in (("small", shards), ("large", large)):
        done = subprocess.run([sys.executable, "-c", PEAK, *shard_overrides(folder), "backend=torch",
                               "trainer.max_steps=60", "trainer.evaluation_period=0", "trainer.progress=false",
                               "data.eval_fraction=0.05", "data.max_eval_items=256",
                               f"tracking.uri=sqlite:///{tmp_path}/{name}.db", f"hydra.run.dir={tmp_path / name}"],
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[name] = int(done.stderr.rsplit("peak_rss_kb ", 1)[1].split()[0]) / 1024
    print(f"peak RSS of the training process, MB: {peaks}")
    assert peaks["large"] - peaks["small"] < 96, peaks  # MB, against 252 MB more data
