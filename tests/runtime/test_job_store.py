"""The job store's thread with a connection of its own (``robustdist.runtime.job_store.StoreThread``), with a real
``TCPStore`` server: what it does once stopped."""

from __future__ import annotations

import time
from typing import Any

import pytest

from robustdist.runtime import job_store

pytestmark = pytest.mark.timeout(60)


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
