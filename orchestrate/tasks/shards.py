"""Token shards on disk: the shipped example of a data set read from files, as large as the disk.

A folder of `*.bin` files, each a flat array of uint16 token ids (nanoGPT's `train.bin` layout);
an item is a window of `block_size` tokens and its target the same window shifted by one. Items
are read from the files when asked for (`os.pread` through `numpy.fromfile`: only the window is
copied into the process, nothing is mapped or cached in it), by the loader's worker processes
(orchestrate.tasks.loader), so the process's memory does not grow with the data.

Write shards of the Python standard library's own source, as characters (`data.encode`: the 96
symbols `data=python_source` uses, so `model=char_transformer` pairs with both):

    python -m orchestrate.tasks.shards shards --megabytes 64
    python -m orchestrate model=char_transformer data=token_shards data.folder=shards
"""

import argparse
import bisect
import os
import sysconfig
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from torch.utils.data import Dataset

from orchestrate.schema import AT_LEAST_0, AT_LEAST_1, FRACTION, SEED
from orchestrate.tasks.data import PRINTABLE, encode
from orchestrate.tasks.loader import MapData

TOKEN = np.dtype(np.uint16)  # token ids below 65,536, two bytes each


class ShardWindows(Dataset):
    """Every whole window of `block_size` + 1 tokens in the folder's shards, as (x, y) int64 tensors."""

    loss = "cross_entropy"

    def __init__(self, folder: str, block_size: int):
        self.files = sorted(Path(folder).glob("*.bin"))
        if not self.files:
            raise ValueError(f"data.folder={folder}: no *.bin token shards there; write them with "
                             f"python -m orchestrate.tasks.shards {folder}")
        self.block_size = block_size
        # Windows do not cross a shard's end: shard i holds (tokens - 1) // block_size of them.
        counts = [(path.stat().st_size // TOKEN.itemsize - 1) // block_size for path in self.files]
        self.starts = np.cumsum([0, *counts]).tolist()  # the first window of each shard

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def source(self) -> str:
        """The shards, as the run's inputs in MLflow name them: the folder, each file's size."""
        return f"{self.files[0].parent}: " + ", ".join(f"{p.name} ({p.stat().st_size:,} bytes)" for p in self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        shard = bisect.bisect_right(self.starts, index) - 1
        offset = (index - self.starts[shard]) * self.block_size * TOKEN.itemsize
        tokens = np.fromfile(self.files[shard], dtype=TOKEN, count=self.block_size + 1, offset=offset)
        tokens = torch.from_numpy(tokens.astype(np.int64))
        return tokens[:-1], tokens[1:]


class TokenShards(MapData):
    """The shards in `folder` served to every backend (MapData): windows of `block_size` tokens,
    a seeded `eval_fraction` of them held out (evaluated on at most `max_eval_items`), read by
    `num_workers` loader processes (None: the run's CPU budget's, orchestrate.cpu)."""

    def __init__(self, folder: str, block_size: Annotated[int, AT_LEAST_1] = 64,
                 vocab_size: Annotated[int, AT_LEAST_1] = len(PRINTABLE),
                 eval_fraction: Annotated[float, FRACTION] = 0.01, seed: Annotated[int, SEED] = 0,
                 num_workers: Annotated[int | None, AT_LEAST_0] = None, prefetch_factor: Annotated[int, AT_LEAST_1] = 4,
                 max_eval_items: Annotated[int | None, AT_LEAST_1] = 4096):
        self.vocab_size = vocab_size  # the model's (model.vocab_size: ${data.vocab_size})
        super().__init__(ShardWindows(folder, block_size), eval_fraction=eval_fraction, seed=seed,
                         num_workers=num_workers, prefetch_factor=prefetch_factor, max_eval_items=max_eval_items)
        largest = int(self._first[0].max())
        if largest >= vocab_size:  # the first window's tokens, read by the check: the rest are not read here
            raise ValueError(f"data.vocab_size={vocab_size}: the shards hold token {largest}")


def write_shards(folder: Path, megabytes: float, shard_megabytes: float = 16.0) -> list[Path]:
    """Shards of the standard library's .py files as character tokens (`encode`), in a fixed file
    order, repeated until `megabytes` of tokens are written; `shard_megabytes` each."""
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    total, per_shard = int(megabytes * 2**20) // TOKEN.itemsize, int(shard_megabytes * 2**20) // TOKEN.itemsize
    written, buffer, shards = 0, [], []
    while written < total:
        for path in sources:
            text = path.read_text(encoding="utf-8", errors="replace")
            buffer.append(encode(text).numpy().astype(TOKEN))
            if sum(len(b) for b in buffer) >= per_shard or written + sum(len(b) for b in buffer) >= total:
                tokens = np.concatenate(buffer)[:min(per_shard, total - written)]
                buffer = []
                shards.append(folder / f"shard_{len(shards):05d}.bin")
                tokens.tofile(shards[-1])
                written += len(tokens)
                if written >= total:
                    break
    return shards


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write token shards of the Python standard library's source.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--megabytes", type=float, default=64.0, help="in all (default 64)")
    parser.add_argument("--shard-megabytes", type=float, default=16.0, help="per shard (default 16)")
    args = parser.parse_args(argv)
    shards = write_shards(args.folder, args.megabytes, args.shard_megabytes)
    size = sum(path.stat().st_size for path in shards)
    print(f"{len(shards)} shard(s), {size / 2**20:.1f} MB, {size // TOKEN.itemsize:,} tokens in {args.folder}"
          f"{os.sep}")


if __name__ == "__main__":
    main()
