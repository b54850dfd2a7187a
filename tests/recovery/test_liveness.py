"""A rank whose heartbeats stop is a fault of that rank (robustdist.recovery.liveness): a real TCPStore,
real heartbeat threads (robustdist.health.watchdog_store.Heartbeat), one of them in another process that is
stopped with SIGSTOP. The loop's use of it (a stopped rank named, a short stop recovered in place) is tested in
test_run.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from robustdist.health import watchdog_store as ws
from robustdist.recovery import liveness
from robustdist.recovery.faults import declare_fault, declare_found, read_fault

pytestmark = pytest.mark.timeout(120)
INTERVAL, LIMIT = 0.2, 0.6  # the heartbeats' interval, and how long a record may stay unchanged (3 intervals)
PREFIX, SCOPE = "robustdist/watchdog/7", "robustdist/recovery"

_BEATING = """
import sys, time, os
from datetime import timedelta
import torch.distributed as dist
from robustdist.health import watchdog_store as ws
port, rank, step, skew = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[6])
connect = lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
record = lambda closed: {"alive": time.time() + skew, "beat_wall": time.time() + skew, "seq": 1, "step": step,
                         "node": "node 1 (host lab-1, 10.0.0.2)", "closed": closed}
ws.Heartbeat(connect, sys.argv[4], float(sys.argv[5]), record, rank=rank, stale_after=3 * float(sys.argv[5])).start()
print("beating", flush=True)
time.sleep(600)  # the training thread stuck in Python: the heartbeat thread goes on
"""


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server


def _record(closed: bool) -> dict[str, Any]:
    now = time.time()
    return {"alive": now, "beat_wall": now, "seq": 1, "step": 3, "node": "node 0 (host lab-0, 10.0.0.1)",
            "closed": closed}


def _connect(port: int):
    return lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _beat(port: int, rank: int) -> ws.Heartbeat:
    return ws.Heartbeat(_connect(port), f"{PREFIX}/{rank}", INTERVAL, _record, rank=rank, stale_after=LIMIT).start()


def _watch(port: int, world: int, fired: threading.Event | None = None) -> liveness.LivenessWatch:
    return liveness.LivenessWatch(_connect(port), prefix=PREFIX, world_size=world, interval=INTERVAL, limit=LIMIT,
                                  generation=2, scope=SCOPE, fired=fired or threading.Event())


def _other_process(port: int, rank: int, step: int = 41, skew: float = 0.0) -> subprocess.Popen:
    """Rank ``rank``'s heartbeat in a process of its own, its wall clock ``skew`` s off this one's."""
    proc = subprocess.Popen([sys.executable, "-c", _BEATING, str(port), str(rank), str(step), f"{PREFIX}/{rank}",
                             str(INTERVAL), str(skew)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "beating"
    return proc


def _end(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(timeout=30)


def _wait(until, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(until())


@pytest.mark.processes
def test_a_stopped_rank_is_declared_faulty_and_the_live_ranks_are_not(store):
    own = _beat(store.port, 0)
    other = _other_process(store.port, 1)
    watch = None
    try:
        assert _wait(lambda: store.check([f"{PREFIX}/0", f"{PREFIX}/1"]), 20)
        watch = _watch(store.port, 2).start()
        # both beating (rank 1's training thread asleep in Python: its heartbeat thread goes on): no fault, for
        # many times the stale age
        time.sleep(10 * LIMIT)
        assert watch.alive and read_fault(store, generation=2, world_size=2, scope=SCOPE) is None
        os.kill(other.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert _wait(lambda: not watch.alive, 30)
        fault = read_fault(store, generation=2, world_size=2, scope=SCOPE)
        assert fault is not None and fault.count == 1 and set(fault.why) == {1} and watch.declared == [1]
        why = fault.why[1]
        assert why["by"] == 0 and why["node"] == "node 1 (host lab-1, 10.0.0.2)", why  # the stopped rank's node
        assert why["what"].startswith("HeartbeatsStopped: no new heartbeat from rank 1 for "), why
        assert "expected one every 0.2 s; the bound 0.6 s; its last said step 41" in why["what"], why
        assert time.monotonic() - stopped >= LIMIT - INTERVAL  # not before the record could be stale
        # every rank's watch is woken
        assert store.check([f"{SCOPE}/2/wake/0", f"{SCOPE}/2/wake/1"])
    finally:
        _end(other)
        own.stop(wait=5)
        if watch is not None:
            watch.close()


def test_a_rank_that_never_beats_is_not_judged_and_a_warning_says_so(store, caplog):
    """No record at all is what a watchdog made on one rank only looks like (every later key shifts): judging it
    would fault every generation, so it is named in a warning instead."""
    beats = [_beat(store.port, 0), _beat(store.port, 1)]
    try:
        assert _wait(lambda: store.check([f"{PREFIX}/0", f"{PREFIX}/1"]), 20)
        with caplog.at_level("WARNING", logger="robustdist"):
            watch = _watch(store.port, 3).start()  # rank 2 never writes
            assert _wait(lambda: "rank(s) [2] wrote no heartbeat under robustdist/watchdog/7" in caplog.text, 20)
        time.sleep(3 * LIMIT)
        assert watch.alive and read_fault(store, generation=2, world_size=3, scope=SCOPE) is None
        assert "Fix: create the same watchdogs on every rank" in caplog.text
        watch.close()
    finally:
        for beat in beats:
            beat.stop(wait=5)


@pytest.mark.processes
def test_a_rank_whose_clock_is_far_behind_is_not_lost_while_its_record_changes(store):
    """Only rank 0's clock is used: a record whose wall time is 1000 s old, but new each interval, is alive."""
    own = _beat(store.port, 0)
    other = _other_process(store.port, 1, skew=-1000.0)
    try:
        assert _wait(lambda: store.check([f"{PREFIX}/0", f"{PREFIX}/1"]), 20)
        watch = _watch(store.port, 2).start()
        time.sleep(10 * LIMIT)
        assert watch.alive and read_fault(store, generation=2, world_size=2, scope=SCOPE) is None
        os.kill(other.pid, signal.SIGSTOP)  # and still found once it stops
        assert _wait(lambda: not watch.alive, 30) and watch.declared == [1]
    finally:
        _end(other)
        own.stop(wait=5)


_RANK_0 = """
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from robustdist.health import watchdog_store as ws
from robustdist.recovery.liveness import LivenessWatch
prefix, scope, interval, limit = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
connect = lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
record = lambda closed: {"alive": time.time(), "beat_wall": time.time(), "seq": 1, "step": 1, "closed": closed}
ws.Heartbeat(connect, prefix + "/0", interval, record, rank=0, stale_after=3 * interval).start()
LivenessWatch(connect, prefix=prefix, world_size=2, interval=interval, limit=limit, generation=2, scope=scope,
              fired=threading.Event()).start()
print(server.port, flush=True)
time.sleep(600)
"""


@pytest.mark.processes
def test_a_pause_of_rank_0_s_process_which_serves_the_store_blames_nobody():
    """Rank 0's process stopped for several bounds: the store it serves stopped with it, so no record could
    change meanwhile; once it runs again nobody is found faulty for that (records judged by their wall time, as
    at first, were all stale here, rank 0's own too). A rank stopped later still is. (Which the resumed server
    serves first, the writes queued during the stop or the watch's read, is not forced here: the watch also
    judges nobody across a pause of its own thread, for the order where the read comes first.)"""
    zero = subprocess.Popen([sys.executable, "-c", _RANK_0, PREFIX, SCOPE, str(INTERVAL), str(LIMIT)],
                            stdout=subprocess.PIPE, text=True)
    other = None
    try:
        assert zero.stdout is not None
        port = int(zero.stdout.readline())
        client = _connect(port)()
        other = _other_process(port, 1)
        assert _wait(lambda: client.check([f"{PREFIX}/0", f"{PREFIX}/1"]), 20)
        time.sleep(2 * LIMIT)
        os.kill(zero.pid, signal.SIGSTOP)
        time.sleep(6 * LIMIT)
        os.kill(zero.pid, signal.SIGCONT)
        time.sleep(6 * LIMIT)
        assert read_fault(client, generation=2, world_size=2, scope=SCOPE) is None
        os.kill(other.pid, signal.SIGSTOP)
        assert _wait(lambda: read_fault(client, generation=2, world_size=2, scope=SCOPE) is not None, 30)
        fault = read_fault(client, generation=2, world_size=2, scope=SCOPE)
        assert fault is not None and set(fault.why) == {1} and fault.why[1]["by"] == 0
    finally:
        if other is not None:
            _end(other)
        _end(zero)


@pytest.mark.processes
def test_a_stopped_rank_that_gave_its_decision_is_leaving_not_lost(store):
    own = _beat(store.port, 0)
    other = _other_process(store.port, 1)
    try:
        assert _wait(lambda: store.check([f"{PREFIX}/0", f"{PREFIX}/1"]), 20)
        store.set(f"{SCOPE}/2/decision/1", "done")  # it finished (its closed record may not get out)
        watch = _watch(store.port, 2).start()
        os.kill(other.pid, signal.SIGSTOP)
        time.sleep(6 * LIMIT)
        assert read_fault(store, generation=2, world_size=2, scope=SCOPE) is None and watch.declared == []
        watch.close()
    finally:
        _end(other)
        own.stop(wait=5)


def test_a_rank_that_closed_its_watchdog_is_leaving_not_lost(store):
    beats = [_beat(store.port, 0), _beat(store.port, 1)]
    try:
        assert _wait(lambda: store.check([f"{PREFIX}/0", f"{PREFIX}/1"]), 20)
        watch = _watch(store.port, 2).start()
        beats[1].stop(wait=5)  # rank 1 handles a fault of its own: its last record says closed
        assert json.loads(store.get(f"{PREFIX}/1"))["closed"] is True
        time.sleep(10 * LIMIT)
        assert watch.alive and read_fault(store, generation=2, world_size=2, scope=SCOPE) is None
        watch.close()
        assert not watch.alive
    finally:
        for beat in beats:
            beat.stop(wait=5)


def test_a_fault_already_seen_ends_the_watch_without_a_declaration(store):
    fired = threading.Event()
    beat = _beat(store.port, 0)
    try:
        watch = _watch(store.port, 2, fired).start()  # rank 1 never beats: it would be declared after 0.6 s
        fired.set()
        assert _wait(lambda: not watch.alive, 10)
        time.sleep(2 * LIMIT)
        assert read_fault(store, generation=2, world_size=2, scope=SCOPE) is None and watch.declared == []
    finally:
        beat.stop(wait=5)


def test_only_rank_0_of_a_job_with_heartbeats_watches(store):
    class Dog:
        heartbeats = (PREFIX, INTERVAL, LIMIT)
        hang_timeout = 3.0

    fired = threading.Event()
    kw = {"scope": SCOPE, "generation": 0, "world_size": 2, "fired": fired}
    watch = liveness.start_for(Dog(), store, rank=0, **kw)
    assert watch is not None and watch.alive and (watch.prefix, watch.limit) == (PREFIX, 1.5)
    liveness.close(watch)
    assert not watch.alive
    assert liveness.start_for(Dog(), None, rank=1, **kw) is None
    assert liveness.start_for(None, None, rank=0, **kw) is None
    Dog.heartbeats = None  # type: ignore[assignment]
    assert liveness.start_for(Dog(), None, rank=0, **kw) is None
    assert liveness.start_for(Dog(), None, rank=0, **{**kw, "world_size": 1}) is None


def test_a_rank_found_faulty_reads_the_fault_as_another_rank_s_and_its_own_declaration_is_kept():
    """Rank 1 found faulty by rank 0 (``by``): for rank 1 it is not its own fault (it did not raise; a collective
    cut by it then is a consequence). A rank that declared a fault itself is left as it said."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    declare_found(server, generation=5, found={1: ("node 1", "HeartbeatsStopped: x")}, by=0, world_size=2, scope=SCOPE)
    fault = read_fault(server, generation=5, world_size=2, scope=SCOPE)
    assert fault is not None and fault.count == 1 and fault.others(1) == {1} and fault.others(0) == {1}
    assert fault.why[1]["by"] == 0 and fault.why[1]["node"] == "node 1"
    declare_fault(server, generation=6, rank=1, world_size=2, what="ValueError: mine", scope=SCOPE)
    assert declare_found(server, generation=6, found={1: ("n", "HeartbeatsStopped: y")}, by=0, world_size=2,
                         scope=SCOPE) == 0
    fault = read_fault(server, generation=6, world_size=2, scope=SCOPE)
    assert fault is not None and fault.count == 1 and fault.why[1]["what"] == "ValueError: mine"
    assert fault.others(1) == set() and fault.others(0) == {1}
    # hostile: a "by" that is not a rank number is not another rank
    server.set(f"{SCOPE}/7/why/1", json.dumps({"what": "x", "by": "0"}))
    server.add(f"{SCOPE}/7/fault", 1)
    assert read_fault(server, generation=7, world_size=2, scope=SCOPE).others(1) == set()


@pytest.mark.parametrize("raw", ['{"alive": 1' + "0" * 400 + ', "beat_wall": 1, "seq": 1}',
                                 "[" * 100_000 + "]" * 100_000, '{"alive": NaN, "beat_wall": 1, "seq": 1}'],
                         ids=["int-too-large-for-a-float", "nested-too-deep", "nan"])
def test_a_hostile_heartbeat_record_is_not_a_record_and_never_raises(raw):
    assert ws.parse_record(raw) is None


def test_the_bound_is_three_intervals_and_at_least_half_the_hang_timeout_up_to_30_s():
    assert liveness.bound(0.75, 2.25, 3.0) == 2.25  # hang_timeout 3 s: the stale age
    assert liveness.bound(5.0, 15.0, 40.0) == 20.0
    assert liveness.bound(5.0, 15.0, 600.0) == 30.0  # the default hang_timeout


def test_a_store_that_cannot_be_read_is_said_once_with_the_fix_and_nothing_is_declared(caplog):
    def refused() -> Any:
        raise ConnectionError("connection refused")

    watch = liveness.LivenessWatch(refused, prefix=PREFIX, world_size=2, interval=INTERVAL, limit=LIMIT, generation=2,
                                   scope=SCOPE, fired=threading.Event())
    with caplog.at_level("WARNING", logger="robustdist"):
        watch.start()
        assert _wait(lambda: "could not read the heartbeats of generation 2" in caplog.text, 20)
        time.sleep(4 * LIMIT)
    watch.close()
    assert caplog.text.count("could not read the heartbeats") == 1 and watch.declared == []
    assert "rank 0: could not read" in caplog.text and "ConnectionError: connection refused" in caplog.text
    assert "expected a read every 0.25 s" in caplog.text and "Fix: check the job's store" in caplog.text


def test_a_record_that_turns_unreadable_is_not_judged_and_the_watch_goes_on(store):
    """The store's content is input: a record seen once, then overwritten with something that is not a record, is
    neither a lost rank nor an error in the watch's thread."""
    beat = _beat(store.port, 0)
    try:
        watch = _watch(store.port, 2).start()
        end = time.monotonic() + 4 * watch.poll
        while time.monotonic() < end:  # rank 1 alive, seen by the watch
            store.set(f"{PREFIX}/1", json.dumps(_record(False)))
            time.sleep(0.05)
        store.set(f"{PREFIX}/1", b"\x00not json")
        time.sleep(6 * LIMIT)
        assert watch.alive and read_fault(store, generation=2, world_size=2, scope=SCOPE) is None
        watch.close()
    finally:
        beat.stop(wait=5)


class _WritesRefused:
    """A store connection that reads, but whose every write fails (a store that broke between the read and the
    declaration)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("set", "add", "compare_set", "multi_set", "append", "delete_key"):
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise ConnectionError("the store refused the write")
            return refuse
        return getattr(self._inner, name)


def test_a_declaration_the_store_refuses_is_said_with_the_fix_and_nothing_is_recorded(store, caplog):
    own = _beat(store.port, 0)
    try:
        store.set(f"{PREFIX}/1", json.dumps(_record(False)))  # rank 1 wrote once, then stopped
        watch = liveness.LivenessWatch(lambda: _WritesRefused(_connect(store.port)()), prefix=PREFIX, world_size=2,
                                       interval=INTERVAL, limit=LIMIT, generation=2, scope=SCOPE,
                                       fired=threading.Event())
        with caplog.at_level("WARNING", logger="robustdist"):
            watch.start()
            assert _wait(lambda: not watch.alive, 30)
        watch.close()
        assert watch.declared == [] and read_fault(store, generation=2, world_size=2, scope=SCOPE) is None
        assert caplog.text.count("could not declare") == 1, caplog.text
        assert ("rank 0: could not declare rank(s) [1] faulty (their heartbeats stopped): ConnectionError: the store "
                "refused the write; expected the job's store to take the declaration. The hang verdict or the fault "
                "watch's lost store ends the wait instead. Fix: check the job's store") in caplog.text, caplog.text
    finally:
        own.stop(wait=5)
