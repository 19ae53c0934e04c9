"""Stopping from outside: SIGINT (Ctrl-C), SIGTERM (`docker stop`, systemd, Slurm's scancel, `ray
job stop`) and SIGHUP (a closed terminal, a dropped SSH session) stop a run, a server or a Ray
allocation as Ctrl-C does: a `Stopped` (a KeyboardInterrupt) raised in the main thread, so that
whatever cleans up after Ctrl-C does so alike (`stop_on_signals`), and the exit code says which
signal it was (128 + N, as a shell reports it: orchestrate.boundary). Imports nothing heavy: the
commands that do not train use it too.
"""

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

# What Ctrl-C (SIGINT), `docker stop`, Slurm's scancel and `ray job stop` (SIGTERM), and a closed
# terminal or a dropped SSH session (SIGHUP) send.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_signals() -> list[signal.Signals]:
    """The STOP_SIGNALS a run takes here: all of them, but SIGHUP where it is ignored (`nohup`:
    the user asked the run to outlive the terminal)."""
    return [s for s in STOP_SIGNALS if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)]


class Stopped(KeyboardInterrupt):
    """Stopped by a signal: a KeyboardInterrupt, so everything that cleans up after Ctrl-C (a
    run's MLflow run marked KILLED, Ray shut down, a half-written checkpoint removed, a server
    stopped) does so alike."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGHUP (`stop_signals`) raise Stopped in the main
    thread (Python's default SIGTERM and SIGHUP end the process on the spot: a run's MLflow run
    would stay RUNNING, Ray's processes and a server's PostgreSQL orphaned). The first signal
    stops the block; later ones, while it closes (the MLflow run's end, Ray's shutdown, each
    bounded), are reported and ignored: SIGKILL still ends it at once. The previous handlers come
    back on the way out. Elsewhere than the main thread (signals are delivered there only) nothing
    changes."""
    global _received, _stop
    if not main_thread():
        yield
        return
    outer, _received = _received, []

    def stop(signum, frame) -> None:
        if _received:
            print(f"{signal.Signals(signum).name}: stopping already; SIGKILL ends the process at once",
                  file=sys.stderr, flush=True)
            return
        _received.append(signum)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in stop_signals()}
    outer_stop, _stop = _stop, stop
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _received, _stop = outer, outer_stop


# Module state: the signal that stopped the run in the innermost stop_on_signals block, and that
# block's handler (which reinstall_handlers puts back: a signal handler is process-wide); the
# block sets both and puts the outer block's back.
_received: list[int] = []
_stop = None


def stopped_by() -> Stopped | None:
    """The Stopped of the signal that stopped the run, for code that sees only a plain
    KeyboardInterrupt (Ray's wait for a result turns the handler's exception into one)."""
    return Stopped(_received[0]) if _received else None


def reinstall_handlers() -> None:
    """Put the run's signal handlers (`stop_signals`) back in force, beneath Python too: `ray.init` sets
    a Python SIGTERM handler of its own (`sys.exit(15)`: the run would end FAILED), and Ray's core
    worker a native failure-signal handler that prints a stack trace and aborts, which Python would
    never hear of. Outside a stop_on_signals block, Python's current handlers are set again."""
    if not main_thread():
        return
    for signum in stop_signals():
        handler = _stop if _stop is not None else signal.getsignal(signum)
        if handler is not None:
            signal.signal(signum, handler)


def main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
