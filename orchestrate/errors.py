"""What the error boundary (orchestrate.boundary) says and keeps: one line, `error: ` what failed
(the user's file and line where the error came from, the step of a run) and the cause, and where
the full traceback was written: the run's own log when there is a run folder, else a crash file in
the temporary folder (as npm and rustc keep theirs). `HYDRA_FULL_ERROR=1` prints the traceback too.
"""

import contextlib
import datetime
import os
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path


class Refused(Exception):
    """A command's input, or what it names, is wrong (a flag, a folder, a port taken, a program or
    package missing): nothing ran. The boundary prints its line; exit code 2. Each command's own
    kinds subclass it (ServerError, SlurmRayError)."""


class Failed(Exception):
    """What a command started failed (a server that exited, a sweep's Slurm job that ended without
    its result): the boundary prints its line (and keeps its cause's traceback); exit code 1."""


class Escaped(BaseException):
    """`error` raised where Hydra would catch it and only warn (a callback's hook: Hydra's
    callbacks wrap each call in `except Exception`): a BaseException passes that, and the boundary
    gives `error` its own row of the table."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (orchestrate.checkpoints); the message is one line: the
    step, the folder, the cause, and which finished checkpoint is kept."""


PACKAGE = str(Path(__file__).resolve().parent) + os.sep
# Frames of these folders are the machinery around the user's code, not where an error came from.
LIBRARY_FOLDERS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def origin(error: BaseException) -> str | None:
    """`file:line` of the innermost frame of the user's own code (not the standard library, an
    installed package or orchestrate) in the error's traceback, following its causes; None if no
    frame is the user's."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames = traceback.extract_tb(error.__traceback__)
        for frame in reversed(frames):
            path = os.path.abspath(frame.filename)
            if path.startswith(PACKAGE) or path.startswith(LIBRARY_FOLDERS) or frame.filename.startswith("<"):
                continue
            return f"{shown_path(path)}:{frame.lineno}"
        error = error.__cause__ or error.__context__
    return None


def shown_path(path: str) -> str:
    """A path as the user would type it: relative to the working folder when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def one_line(error: BaseException, what: str = "") -> str:
    """`what: ExceptionType: first line of its message (file:line) at step N`, the parts known;
    the config key the error itself names (`mark(what=...)`) before the caller's `what`."""
    text = _message_line(error)
    what = getattr(error, "orchestrate_what", "") or what
    parts = [f"{what}: " if what else "", type(error).__name__, f": {text}" if text else ""]
    where = origin(error)
    if where:
        parts.append(f" ({where})")
    step = getattr(error, "orchestrate_step", None)
    if step:
        parts.append(f" at step {step}")
    return "".join(parts)


def first_line(error: BaseException, typed: bool = False) -> str:
    """The first non-empty line of the error's message (its type's name when it has none);
    `typed`: `Type: line`."""
    text = _message_line(error)
    if typed:
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text or type(error).__name__


def _message_line(error: BaseException) -> str:
    """The first non-empty line of the error's message, or "" for none."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def mark(error: BaseException, **facts) -> None:
    """Note on the error what the boundary's line names (`what`: the config key whose object
    raised; `step`; `run`: the MLflow run marked FAILED), as `orchestrate_<name>` attributes."""
    for name, value in facts.items():
        try:
            setattr(error, f"orchestrate_{name}", value)
        except AttributeError:  # an exception type that takes no attributes: its line says less
            pass


def write_traceback(error: BaseException, log_file: str | Path | None = None) -> Path:
    """Append the full traceback to `log_file` (the run's log), or write a crash file when there
    is none; returns where it went."""
    text = "".join(traceback.format_exception(error))
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    if log_file:
        path = Path(log_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"[{stamp}] the error, in full:\n{text}")
            return path
        except OSError:
            pass  # a folder that cannot be written (the cause itself, maybe): the crash file then
    fd, name = tempfile.mkstemp(prefix=f"orchestrate-crash-{datetime.datetime.now():%Y%m%d-%H%M%S}-",
                                suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"orchestrate {' '.join(sys.argv[1:])}\n{stamp}\n\n{text}")
    return Path(name)


# Module state: what the user's HYDRA_FULL_ERROR said, while hydra_raising() holds it (Hydra reads
# the variable deep inside its own calls); that block pushes and pops it.
_USER_FULL_ERROR: list[bool] = []


@contextlib.contextmanager
def hydra_raising() -> Iterator[None]:
    """Hydra prints an error out of its own steps (making the output folder, a sweeper's or a
    launcher's failure) as a traceback; with HYDRA_FULL_ERROR=1 it raises it instead, for the
    boundary to give it one line. The user's own setting still decides whether `report` prints
    the traceback too."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    _USER_FULL_ERROR.append(before == "1")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        _USER_FULL_ERROR.pop()
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


def report(line: str, error: BaseException, log_file: str | Path | None = None) -> None:
    """Print `error: line; full traceback in PATH`, and the traceback itself when the user set
    HYDRA_FULL_ERROR=1."""
    where = write_traceback(error, log_file)
    if _USER_FULL_ERROR[-1] if _USER_FULL_ERROR else os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exception(error, file=sys.stderr)
    print(f"error: {line}; full traceback in {where}", file=sys.stderr, flush=True)
