"""ONNX Runtime session options, built in one place for every ORT path: ORTModule's training and
inference sessions, the on-device API's `Module`, and the runner's engines on each worker.

ORT's default CPU threading (a pool of one thread per physical core, spinning while idle) is the
largest speed lever on a small machine: on 2 cores one intra-op thread ran the on-device loop
3.8x faster than the default. So the thread count and spinning are always set explicitly.

How loud ORT is (`backend.log_level`) is set here too: ORTModule's banner, the C++ logger's lines,
the torch.onnx exporter's warnings and the import warnings ORT triggers (DeepSpeed missing) reach
the console only from that level up; below it they go to the run's log file alone (`quiet`; for
an export on its own, `exporting`; for ORT's first import, `load`).
"""

import contextlib
import functools
import importlib
import importlib.util
import logging
import logging.handlers
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from orchestrate import thirdparty

# backend.log_level: ORTModule's LogLevel names (DEVINFO is for ORT's developers), as Python
# logging levels (ORTModule's own mapping, onnxruntime/training/ortmodule/_logger.py) and as the
# severities of ORT's C++ logger (0 verbose .. 4 fatal).
LEVELS = {"VERBOSE": logging.DEBUG, "DEVINFO": logging.INFO, "INFO": logging.INFO, "WARNING": logging.WARNING,
          "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
SEVERITIES = {"VERBOSE": 0, "DEVINFO": 1, "INFO": 1, "WARNING": 2, "ERROR": 3, "FATAL": 4}
ORT_DEFAULT_SEVERITY = 2  # ORT's default logger starts at WARNING; ORT offers no way to read it back
# Module state: ORT's process-wide default logger severity as last set through set_default_severity
# (ORT cannot read it back); orchestrate.process.kept puts it back after each run.
_default_severity = ORT_DEFAULT_SEVERITY


def configure(options: Any, intra_op_threads: int, allow_spinning: bool,
              mapped_dimensions: dict[str, int] | None = None, log_level: str | None = None) -> Any:
    """Apply orchestrate's settings to an `onnxruntime.SessionOptions` and return it.
    `intra_op_threads=0` keeps ORT's default pool; `mapped_dimensions` fixes symbolic dimensions
    (ORT's free-dimension overrides, e.g. {"batch": 64}) so that ORT can plan memory for them;
    `log_level` (a LEVELS name) sets the session's C++ log severity."""
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    if log_level is not None:
        options.log_severity_level = SEVERITIES[log_level]
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    for name, value in (mapped_dimensions or {}).items():
        options.add_free_dimension_override_by_name(name, value)
    return options


def session_options(intra_op_threads: int, allow_spinning: bool, mapped_dimensions: dict[str, int] | None = None,
                    log_level: str | None = None):
    """A new `onnxruntime.SessionOptions` with orchestrate's settings."""
    import onnxruntime

    return configure(onnxruntime.SessionOptions(), intra_op_threads, allow_spinning, mapped_dimensions, log_level)


def providers() -> list[str]:
    """The execution providers of the installed ORT build (CUDA only in the GPU build)."""
    import onnxruntime

    return onnxruntime.get_available_providers()


def quiet(log_level: str) -> None:
    """ORT's own output reaches the console from `log_level` (a LEVELS name) up; below it, only
    the run's log file (the handlers that write to files) gets it. Imports ORT if it is not yet.

    Process-wide, and put back when the run ends (orchestrate.process.kept): Python warnings go
    through logging (`logging.captureWarnings`), the console handlers get a `HideOrtOutput` filter,
    and ORT's default C++ logger gets the level's severity (its lines cannot be routed to the log
    file: below the level they are not printed at all)."""
    logging.captureWarnings(True)
    load()  # what its first import prints ("No CUDA runtime is found"): into the log
    with stderr_logged():
        # After the import: ORT's tools call logging.basicConfig, a console handler where there was none.
        for handler in console_handlers():
            for old in [f for f in handler.filters if isinstance(f, HideOrtOutput)]:
                handler.removeFilter(old)
            handler.addFilter(HideOrtOutput(LEVELS[log_level]))
        set_default_severity(SEVERITIES[log_level])


def console_handlers() -> list[logging.Handler]:
    """The handlers that print: the root logger's stream handlers that do not write to a file
    (Hydra's `console`), or logging's last resort when the root logger has no handler at all."""
    root = logging.getLogger()
    found = [h for h in root.handlers
             if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    if not root.handlers and logging.lastResort is not None:
        found.append(logging.lastResort)
    return found


class HideOrtOutput(logging.Filter):
    """On a console handler: lets through every record except ORT's below `threshold`, but for
    ORTModule's fallback to PyTorch (the run no longer trains through ORT: always worth a line)."""

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold = threshold

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= self.threshold or not from_ort(record)
                or str(record.msg).startswith(ALWAYS_SHOWN))


ALWAYS_SHOWN = ("Fallback to PyTorch",)  # ORTModule's warning when it hands the model back to PyTorch


ORT_LOGGERS = ("orttraining", "onnxruntime")  # ORTModule's logger (".rank-N" on the runner), stderr_logged's
# Where `exporting` logs the exporter's warnings. Not under "torch": torch's logging owns that
# tree (its own stderr handler, nothing passed on to the root logger's handlers: no log file).
EXPORTER_LOGGER = "orchestrate.export"
# Warnings the exporter's tracer raises with the model's line as their place (where the model
# turns a tensor into a Python number or a shape into a constant): the exporter's, wherever raised.
EXPORTER_WARNINGS = ("TracerWarning",)
# A captured warning's message: "<file>:<line>: <Category>: <text>" (warnings.formatwarning).
_WARNING_LINE = re.compile(r"^.*?:\d+: (\w+): ")


def from_ort(record: logging.LogRecord) -> bool:
    """ORT's output: its loggers' records and the exporter's, records logged from ORT's Python code
    (the on-device API's artifact builder logs to the root logger), and Python warnings raised in
    ORT or in the torch.onnx exporter that ORT drives (the tracer's too, raised at the model's line)."""
    if record.name.split(".")[0] in ORT_LOGGERS or record.name == EXPORTER_LOGGER:
        return True
    if record.name == "py.warnings":
        message = record.getMessage()
        found = _WARNING_LINE.match(message)
        return message.startswith(_ort_sources()) or (found is not None and found.group(1) in EXPORTER_WARNINGS)
    return record.pathname.startswith(_ort_sources())


@functools.cache
def _ort_sources() -> tuple[str, ...]:
    """The folders of ORT's and torch.onnx's Python code."""
    found = []
    for name in ("onnxruntime", "torch.onnx"):
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations:
                found += [os.path.join(folder, "") for folder in spec.submodule_search_locations]
    return tuple(found)


def default_severity() -> int:
    """ORT's default logger severity, as orchestrate last set it (ORT's own default otherwise)."""
    return _default_severity


def set_default_severity(severity: int) -> None:
    """`onnxruntime.set_default_logger_severity`, remembered (ORT cannot be asked for it back)."""
    global _default_severity
    import onnxruntime

    onnxruntime.set_default_logger_severity(severity)
    _default_severity = severity


# ORT's C++ log line: "2026-11-26 10:19:00.399 [I:onnxruntime:Default, graph_transformer.cc:15 Apply] ..."
_C_LINE = re.compile(r"\[([VIWEF]):onnxruntime:")
# Lines that say how the machine is, not that anything is wrong: logged at INFO (the log file).
_NOTICES = ("No CUDA runtime is found",)  # torch's C++ extension helpers, on a machine with a CUDA toolkit and no GPU
_C_LEVELS = {"V": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def load():
    """onnxruntime (None where it is not installed: ORT is an extra, orchestrate.extras), imported
    once with what its import prints sent to the log file only:
    onnxruntime-training imports torch's C++ extension helpers, which print "No CUDA runtime is
    found" to stderr on a machine with a CUDA toolkit and no GPU (every run's console, every sweep
    trial's and every runner worker's, otherwise). Without ORT those helpers are imported here
    alike (torch.compile's Inductor imports them on its first compilation). The run's backend is
    not known yet when a job is built, so the console gets what the import prints from the
    default `backend.log_level` (ERROR) up. On the runner's workers Ray Train's print() goes to
    logging as it is called: those records are this thread's meanwhile, and kept off the console too."""
    present = importlib.util.find_spec("onnxruntime") is not None
    first = "onnxruntime" if present else "torch.utils.cpp_extension"
    if first not in sys.modules:
        with off_console(), stderr_logged(console_from="ERROR"):  # ORT's import adds a console handler
            importlib.import_module(first)
    return sys.modules["onnxruntime"] if present else None


def off_console(log_level: str = "ERROR"):
    """Meanwhile, what this thread logs below `log_level` (a LEVELS name) reaches the handlers
    that write files and not the console's (`console_handlers`); other threads' records are left
    alone."""
    return console_filtered(_ThisThreadBelow(LEVELS[log_level]))


@contextlib.contextmanager
def console_filtered(hide: logging.Filter) -> Iterator[None]:
    """Meanwhile the console's handlers (`console_handlers`) drop what `hide` refuses; the handlers
    that write files keep it. Their filters are given back on the way out."""
    handlers = console_handlers()
    for handler in handlers:
        handler.addFilter(hide)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(hide)


class _ThisThreadBelow(logging.Filter):
    """Hides the records of the thread that made it below `threshold`; lets the rest through."""

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold, self.thread = threshold, threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.threshold or record.thread != self.thread


@contextlib.contextmanager
def exporting(log_level: str = "ERROR") -> Iterator[None]:
    """Around a torch.onnx export: the Python warnings it raises (the tracer's TracerWarning where
    the model turns a tensor into a Python number, the exporter's FutureWarning about `training`)
    are logged to the `orchestrate.export` logger instead of printed: the run's log file has them, the
    console from `log_level` (the backend's `log_level`, a LEVELS name) up. Python's warning
    filters still decide which are raised at all (an "error" filter still raises, "ignore" still
    drops), and are as they were afterwards. The export runs with torch.onnx's own symbolics
    (`thirdparty.standard_symbolics`), whatever ORTModule registered earlier in the process."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught, thirdparty.standard_symbolics():
            yield
    finally:
        logger = logging.getLogger(EXPORTER_LOGGER)
        with off_console(log_level):
            for w in caught:
                text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line).rstrip()
                logger.handle(logger.makeRecord(EXPORTER_LOGGER, logging.WARNING, w.filename, w.lineno, text,
                                                None, None))


@contextlib.contextmanager
def records_kept() -> Iterator[list[logging.LogRecord]]:
    """The log records that reach the root logger meanwhile (from INFO up, as a run's log takes
    them, and whatever `stderr_logged` and `exporting` hand on), kept instead of handled, for a run
    to log later (`replay`): a check that builds what the run reuses (the on-device artifacts) runs
    before the run's log exists, and the run's log still holds ORT's account of the build."""
    keeper = logging.handlers.BufferingHandler(capacity=sys.maxsize)  # never full: never flushed
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = [keeper]
    root.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        yield keeper.buffer
    finally:
        root.handlers = handlers
        root.setLevel(level)


def replay(records: list[logging.LogRecord]) -> None:
    """Records `records_kept` kept, handled now by the loggers they were made for (the run's log
    file takes them all; the console what its filters let through: HideOrtOutput)."""
    for record in records:
        logging.getLogger(record.name).handle(record)


@contextlib.contextmanager
def stderr_logged(name: str = "onnxruntime", console_from: str | None = None) -> Iterator[None]:
    """What is written to file descriptor 2 meanwhile (ORT's C++ logger, which some ORT calls run
    at INFO whatever the settings say: the on-device API's artifact builder; and prints from the
    imports ORT triggers) goes to the logger `name` instead: one record per line, at the line's
    ORT severity (WARNING for a line without one), whatever the logger's level. The console
    shows them from `backend.log_level` up (HideOrtOutput), the log file all of them; with
    `console_from` (a LEVELS name), from that level up, whatever console handlers there are by then."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no file descriptor 2 to take over
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            logger = logging.getLogger(name)
            with off_console(console_from) if console_from else contextlib.nullcontext():
                for line in captured.read().decode(errors="replace").splitlines():
                    if line.strip():
                        found = _C_LINE.search(line)
                        level = (_C_LEVELS[found.group(1)] if found else
                                 logging.INFO if line.startswith(_NOTICES) else logging.WARNING)
                        logger.handle(logger.makeRecord(name, level, __file__, 0, line, None, None))
