"""Any map-style `torch.utils.data.Dataset` as a data set every backend reads: what users bring
(images, token shards, rows of parquet files, often larger than memory), served with what
`orchestrate.tasks.data.DataSet` promises.

    data:
      _target_: orchestrate.tasks.loader.MapData
      dataset: {_target_: my_project.data.MyImages, root: /data/images}
      num_workers: null   # the loader's processes; null: the run's CPU budget (orchestrate.cpu)

(or `data._target_=my_project.data.MyImages` alone: `orchestrate.job.build_data` wraps a plain
Dataset in `MapData` with its defaults.)

- **The same batches everywhere.** Global batch number `position` is cut from a permutation of
  the training indices drawn from (seed, epoch), as `TensorData` does: every backend, and a run
  resumed at any step, reads the same items in the same order; rank r of N takes its slice.
- **Loaded ahead, in other processes.** A `torch.utils.data.DataLoader` reads the items with
  `num_workers` worker processes (None: as many as the run's CPU budget gives the loader, beside
  the training threads: orchestrate.cpu), `prefetch_factor` batches each ahead of the step, through a
  sampler that yields exactly the index lists of the positions asked for: a slow `__getitem__`
  (a file read, a decode) runs while the step computes. The loop asks for positions in order; a
  jump (a resume, `backend=auto`'s next probe) starts the loader again at the new position. On a
  GPU the PyTorch loops pin and copy each batch on a stream of their own (orchestrate.tasks.prefetch).
- **An eval split**: `eval_dataset` (a second Dataset), or a seeded `eval_fraction` of
  `dataset`'s indices, never trained on; at most `max_eval_items` of them (HF's
  `max_eval_samples`: on a corpus of gigabytes a fraction is hours of evaluation).
- **Refused up front** (before any run opens, one line naming the class and the index): items
  that are not (input, target) pairs of tensors or arrays, items that do not stack into a batch
  (the first against the last), and a `__len__` that counts items `__getitem__` does not serve.
- **An item that fails mid-run** (a file gone, a corrupt record) ends the run with one line that
  names the Dataset's class, the index and the original error (`ItemError`), whichever process
  read it.
"""

from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from orchestrate import cpu
from orchestrate.errors import first_line
from orchestrate.schema import AT_LEAST_0, AT_LEAST_1, FRACTION, SEED
from orchestrate.tasks import losses


class ItemError(Exception):
    """An item `__getitem__` could not serve: `Class[index]: OriginalError: its first line`. Raised
    in a loader process, torch raises it again here with the worker's traceback as its message
    ("Caught ItemError in DataLoader worker process N. Original Traceback ..."): the line is taken
    back from that traceback's last line, and the traceback kept as a note (for the run's log)."""

    def __init__(self, message: str):
        if message.startswith("Caught ") and "Original Traceback" in message:
            traceback = message
            message = message.rstrip().splitlines()[-1].partition(": ")[2]
            self.add_note(traceback)
        super().__init__(message)


class Items(Dataset):
    """The user's Dataset as the loader reads it: an item that raises is an ItemError naming the
    class and the index (a Subset's: the index in the Dataset it is cut from)."""

    def __init__(self, dataset: Dataset, name: str):
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            return self.dataset[index]
        except Exception as e:  # noqa: BLE001 - whatever __getitem__ raised is the reason
            shown = self.dataset.indices[index] if isinstance(self.dataset, torch.utils.data.Subset) else index
            raise ItemError(f"{self.name}[{shown}]: {first_line(e, typed=True)}") from e

    def __getitems__(self, indices: list[int]) -> list:
        """A batch, through the Dataset's own batched read where it has one (`__getitems__`, which
        torch's loader prefers to item by item); a batched read that fails names its items."""
        base, at = self.dataset, list(indices)
        if isinstance(base, torch.utils.data.Subset):
            base, at = base.dataset, [base.indices[i] for i in at]
        fetch = getattr(base, "__getitems__", None)
        if fetch is None:
            return [self[i] for i in indices]
        try:
            return fetch(at)
        except Exception as e:  # noqa: BLE001 - whatever __getitems__ raised is the reason
            shown = ", ".join(map(str, at[:8])) + (f", ... ({len(at)} items)" if len(at) > 8 else "")
            raise ItemError(f"{self.name}[{shown}] (read together): {first_line(e, typed=True)}") from e


class MapData:
    """A map-style Dataset of (input, target) items, served by position (see the module)."""

    def __init__(self, dataset: Dataset, eval_dataset: Dataset | None = None,
                 eval_fraction: Annotated[float, FRACTION] = 0.1, seed: Annotated[int, SEED] = 0,
                 num_workers: Annotated[int | None, AT_LEAST_0] = None, prefetch_factor: Annotated[int, AT_LEAST_1] = 4,
                 loss: str | None = None, max_eval_items: Annotated[int | None, AT_LEAST_1] = None):
        self.loss = loss or getattr(dataset, "loss", "cross_entropy")  # a Dataset may say its own
        losses.get(self.loss)  # a ValueError naming the allowed losses
        self.dataset, self.num_workers, self.prefetch_factor = dataset, num_workers, prefetch_factor
        # The loader's processes: num_workers, else the CPU budget's share of the cores found here
        # until a run sizes it for its own (Job.use_cores -> use_processes).
        self.processes = num_workers if num_workers is not None else \
            cpu.split(*cpu.cores(), reads_ahead=True).loader_processes
        self.name = type(dataset).__qualname__
        self._first = check_items(dataset)
        cap = max_eval_items or 2**62
        if eval_dataset is not None:
            check_items(eval_dataset)
            self.train_indices = positions(len(dataset))
            self.eval_set = eval_dataset if len(eval_dataset) <= cap else torch.utils.data.Subset(
                eval_dataset, np.sort(np.random.default_rng(seed).permutation(len(eval_dataset))[:cap]).tolist())
        else:
            # A seeded split of the indices: the same eval items in every run of this config.
            order = np.random.default_rng(seed).permutation(positions(len(dataset)))
            n_eval = max(1, int(len(dataset) * eval_fraction))
            if n_eval >= len(dataset):
                raise ValueError(f"data.eval_fraction={eval_fraction}: leaves no item of {self.name}'s "
                                 f"{len(dataset)} to train on")
            self.eval_set = torch.utils.data.Subset(dataset, np.sort(order[:min(n_eval, cap)]).tolist())
            self.train_indices = np.sort(order[n_eval:])  # the held-out items past the cap stay unused
        self._loader: Iterator | None = None
        self._next: tuple | None = None  # (position, batch_size, seed, rank, world_size) the loader serves next

    @property
    def num_train(self) -> int:
        return len(self.train_indices)

    def sample_input(self, batch_size: int = 2) -> torch.Tensor:
        """A small input batch, for exporting a model to ONNX: the first item, repeated."""
        x = torch.as_tensor(np.asarray(self._first[0]))
        return x.unsqueeze(0).expand(batch_size, *x.shape).contiguous()

    def epoch_of(self, position: int, batch_size: int, world_size: int = 1) -> tuple[int, int]:
        return Order(self.train_indices, self.name).epoch_of(position, batch_size, world_size)

    def train_batch(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        asked = (position, batch_size, seed, rank, world_size)
        if self._loader is None or self._next != asked:  # the first batch, or a jump: start reading at it
            self.close()
            self._loader = iter(self._make_loader(Positions(Order(self.train_indices, self.name), *asked)))
        x, y = next(self._loader)
        self._next = (position + 1, *asked[1:])
        return x, y

    def eval_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from self._make_loader(torch.utils.data.BatchSampler(range(len(self.eval_set)), batch_size, False),
                                     self.eval_set)

    def described(self, split: str) -> dict[str, str]:
        """What the split is, for the run's inputs in MLflow (orchestrate.tracking.datasets): the
        Dataset's class, its items, and what it says of its own source (`source`, if it has one)."""
        facts = {"class": f"{type(self.dataset).__module__}.{self.name}", "split": split,
                 "items": str(self.num_train if split == "train" else len(self.eval_set))}
        source = getattr(self.dataset, "source", None)
        if source is not None:
            facts["source"] = str(source)
        return facts

    def use_processes(self, count: int) -> None:
        """Read with `count` loader processes from the next batch on (a run's CPU budget)."""
        if count != self.processes:
            self.close()
            self.processes = count

    def close(self) -> None:
        """Stop the loader's worker processes (a run's end; the next run starts them again): the
        loader's iterator, the one reference to it dropped, shuts its workers down as it goes."""
        self._loader, self._next = None, None

    def _make_loader(self, batches: Sampler, dataset: Dataset | None = None) -> DataLoader:
        workers = self.processes
        return DataLoader(Items(dataset if dataset is not None else self.dataset, self.name), batch_sampler=batches,
                          num_workers=workers, prefetch_factor=self.prefetch_factor if workers else None,
                          collate_fn=pair, persistent_workers=False)

    def __getstate__(self) -> dict:  # a running loader stays in its process (Ray ships data sets by value)
        state = dict(self.__dict__)
        state["_loader"], state["_next"] = None, None
        return state


class Order:
    """Which training items make up each global batch: TensorData's order over `train_indices`
    (a permutation per epoch, seeded by (seed, epoch); rank r of N takes the r-th slice)."""

    def __init__(self, train_indices: np.ndarray, name: str):
        self.train_indices, self.name = train_indices, name
        self._epoch, self._perm = None, None

    def epoch_of(self, position: int, batch_size: int, world_size: int = 1) -> tuple[int, int]:
        """(epoch, batch index within it) of global batch `position`, as checkpoints store it."""
        per_epoch = len(self.train_indices) // (batch_size * world_size)
        if per_epoch == 0:
            raise ValueError(f"trainer.batch_size={batch_size} x {world_size} worker(s) is larger than the "
                             f"training set ({len(self.train_indices)} items of {self.name})")
        return divmod(position, per_epoch)

    def indices(self, position: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """The dataset indices of rank `rank`'s share of global batch `position`."""
        epoch, index = self.epoch_of(position, batch_size, world_size)
        if epoch != self._epoch:
            rng = np.random.default_rng([seed, epoch])
            self._perm, self._epoch = rng.permutation(positions(len(self.train_indices))), epoch
        start = index * batch_size * world_size + rank * batch_size
        return self.train_indices[self._perm[start:start + batch_size]].tolist()


class Positions(Sampler):
    """The index lists of global batches `position`, `position + 1`, ... (one rank's share each),
    for the loader, which reads them ahead of the loop."""

    def __init__(self, order: Order, position: int, batch_size: int, seed: int, rank: int, world_size: int):
        self.order, self.start, self.args = order, position, (batch_size, seed, rank, world_size)

    def __iter__(self) -> Iterator[list[int]]:
        position = self.start
        while True:
            yield self.order.indices(position, *self.args)
            position += 1

    def __len__(self) -> int:  # endless: the loop decides when to stop
        return 2**62


def positions(n: int) -> np.ndarray:
    """0 .. n - 1 in 4 bytes each where they fit (a corpus's index is its one per-item cost in this
    process: 2 M windows, 8 MB). Shuffled, it is the same permutation `permutation(n)` draws."""
    return np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)


def pair(items: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of (input, target) items as two tensors (numpy arrays become tensors)."""
    x, y = default_collate([(np.asarray(i[0]) if isinstance(i[0], np.ndarray) else i[0],
                             np.asarray(i[1]) if isinstance(i[1], np.ndarray) else i[1]) for i in items])
    return torch.as_tensor(x), torch.as_tensor(y)


def check_items(dataset: Dataset) -> tuple:
    """The first item, once the Dataset is seen to serve what it promises: a length, (input,
    target) pairs at its first and last index, which stack into one batch. A ValueError names the
    class and the index otherwise (a `__len__` that counts past the data fails at the last index)."""
    name = type(dataset).__qualname__
    try:
        n = len(dataset)
    except TypeError:
        raise ValueError(f"data: {name} has no __len__: a map-style torch.utils.data.Dataset is needed "
                         "(an IterableDataset cannot be served by position)") from None
    if n == 0:
        raise ValueError(f"data: {name} has no items (__len__ is 0)")
    items = {}
    for index in sorted({0, n - 1}):
        try:
            item = dataset[index]
        except Exception as e:  # noqa: BLE001 - whatever __getitem__ raised is the reason
            raise ValueError(f"data: {name}[{index}] failed ({type(e).__name__}: {e}) although __len__ is {n}: "
                             f"__len__ must count only the items __getitem__ serves") from None
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"data: {name}[{index}] is a {type(item).__name__}, not an (input, target) pair")
        items[index] = item
    try:
        pair(list(items.values()))
    except Exception as e:  # noqa: BLE001 - default_collate's reason: shapes or types differ
        shapes = {i: [tuple(np.shape(part)) for part in item] for i, item in items.items()}
        raise ValueError(f"data: {name}[0] and {name}[{n - 1}] do not stack into a batch ({shapes[0]} against "
                         f"{shapes[n - 1]}: {str(e).splitlines()[0]}); every item must have the same shapes, "
                         f"and __len__ must count only whole items") from None
    return items[0]


def is_map_dataset(obj: Any) -> bool:
    """A Dataset to wrap in MapData: indexable with a length, and not already a DataSet."""
    return not hasattr(obj, "train_batch") and hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

