import numpy as np
import pytest
import torch

from orchestrate.tasks.data import PRINTABLE, Digits, PythonFiles, PythonSource, Synthetic, decode, encode, read_stdlib


def test_batches_repeat_for_the_same_seed_and_differ_across_epochs():
    data = Synthetic(num_samples=256)
    a, b = data.train_batch(3, 32, seed=1), Synthetic(num_samples=256).train_batch(3, 32, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    per_epoch = data.num_train // 32
    assert not torch.equal(data.train_batch(0, 32, seed=1)[0], data.train_batch(per_epoch, 32, seed=1)[0])


def test_an_epoch_visits_each_sample_once():
    data = Synthetic(num_samples=128, eval_fraction=0.25)  # 96 training samples
    seen = torch.cat([data.train_batch(i, 16, seed=0)[0] for i in range(6)])
    assert len(torch.unique(seen, dim=0)) == 96


def test_ranks_get_disjoint_shards_of_each_global_batch():
    data = Synthetic(num_samples=512)
    shards = [data.train_batch(5, 16, seed=0, rank=r, world_size=2)[0] for r in range(2)]
    together = torch.cat(shards)
    assert len(torch.unique(together, dim=0)) == 32
    assert torch.equal(together, data.train_batch(5, 32, seed=0)[0])  # same samples as one worker with 2B


def test_digits_is_the_bundled_data_set():
    data = Digits()
    assert data.x_train.shape[1] == 64 and len(data.x_train) + len(data.x_eval) == 1797
    assert set(data.y_train.unique().tolist()) == set(range(10))
    with pytest.raises(ValueError, match="fixed for digits"):
        Digits(num_classes=5)


def test_python_source_windows_are_shifted_by_one_character():
    data = PythonSource(block_size=32, max_chars=20_000)
    x, y = data.x_train[0], data.y_train[0]
    assert torch.equal(x[1:], y[:-1])
    assert "def " in decode(data.x_train[:50].reshape(-1))
    assert int(data.x_train.max()) < len(PRINTABLE) == 96


def test_encoding_keeps_printable_ascii_and_newlines():
    assert decode(encode("def f():\n\treturn 'caf\u00e9'")) == "def f():\n return 'caf?'"
    with pytest.raises(ValueError, match="data.vocab_size is fixed at 96"):
        encode("x", vocab_size=128)


def test_python_files_windows_are_labelled_by_their_file_and_balanced():
    files = ["argparse.py", "encodings/cp437.py"]
    data = PythonFiles(files=files, num_classes=2, block_size=32, max_chars=8000)
    texts = [decode(encode(text[:8000])) for text in read_stdlib(files)]
    x, y = torch.cat([data.x_train, data.x_eval]), torch.cat([data.y_train, data.y_eval])
    assert y.bincount().tolist() == [250, 250]  # 8000 characters of each file: 250 windows of 32
    for window, label in zip(x, y):
        assert decode(window) in texts[label]
    with pytest.raises(ValueError, match="data.num_classes=3 must be the number of data.files"):
        PythonFiles(files=files, num_classes=3)


def test_synthetic_targets_fit_their_losses():
    assert Synthetic(target="regression", loss="mse").y_train.dtype == torch.float32
    multilabel = Synthetic(target="multilabel", loss="bce_with_logits").y_train
    assert set(np.unique(multilabel.numpy()).tolist()) == {0.0, 1.0}
    with pytest.raises(ValueError, match="data.loss='hinge'"):
        Synthetic(loss="hinge")
