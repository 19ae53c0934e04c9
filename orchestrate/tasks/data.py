"""Data sets shipped with orchestrate: in-memory tensors, drawn in the same order by every backend.

A data set is any object that has what `DataSet` names (the loops call nothing else). Subclass
`TensorData` (or write your own class) and point `data._target_` at it.
"""

import importlib.util
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Protocol

import numpy as np
import torch

from orchestrate.schema import AT_LEAST_1, FRACTION, SEED
from orchestrate.tasks import losses


class DataSet(Protocol):
    """What every backend's loop reads from `data`. A data set is read-only once built (batches
    are served by position): one built data set serves every run of a process that asks for the
    same config (orchestrate.job.build_data: a sweep's trials on one Ray worker)."""

    loss: str  # a name in orchestrate.tasks.losses.LOSSES: how the model's output is scored

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0,
                    world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s share (batch_size samples) of global batch number `position` (0-based)
        of the order `seed` gives: the same batches on every backend and after a resume."""

    def epoch_of(self, position: int, batch_size: int, world_size: int = 1) -> tuple[int, int]:
        """(epoch, batch index within it) of global batch `position`, stored in checkpoints;
        a ValueError when a global batch is larger than the training set."""

    def eval_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The whole eval split, in batches of at most `batch_size`."""

    def sample_input(self, batch_size: int = 2) -> torch.Tensor:
        """A small input batch, for exporting the model to ONNX."""


class TensorData:
    """Train and eval tensors plus the loss that fits their targets.

    Batches come from a fresh permutation of the training set each epoch (seeded by `seed` and
    the epoch), so batch number `position` is the same on every backend and after a resume.
    With `world_size > 1` each rank takes its own disjoint slice of every global batch.
    """

    def __init__(self, x_train, y_train, x_eval, y_eval, loss: str):
        losses.get(loss)  # a ValueError naming the allowed losses
        self.x_train, self.y_train, self.x_eval, self.y_eval = x_train, y_train, x_eval, y_eval
        self.loss = loss
        # Batches are cut with numpy (a few microseconds) and handed out as zero-copy torch
        # tensors: torch's own indexing cost ~60 us a batch, a tenth of a small model's step.
        self._x, self._y = x_train.numpy(), y_train.numpy()
        self._perm_epoch, self._perm = None, None

    @property
    def num_train(self) -> int:
        return len(self.x_train)

    def sample_input(self, batch_size: int = 2) -> torch.Tensor:
        """A small input batch, for exporting a model to ONNX."""
        return self.x_train[:batch_size]

    def epoch_of(self, position: int, batch_size: int, world_size: int = 1) -> tuple[int, int]:
        """(epoch, batch index within it) of global batch number `position`: ORT's round_ and
        training_data_set_index_, stored in checkpoints."""
        per_epoch = self.num_train // (batch_size * world_size)
        if per_epoch == 0:
            raise ValueError(
                f"trainer.batch_size={batch_size} x {world_size} worker(s) is larger than the "
                f"training set ({self.num_train} samples)"
            )
        return divmod(position, per_epoch)

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        global_batch = batch_size * world_size
        epoch, index = self.epoch_of(position, batch_size, world_size)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_train), epoch
        start = index * global_batch + rank * batch_size
        idx = self._perm[start : start + batch_size]
        return torch.from_numpy(self._x[idx]), torch.from_numpy(self._y[idx])

    def eval_batches(self, batch_size: int):
        for start in range(0, len(self.x_eval), batch_size):
            yield self.x_eval[start : start + batch_size], self.y_eval[start : start + batch_size]


def _split(x, y, eval_fraction: float, seed: int):
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_eval = max(1, int(len(x) * eval_fraction))
    return x[perm[n_eval:]], y[perm[n_eval:]], x[perm[:n_eval]], y[perm[:n_eval]]


class Digits(TensorData):
    """scikit-learn's bundled handwritten digits: 8x8 images flattened to 64 features, 10 classes."""

    def __init__(self, num_features: int = 64, num_classes: int = 10, eval_fraction: Annotated[float, FRACTION] = 0.2,
                 seed: Annotated[int, SEED] = 0, loss: str = "cross_entropy"):
        if (num_features, num_classes) != (64, 10):
            raise ValueError("data.num_features and data.num_classes are fixed for digits: 64 and 10")
        # The file scikit-learn's load_digits reads (pixels 0-16, then the label), read without
        # importing sklearn.datasets: that import alone took 2.6 s, a run's whole start-up budget.
        sklearn = importlib.util.find_spec("sklearn")
        if sklearn is None or not sklearn.submodule_search_locations:
            raise ValueError("data=digits reads scikit-learn's bundled digits: pip install scikit-learn")
        table = np.loadtxt(Path(sklearn.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz",
                           delimiter=",")
        x = torch.tensor(table[:, :-1] / 16.0, dtype=torch.float32)
        y = torch.tensor(table[:, -1], dtype=torch.int64)
        super().__init__(*_split(x, y, eval_fraction, seed), loss=loss)


class Synthetic(TensorData):
    """Inputs from a standard normal, targets from a fixed random teacher network.

    `target`: `classes` (argmax of the teacher, for cross_entropy), `regression` (the teacher's
    outputs, for mse or l1) or `multilabel` (teacher outputs > 0, for bce_with_logits).
    """

    def __init__(self, num_samples: Annotated[int, AT_LEAST_1] = 2048, num_features: Annotated[int, AT_LEAST_1] = 16,
                 num_classes: Annotated[int, AT_LEAST_1] = 4, target: str = "classes",
                 eval_fraction: Annotated[float, FRACTION] = 0.25, seed: Annotated[int, SEED] = 0,
                 loss: str = "cross_entropy"):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(num_samples, num_features, generator=g)
        w1 = torch.randn(num_features, 32, generator=g) / num_features**0.5
        w2 = torch.randn(32, num_classes, generator=g) / 32**0.5
        out = torch.tanh(x @ w1) @ w2
        targets = {
            "classes": lambda: out.argmax(dim=1),
            "regression": lambda: out,
            "multilabel": lambda: (out > 0).float(),
        }
        if target not in targets:
            raise ValueError(f"data.target={target!r} is not one of {', '.join(targets)}")
        super().__init__(*_split(x, targets[target](), eval_fraction, seed), loss=loss)


PRINTABLE = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 symbols


def read_stdlib(files: list[str]) -> list[str]:
    """The text of each of `files`, paths inside the Python standard library's folder (which
    every Python installation carries)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    missing = [f for f in files if not (stdlib / f).is_file()]
    if missing:
        raise FileNotFoundError(f"data.files: {', '.join(missing)} not found in {stdlib}")
    return [(stdlib / f).read_text(encoding="utf-8", errors="replace") for f in files]


def encode(text: str, vocab_size: int = len(PRINTABLE)) -> torch.Tensor:
    """Character ids (int64) in PRINTABLE: a non-ASCII character becomes "?", a control character
    other than newline (tab, carriage return) a space. `vocab_size` is `data.vocab_size`, checked."""
    if vocab_size != len(PRINTABLE):
        raise ValueError(f"data.vocab_size is fixed at {len(PRINTABLE)} (printable ASCII and newline)")
    lookup = np.full(128, PRINTABLE.index(" "), dtype=np.int64)
    for i, ch in enumerate(PRINTABLE):
        lookup[ord(ch)] = i
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return torch.from_numpy(lookup[np.minimum(codes, 127)])


class PythonSource(TensorData):
    """Character-level language modelling on the Python standard library's own source files.
    Each sample is `block_size` characters (`encode`); its target is the same window shifted by one."""

    def __init__(self, files: list[str] = ("functools.py", "argparse.py", "inspect.py"),
                 block_size: Annotated[int, AT_LEAST_1] = 64, vocab_size: Annotated[int, AT_LEAST_1] = 96,
                 max_chars: Annotated[int, AT_LEAST_1] = 300_000, eval_fraction: Annotated[float, FRACTION] = 0.1,
                 loss: str = "cross_entropy"):
        text = "".join(read_stdlib(files))[:max_chars]
        ids = encode(text, vocab_size)
        n = (len(ids) - 1) // block_size
        x = ids[: n * block_size].view(n, block_size)
        y = ids[1 : n * block_size + 1].view(n, block_size)
        n_eval = max(1, int(n * eval_fraction))
        # Eval is the tail of the text, not random windows: no overlap with training windows.
        super().__init__(x[:-n_eval], y[:-n_eval], x[-n_eval:], y[-n_eval:], loss=loss)
        self.text_chars = len(text)


class PythonFiles(TensorData):
    """Sequence classification: which of `files` (Python standard library sources) a window of
    `block_size` characters (`encode`) was cut from; the label is the file's place in `files`.
    Every file gives the same number of windows (the shortest file's, at most `max_chars` of each
    file), so the classes are balanced and chance is 1 / num_classes. Windows do not overlap; a
    seeded random `eval_fraction` of them is the eval split."""

    def __init__(self, files: list[str] = ("argparse.py", "pydoc_data/topics.py", "encodings/cp437.py",
                                           "html/entities.py"),
                 num_classes: Annotated[int, AT_LEAST_1] = 4, block_size: Annotated[int, AT_LEAST_1] = 64,
                 vocab_size: Annotated[int, AT_LEAST_1] = 96, max_chars: Annotated[int, AT_LEAST_1] = 60_000,
                 eval_fraction: Annotated[float, FRACTION] = 0.2, seed: Annotated[int, SEED] = 0,
                 loss: str = "cross_entropy"):
        if num_classes != len(files):
            raise ValueError(f"data.num_classes={num_classes} must be the number of data.files ({len(files)})")
        ids = [encode(text[:max_chars], vocab_size) for text in read_stdlib(files)]
        n = min(len(i) for i in ids) // block_size  # windows per file
        x = torch.cat([i[: n * block_size].view(n, block_size) for i in ids])
        y = torch.arange(len(files)).repeat_interleave(n)
        super().__init__(*_split(x, y, eval_fraction, seed), loss=loss)


def decode(ids) -> str:
    return "".join(PRINTABLE[int(i)] for i in ids)
