"""A thread of a closed generation never writes into the store that replaces it (generations never
mix). A store client retries its connect for its whole timeout, and an in-process recovery starts the next
generation's server on the same port: a connect begun while the old server was already gone completes against
the new one. Real TCPStore servers on one port, one after the other; the connect really retrying.

Seen in the 100-recovery leak test before the fix: a watchdog heartbeat of generation 4 (its connect begun as
that generation's server closed) written into generation 10's store, 7.5 s later."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from robustdist.health import watchdog_store as ws
from robustdist.recovery import declarations
from robustdist.recovery.faults import FaultWatch

pytestmark = pytest.mark.timeout(120)
CONNECT_S = 20.0  # the writers' connect timeout: long enough to outlive the old server and reach the new one


def _server(port: int = 0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def _connect(port: int):
    return lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=CONNECT_S))


class _Closed:
    """The old generation's store object, once its server is gone."""

    def set(self, *_: Any) -> None:
        raise ConnectionError("the store is closed")


def _gone_port() -> int:
    """The port of a server that is gone: nothing listens there (the old generation's server, closed)."""
    old = _server()
    port = old.port
    del old
    return port


def _announced(port: int) -> tuple[threading.Event, Any]:
    """A connect to ``port`` that sets the event as it begins."""
    connecting, connect = threading.Event(), _connect(port)

    def announced() -> Any:
        connecting.set()
        return connect()

    return connecting, announced


def _replaced(port: int, connecting: threading.Event, end_generation: Any, done: Any) -> dist.TCPStore:
    """Once the writer is retrying its connect to the closed port: the generation ends (its close, its stop),
    then the next generation's server starts on the same port; returns it after the writer is done."""
    assert connecting.wait(10)
    time.sleep(0.3)  # the connect is under way, refused and retrying
    end_generation()
    new = _server(port)
    deadline = time.monotonic() + CONNECT_S + 10
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done(), "the writer's thread did not end once its connect completed"
    return new


def _keys(store: dist.TCPStore) -> list[str]:
    return sorted(store.list_keys())


def test_a_heartbeat_connected_after_its_stop_writes_nothing():
    port = _gone_port()
    connecting, slow_connect = _announced(port)

    beat = ws.Heartbeat(slow_connect, "robustdist/watchdog/4/1", 0.05, lambda closed: {"closed": closed},
                        rank=1, stale_after=1.0).start()
    new = _replaced(port, connecting, lambda: beat.stop(wait=0.1), lambda: not beat._thread.is_alive())
    assert _keys(new) == []


def test_a_heartbeat_connected_before_its_stop_writes_its_closed_record_there():
    """The closed record is still written where the connection was made before the stop (the usual case)."""
    store = _server()
    beat = ws.Heartbeat(_connect(store.port), "robustdist/watchdog/0/0", 0.05,
                        lambda closed: {"closed": closed}, rank=0, stale_after=1.0).start()
    deadline = time.monotonic() + 10
    while not store.check(["robustdist/watchdog/0/0"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop(wait=10)
    assert store.get("robustdist/watchdog/0/0") == b'{"closed": true}'


def test_a_fault_watch_closed_while_connecting_holds_nothing_on_the_next_server():
    port = _gone_port()
    connecting, slow_connect = _announced(port)

    watch = FaultWatch(slow_connect, _Closed(), generation=4, world_size=2, rank=1,
                       on_fault=lambda g: None).start()
    # without the rule the thread would wait on the new server, for its wake key of generation 4, for 300 s
    new = _replaced(port, connecting, lambda: watch.close(join_timeout=0.1), lambda: not watch.alive)
    assert _keys(new) == []


def test_a_hang_report_abandoned_while_connecting_writes_nothing():
    port = _gone_port()
    box = ws.Collected()
    connecting, slow_connect = _announced(port)

    thread = threading.Thread(target=ws.collect, args=(slow_connect, "robustdist/watchdog/4/1",
                                                       lambda: {"where": "x"},
                                                       ws.Watch("robustdist/watchdog/4", 2, limit=15.0, interval=5.0),
                                                       time.monotonic() + 60, box), daemon=True)
    thread.start()
    new = _replaced(port, connecting, lambda: setattr(box, "abandoned", True), lambda: not thread.is_alive())
    assert _keys(new) == []


def test_a_hang_declared_after_the_generation_s_fault_was_handled_is_not_written():
    old = _server()
    fired = threading.Event()
    on_hang = declarations.hang_declarer(old, "robustdist/recovery", 4, 1, 2, CONNECT_S, fired)
    port = old.port
    del old
    report = SimpleNamespace(idle_seconds=7.0, step=3, summary="")
    connecting = threading.Event()
    thread = threading.Thread(target=lambda: (connecting.set(), on_hang(report)), daemon=True)
    thread.start()
    new = _replaced(port, connecting, fired.set, lambda: not thread.is_alive())
    assert _keys(new) == []


def test_a_hang_declared_in_its_generation_is_written():
    """The check does not stop the ordinary case: the hang becomes generation 4's fault."""
    store = _server()
    on_hang = declarations.hang_declarer(store, "robustdist/recovery", 4, 1, 2, CONNECT_S, threading.Event())
    on_hang(SimpleNamespace(idle_seconds=7.0, step=3, summary=""))
    assert store.add("robustdist/recovery/4/fault", 0) == 1
    assert b"HangError: rank 1" in store.get("robustdist/recovery/4/why/1")


def test_a_closing_watchdog_stops_its_heartbeat_before_it_waits_for_its_own_thread():
    """The wait for the watchdog's thread can take seconds (a hang callback in a store call): a heartbeat still
    free to connect meanwhile could reach the next generation's server. It is stopped first."""
    from robustdist.health.watchdog import Watchdog

    store = _server()
    dog = Watchdog(600, store=store, rank=0, world_size=2)
    beat, thread = dog._heartbeat, dog._thread
    assert beat is not None
    seen: list[bool] = []
    join = thread.join
    thread.join = lambda timeout=None: (seen.append(beat._stop.is_set()), join(timeout))[1]  # type: ignore[method-assign]
    dog.close()
    assert seen == [True] and not beat._thread.is_alive()
