"""Which process holds a run open, and whether it still does: its host, pid and start time, kept in
a tag of the run. On the same host the process itself is looked up (a pid reused by another
process since has another start time); on another host, whose processes this one cannot see, by
the run's heartbeat: the holder writes the time into another tag every HEARTBEAT_S, and a holder
silent for STALE_S is gone (killed, its machine lost).

A sweep's parent run has one (orchestrate.sweeps._runs): a second command on the same sweep is
refused while it lives, and the runs a killed attempt left RUNNING are closed by the next one."""

import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

HEARTBEAT_S = 5.0  # how often a holder says it still holds the run (a sweep: and checks its server)
STALE_S = 60.0  # a holder on another host silent this long is gone


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: float  # the process's start, seconds since the epoch

    @classmethod
    def this_process(cls) -> "Owner":
        import psutil

        return cls(platform.node(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def parse(cls, text: str | None) -> "Owner | None":
        """An Owner as `tag` wrote it; None for anything else (a run an older version opened)."""
        try:
            host, pid, started = (text or "").split()
            return cls(host, int(pid), float(started))
        except ValueError:
            return None

    def tag(self) -> str:
        return f"{self.host} {self.pid} {self.started:.2f}"

    def __str__(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, started {since}"

    def alive(self, beat_at: float | None = None, now: float | None = None) -> bool:
        """Whether this process still runs: looked up on this host; elsewhere, whether its last
        heartbeat (`beat_at`, seconds since the epoch) is younger than STALE_S."""
        if self.host != platform.node():
            return beat_at is not None and (now or time.time()) - beat_at < STALE_S
        return alive(self.pid, self.started)


def alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` of this host runs (another user's too), and if `started` is given,
    is the process that started then (not a later one given the same pid)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return started is None or abs(process.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class Heartbeat:
    """`beat()` now and every HEARTBEAT_S on a thread of its own, until `stop()` (which joins it)."""

    def __init__(self, beat: Callable[[], None], every_s: float = HEARTBEAT_S) -> None:
        self.beat, self.every_s = beat, every_s
        self.stopped = threading.Event()
        beat()
        self.thread = threading.Thread(target=self._run, name="orchestrate-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the server away for a moment: the next beat may reach it
                pass

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5.0)
