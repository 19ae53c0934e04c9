"""Which process holds a run open (orchestrate.tracking.owner): its tag read back, and its heartbeat."""

import threading
import time

from orchestrate.tracking.owner import Heartbeat, Owner


def test_an_owner_reads_back_from_its_tag_and_this_process_is_alive():
    me = Owner.this_process()
    assert Owner.parse(me.tag()) == Owner(me.host, me.pid, round(me.started, 2))
    assert Owner.parse(me.tag()).alive() and Owner.parse("not an owner") is None and Owner.parse(None) is None


def test_a_heartbeat_beats_at_once_then_every_period_and_stop_ends_its_thread():
    beats = []
    heartbeat = Heartbeat(lambda: beats.append(time.monotonic()), every_s=0.05)
    assert len(beats) == 1  # at once: the record is fresh before anything else happens
    time.sleep(0.3)
    heartbeat.stop()
    count = len(beats)
    assert count >= 3 and not heartbeat.thread.is_alive()
    assert heartbeat.thread not in threading.enumerate()
    time.sleep(0.1)
    assert len(beats) == count
