"""Data read from disk as users write it: scikit-learn's 1,797 handwritten digits as PNG files,
each decoded with PIL in a map-style Dataset's `__getitem__`, served by orchestrate's loader
(`MapData`: the loader's processes decode the next batches while the step computes). The
benchmarks' `--data disk` (benchmarks/backends.py) trains on it; `write` makes the files.

    python benchmarks/png_digits.py /tmp/png_digits      # write the files
    cd benchmarks && python -m orchestrate model=cnn data=digits data._target_=png_digits.PngDigits \\
        +data.root=/tmp/png_digits
"""

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from orchestrate.tasks.data import Digits
from orchestrate.tasks.loader import MapData


class PngFiles(Dataset):
    """Every `<index>_<label>.png` in `root`: the image's 64 pixels (0-1) and its label."""

    def __init__(self, root: str):
        self.files = sorted(Path(root).glob("*.png"))
        if not self.files:
            raise ValueError(f"data.root={root}: no PNG files there; write them with python benchmarks/png_digits.py {root}")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.files[index]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"), dtype=np.float32).reshape(-1) / 255.0
        return torch.from_numpy(pixels), torch.tensor(int(path.stem.split("_")[1]))


class PngDigits(MapData):
    """PngFiles served to every backend, with data=digits' keys (model=cnn reads num_features)."""

    def __init__(self, root: str, num_features: int = 64, num_classes: int = 10, eval_fraction: float = 0.2,
                 seed: int = 0, loss: str = "cross_entropy", num_workers: int | None = None):
        self.num_features, self.num_classes = num_features, num_classes
        super().__init__(PngFiles(root), eval_fraction=eval_fraction, seed=seed, num_workers=num_workers, loss=loss)


def write(folder: Path) -> Path:
    """The digits as 8x8 grayscale PNG files in `folder` (made if missing; kept if already written)."""
    folder.mkdir(parents=True, exist_ok=True)
    digits = Digits()
    x = torch.cat([digits.x_train, digits.x_eval]).numpy()
    y = torch.cat([digits.y_train, digits.y_eval]).numpy()
    if len(list(folder.glob("*.png"))) == len(x):
        return folder
    for i, (pixels, label) in enumerate(zip(x, y)):
        Image.fromarray((pixels.reshape(8, 8) * 255).round().astype(np.uint8), mode="L").save(folder / f"{i:05d}_{label}.png")
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    print(f"wrote {write(parser.parse_args().folder)}")
