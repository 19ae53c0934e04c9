"""The models and data sets that ship with orchestrate: all offline, all small enough for a laptop.

- `data.Digits`: scikit-learn's bundled 8x8 digits (1797 images, 10 classes).
- `data.PythonSource`: characters of the Python standard library's own source files.
- `data.Synthetic`: a random teacher network's labels, for fast tests.
- `models.MLP` and `models.CharTransformer` (a small GPT-style language model).

Point `model._target_` or `data._target_` at your own classes to train something else.
"""
