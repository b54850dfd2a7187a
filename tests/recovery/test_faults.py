"""A fault on one rank becomes a generation change every live rank sees (robustdist.recovery.faults), and the
rank blocked in a gloo collective gets out of it (with robustdist.runtime.group_sockets): real ranks, a real
TCPStore, a real gloo group."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from robustdist.recovery.faults import FaultWatch, clear_generation, declare_fault, read_fault
from robustdist.runtime import dist as rdist
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.group_sockets import GroupSockets
from robustdist.runtime.job_store import connector
from robustdist.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(300)


def _store(rank: int, world: int) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                         timeout=timedelta(seconds=60))


def _two_generations(rank: int, world: int) -> list[tuple[int, str, float]]:
    """Generation 0: rank 1 faults; generation 1: rank 0 and rank 2 fault at once. Every rank's watch sees each
    fault; each reports (generation, who, seconds from the declaration to its callback)."""
    store = _store(rank, world)
    out = []
    for gen, faulty in ((0, {1}), (1, {0, world - 1})):
        seen = threading.Event()
        watch = FaultWatch(connector(store, 30), store, generation=gen, world_size=world, rank=rank,
                           on_fault=lambda g: seen.set()).start()
        store.set(f"armed/{gen}/{rank}", "1")
        store.wait([f"armed/{gen}/{r}" for r in range(world)], timedelta(seconds=60))
        if rank in faulty:
            declare_fault(store, generation=gen, rank=rank, world_size=world, what=f"ValueError: boom on rank {rank}")
        assert seen.wait(30), f"rank {rank} did not see generation {gen}'s fault"
        deadline = time.monotonic() + 30
        while watch.alive and time.monotonic() < deadline:  # it reads the reasons after the callback, then ends
            time.sleep(0.01)
        watch.close()
        assert not watch.alive and watch.fault is not None and watch.fault.generation == gen
        # the reasons of every rank that faulted, once all of them declared (a watch may fire after the first)
        deadline = time.monotonic() + 30
        while (full := read_fault(store, generation=gen, world_size=world)) is None or full.count < len(faulty):
            assert time.monotonic() < deadline, full
            time.sleep(0.02)
        assert full.count == len(faulty) and set(full.why) == faulty, full
        out.append((gen, full.describe(), watch.seen_at - min(w["wall"] for w in full.why.values())))
        store.set(f"done/{gen}/{rank}", "1")
        store.wait([f"done/{gen}/{r}" for r in range(world)], timedelta(seconds=60))
        if rank == 0 and gen == 0:
            clear_generation(store, generation=0, world_size=world)
            assert read_fault(store, generation=0, world_size=world) is None
    store.set(f"left/{rank}", "1")
    if rank == 0:  # the store's server lives in this process: it leaves last
        store.wait([f"left/{r}" for r in range(world)], timedelta(seconds=60))
    return out


@pytest.mark.processes
def test_one_ranks_fault_is_seen_by_every_rank_in_its_generation_only():
    world = 3
    results = run_ranks(_two_generations, world, args=(world,), init=False, timeout=120)
    for rank, out in enumerate(results):
        (g0, why0, _), (g1, why1, _) = out
        assert (g0, g1) == (0, 1)
        assert why0.startswith("generation 0: rank 1 (") and "ValueError: boom on rank 1" in why0
        assert "rank 0 (" in why1 and "rank 2 (" in why1 and "rank 1 (" not in why1  # no mixing of generations
    # every rank's watch saw it soon after the first declaration (one machine: one clock). Under 0.5 s is the
    # target (#34), for the benchmark to measure; a loaded machine is allowed 5 s here
    delays = [d for out in results for _, _, d in out]
    assert len(delays) == 2 * world and max(delays) < 5.0, delays


def _blocked_then_freed(rank: int) -> tuple[str, float, str]:
    """Rank 1 raises outside any collective and declares it; rank 0 is in an all_reduce: its watch's callback
    shuts the group's connections, and the all_reduce fails at once instead of at the group's 120 s timeout."""
    store = _store(rank, 2)
    sockets = GroupSockets(exclude_ports=[store.port])
    with sockets.recording():
        dist.init_process_group("gloo", store=dist.PrefixStore("g", store), rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(1))
    seen: list[int] = []

    def on_fault(generation: int) -> None:
        seen.append(generation)
        sockets.unblock()

    group_store = dist.PrefixStore("default_pg", store)  # what the default group's store is: the keys go under it
    watch = FaultWatch(connector(group_store, 30), group_store, generation=0, world_size=2, rank=rank,
                       on_fault=on_fault).start()
    start = time.monotonic()
    if rank == 1:
        try:
            time.sleep(0.3)
            raise ValueError("boom at step 7")
        except ValueError as e:
            declare_fault(group_store, generation=0, rank=1, world_size=2, what=f"{type(e).__name__}: {e}")
        outcome = "declared"
    else:
        try:
            dist.all_reduce(torch.ones(1))
            outcome = "returned"
        except RuntimeError:
            outcome = "unblocked"
    elapsed = time.monotonic() - start
    deadline = time.monotonic() + 30
    while watch.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.close()
    dist.destroy_process_group()
    return outcome, elapsed, watch.fault.describe() if seen and watch.fault else ""


@pytest.mark.processes
def test_a_rank_blocked_in_a_collective_is_freed_by_anothers_fault():
    (outcome0, elapsed0, why0), (outcome1, _, why1) = run_ranks(_blocked_then_freed, 2, init=False, timeout=120)
    assert (outcome0, outcome1) == ("unblocked", "declared")
    assert elapsed0 < 30, elapsed0  # the fault (0.3 s in) ended it, not the group's 120 s timeout
    assert why0 == why1 and "rank 1 (" in why0 and "ValueError: boom at step 7" in why0


class _DeadStore:
    """A store whose every call fails, as one whose server went away."""

    def wait(self, *_: object) -> None:
        raise RuntimeError("Connection reset by peer")

    check = add = get = set = wait


def test_a_watch_on_a_lost_store_calls_it_a_fault_after_lost_after():
    connects, called = [], []

    def connect() -> _DeadStore:
        connects.append(1)
        return _DeadStore()

    watch = FaultWatch(connect, _DeadStore(), generation=4, world_size=2, rank=0, on_fault=called.append,
                       lost_after=0.5, retry_s=0.05).start()
    deadline = time.monotonic() + 10
    while watch.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not watch.alive and watch.lost and called == [4] and len(connects) >= 2


class _BlockingStore:
    """A store whose wait returns only when the test says (a fault arriving while close() runs)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def wait(self, *_: object) -> None:
        self.release.wait(10)

    def check(self, *_: object) -> bool:
        return True  # the wake key and the fault key both exist

    def set(self, *_: object) -> None:
        pass


def test_no_callback_after_close_returns():
    store, called = _BlockingStore(), []
    watch = FaultWatch(lambda: store, store, generation=0, world_size=2, rank=0, on_fault=called.append).start()
    time.sleep(0.2)  # the thread is in its wait
    watch.close(join_timeout=0.1)  # returns while the thread still waits (it is abandoned)
    store.release.set()  # ... and a fault comes: too late
    watch._thread.join(5)
    assert called == [] and not watch.alive


def test_hostile_store_content_is_read_as_unreadable_and_the_store_still_works():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    gen = 9
    store.set(f"robustdist/recovery/{gen}/fault", "x")  # not a number: an add on it would break the connection
    store.set(f"robustdist/recovery/{gen}/why/0", "[1, 2]")
    store.set(f"robustdist/recovery/{gen}/why/1", "[" * 100_000)
    store.set(f"robustdist/recovery/{gen}/why/2", "{" + '"what": "x", ' * 2000 + '"a": 1}')
    store.set(f"robustdist/recovery/{gen}/why/3", b"\xff\xfe")
    fault = read_fault(store, generation=gen, world_size=4)
    assert fault is not None and fault.count == 0
    assert [fault.why[r]["what"].startswith("(unreadable reason") for r in range(4)] == [True] * 4
    assert fault.describe().startswith("generation 9: rank 0 (?): (unreadable reason")
    store.set("after", "1")
    assert store.get("after") == b"1"  # the connection survived


def _interrupted_arrival(rank: int) -> tuple[str, float, bool]:
    """Rank 0 waits in an arrival check that rank 1 never joins (arrival timeout 120 s); another thread of rank 0
    interrupts the waits, as a fault callback does. Then, with waits resumed, new objects work on both ranks."""
    from robustdist.runtime import dist as rdist
    from robustdist.runtime.errors import CheckpointError

    store = rdist.default_store()
    first = rdist.Collectives(None, rank, 2, timeout=60, arrival_timeout=120, error=CheckpointError, token="t1")
    message, elapsed = "", 0.0
    if rank == 0:
        timer = threading.Timer(0.5, rdist.interrupt_waits, args=("rank 1 faulted at step 7",))
        start = time.monotonic()  # before the timer starts: it fires no sooner than 0.5 s after this
        timer.start()
        try:
            first.arrive("save")
        except CheckpointError as e:
            message, elapsed = str(e), time.monotonic() - start
        timer.join()
        rdist.resume_waits()
        store.set("resumed", "1")
    else:
        store.wait(["resumed"], timedelta(seconds=60))
    second = rdist.Collectives(None, rank, 2, timeout=60, arrival_timeout=60, error=CheckpointError, token="t2")
    second.arrive("save")
    return message, elapsed, first.broken is not None


@pytest.mark.processes
def test_an_arrival_wait_is_interrupted_at_once_and_new_objects_work_after():
    (message, elapsed, broken), _ = run_ranks(_interrupted_arrival, 2, timeout=120)
    assert message.startswith("[rank 0] save() was interrupted while this rank waited for the others: rank 1 "
                              "faulted at step 7."), message
    assert 0.5 <= elapsed < 30 and broken  # not the 120 s arrival timeout; the object is done with


def test_a_wake_key_left_by_an_earlier_watch_is_dropped_not_spun_on():
    """A store that outlived an earlier watch of the same generation number keeps its wake key: the new watch
    drops it (no busy loop on a key that exists), and still sees the next fault."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set("robustdist/recovery/0/wake/0", "closed")  # left by an earlier watch's close()
    called: list[int] = []
    watch = FaultWatch(connector(store, 30), store, generation=0, world_size=1, rank=0,
                       on_fault=called.append).start()
    deadline = time.monotonic() + 10
    while store.check(["robustdist/recovery/0/wake/0"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.check(["robustdist/recovery/0/wake/0"]) and watch.alive and called == []
    declare_fault(store, generation=0, rank=0, world_size=1, what="ValueError: later")
    while watch.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    assert called == [0] and watch.fault is not None and watch.fault.count == 1


def test_a_wait_nothing_can_cut_is_refused_once_interrupted_and_named_to_the_interrupt_while_it_runs():
    rdist.resume_waits()
    try:
        with rdist.uncuttable("ray.train.report", CheckpointError):
            assert rdist.interrupt_waits("rank 1 faulted") == "ray.train.report"  # named, with the interrupt
        assert rdist.interrupt_waits("again") is None  # left: nothing named
        with pytest.raises(CheckpointError, match=r"ray.train.report was not started: again\. Expected when the job "
                                                  r"recovers in place"):
            with rdist.uncuttable("ray.train.report", CheckpointError):
                pytest.fail("entered a wait nothing can cut after the interrupt")
    finally:
        rdist.resume_waits()


def test_a_rank_in_a_wait_nothing_can_cut_escalates_for_itself_when_a_fault_comes(caplog):
    """The fault watch's callback writes this rank's decision ("escalate", saying why) where the other ranks'
    ``agree`` reads it, so they do not wait out their bound for a rank that cannot join; outside such a wait it
    decides nothing."""
    from robustdist.recovery.generations import Generation
    from robustdist.recovery.faults import agree

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    rdist.resume_waits()
    try:
        quiet = Generation("t", 3)
        quiet._store, quiet.rank = store, 1
        quiet.on_fault(3)
        assert not store.check(["t/3/decision/1"]) and quiet.fired.is_set()
        rdist.resume_waits()
        g = Generation("t", 4)
        g._store, g.rank = store, 1
        with rdist.uncuttable("ray.train.report", CheckpointError), caplog.at_level("ERROR"):
            g.on_fault(4)
        assert store.get("t/4/decision/1") == b"escalate (waiting in ray.train.report)"
        assert "rank 1: a rank faulted in in-process recovery generation 4 while this rank waits in " \
               "ray.train.report, which robustdist cannot interrupt; expected" in caplog.text
        decisions, verdict = agree(store, "t", 4, 0, 2, "recover", timeout=30)  # rank 0 reads it at once
        assert decisions == ["recover", "escalate (waiting in ray.train.report)"] and verdict == "escalate"
    finally:
        rdist.resume_waits()


class _SilentStore:
    """A store that never answers (a server that accepted the connection and went quiet)."""

    def __init__(self) -> None:
        self.asked = threading.Event()

    def check(self, *_: object) -> bool:
        self.asked.set()
        time.sleep(30)
        return False


def test_a_cut_collective_reads_another_ranks_declared_fault_and_says_so_when_the_store_is_silent(
        caplog, monkeypatch):
    from robustdist.recovery import declarations

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    assert declarations.declared_fault(store, 3, 0, 2, "robustdist/recovery") is None  # nothing declared yet
    declare_fault(store, generation=3, rank=1, world_size=2, what="RuntimeError: boom", scope="robustdist/recovery")
    fault = declarations.declared_fault(store, 3, 0, 2, "robustdist/recovery")
    assert fault is not None and fault.others(0) and "RuntimeError: boom" in fault.describe()
    assert declarations.declared_fault(store, 3, 1, 2, "robustdist/recovery") is None  # rank 1's own: not another's

    monkeypatch.setattr(declarations, "READ_FAULT_S", 0.3)
    t = time.monotonic()
    with caplog.at_level("WARNING", logger="robustdist.recovery.declarations"):
        silent = _SilentStore()
        assert declarations.declared_fault(silent, 3, 0, 2, "robustdist/recovery") is None
    assert silent.asked.is_set() and 0.3 <= time.monotonic() - t < 5
    assert ("rank 0: its collective was cut, and the store did not say within 0.3 s whether another rank declared "
            "generation 3's fault") in caplog.text and "taking the cut for this rank's own fault" in caplog.text
