"""The job store's thread with a connection of its own (``robustdist.runtime.job_store.StoreThread``), with real
``TCPStore`` servers: what it does once stopped, and how long stopping it waits."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from robustdist.health.watchdog_store import Heartbeat
from robustdist.runtime import job_store

pytestmark = pytest.mark.timeout(60)


def _blocking_connect(release: threading.Event, entered: threading.Event):
    """A connect that hangs until ``release``, as one to a store cut off by a partition hangs for its timeout."""
    def connect() -> Any:
        entered.set()
        release.wait(30)
        raise TimeoutError("the store did not answer")
    return connect


def test_stopping_a_heartbeat_stuck_in_a_connect_does_not_wait_for_it():
    """A heartbeat whose store cannot be reached sits in its connect; closing it (an in-process recovery's
    teardown) does not wait out the close's bound for a thread that will do nothing more."""
    release, entered = threading.Event(), threading.Event()
    beat = Heartbeat(_blocking_connect(release, entered), "hb/0", 0.1, lambda closed: {"closed": closed}, rank=0,
                     stale_after=1.0).start()
    try:
        assert entered.wait(10)
        t = time.monotonic()
        beat.stop(wait=5.0)
        assert time.monotonic() - t < 1.0
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while beat.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not beat.alive


def test_a_stopped_thread_begins_no_connect_and_uses_none_completed_after_the_stop():
    server = job_store.serve("127.0.0.1", 0, timeout=10)
    connects: list[float] = []

    class Probe(job_store.StoreThread):
        got: Any = "unset"

        def _run(self) -> None:
            self._stop.wait(10)
            self.got = self._client(None)

    def connect() -> Any:
        connects.append(time.monotonic())
        return job_store.connect("127.0.0.1", server.port, timeout=10)

    probe = Probe(connect, "robustdist-test-probe").start()
    probe._end(5.0)
    assert not probe.alive and probe.got is None and connects == []

    stopped_while_connecting = Probe(lambda: (stopped_while_connecting._stop.set(), connect())[1], "robustdist-test")
    assert stopped_while_connecting._client(None) is None and len(connects) == 1
    live = Probe(connect, "robustdist-test")
    client = live._client(None)
    client.set("k", "v")
    assert server.get("k") == b"v"
