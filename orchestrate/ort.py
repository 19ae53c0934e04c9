"""ONNX Runtime session options, built in one place for every ORT path: ORTModule's training and
inference sessions, the on-device API's `Module`, and the runner's engines on each worker.

ORT's default CPU threading (a pool of one thread per physical core, spinning while idle) is the
largest speed lever on a small machine: on 2 cores one intra-op thread ran the on-device loop
3.8x faster than the default. So the thread count and spinning are always set explicitly.
"""

from typing import Any


def configure(options: Any, intra_op_threads: int, allow_spinning: bool,
              mapped_dimensions: dict[str, int] | None = None) -> Any:
    """Apply orchestrate's settings to an `onnxruntime.SessionOptions` and return it.
    `intra_op_threads=0` keeps ORT's default pool; `mapped_dimensions` fixes symbolic dimensions
    (ORT's free-dimension overrides, e.g. {"batch": 64}) so that ORT can plan memory for them."""
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    for name, value in (mapped_dimensions or {}).items():
        options.add_free_dimension_override_by_name(name, value)
    return options


def session_options(intra_op_threads: int, allow_spinning: bool, mapped_dimensions: dict[str, int] | None = None):
    """A new `onnxruntime.SessionOptions` with orchestrate's settings."""
    import onnxruntime

    return configure(onnxruntime.SessionOptions(), intra_op_threads, allow_spinning, mapped_dimensions)


def providers() -> list[str]:
    """The execution providers of the installed ORT build (CUDA only in the GPU build)."""
    import onnxruntime

    return onnxruntime.get_available_providers()
