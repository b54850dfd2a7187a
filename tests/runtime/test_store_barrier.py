"""``robustdist.runtime.store_barrier``: the one barrier over a job's store (the rendezvous and the bounded
collectives stand on it, each naming the ranks it returns) and the poll under every other store wait. Real
``TCPStore`` servers and clients, threads as ranks."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from robustdist.runtime.store_barrier import Absent, absent_ranks, barrier, wait_for


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def _ranks(server, world, prefix, deadline_s, skip=(), **kw):
    """Every rank but ``skip`` in the barrier on a thread of its own, each with its own client; their outcomes."""
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            barrier(_client(server), prefix, r, world, time.monotonic() + deadline_s, **kw)
            out[r] = "ok"
        except Absent as e:
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world) if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_arrives_and_every_rank_passes(store):
    assert _ranks(store, 4, "b/1", 10) == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}
    assert store.get("b/1/2") == b"1" and not store.check(["b/1/abandoned"])
    assert store.add("b/1/count", 0) == 4  # polled through the count: one small request per look


def test_an_absent_rank_is_named_on_every_rank_that_came_and_the_mark_says_who(store):
    start = time.monotonic()
    out = _ranks(store, 3, "b/2", 0.5, skip=(2,))
    assert time.monotonic() - start < 10
    assert set(out) == {0, 1} and all(isinstance(e, Absent) and e.absent == (2,) for e in out.values()), out
    assert json.loads(store.get("b/2/abandoned")) == [2]


def test_a_rank_that_comes_after_the_others_gave_up_learns_it_is_the_one_named(store):
    store.set("b/3/0", "1")
    store.set("b/3/abandoned", json.dumps([1]))
    with pytest.raises(Absent) as info:
        barrier(_client(store), "b/3", 1, 2, time.monotonic() + 5)
    assert info.value.when == "before" and info.value.absent == (1,) and info.value.garbled is None
    assert not store.check(["b/3/1"])  # it never arrived: its key was not set


def test_a_mark_set_just_before_the_last_arrival_fails_every_rank_alike(store):
    store.set("b/4/0", "1")
    store.set("b/4/abandoned", json.dumps([]))  # every key there, but a rank gave up: nobody passes
    with pytest.raises(Absent) as info:
        barrier(_client(store), "b/4", 0, 1, time.monotonic() + 5)
    assert info.value.when == "before"

    class Racing:  # rank 0 gives up in the moment between rank 1's arrival and its first look
        def __init__(self, client):
            self.client = client

        def set(self, key, value):
            self.client.set(key, value)
            if key == "b/5/1":
                self.client.set("b/5/0", "1")
                self.client.add("b/5/count", 1)
                self.client.set("b/5/abandoned", "[1]")

        def add(self, key, value):
            return self.client.add(key, value)

        def check(self, keys):
            return self.client.check(keys)

        def get(self, key):
            return self.client.get(key)

    with pytest.raises(Absent) as info:
        barrier(Racing(_client(store)), "b/5", 1, 2, time.monotonic() + 5)
    assert info.value.when == "after" and info.value.absent == (1,)


@pytest.mark.parametrize("raw", ['"1"', "1", '{"1": 1}', "[[1]]", "[true]", "[1, 1]", "[2]", "[-1]", "[" * 5000,
                                 "not json", "[" + "0," * 100 + "0]"])
def test_a_hostile_mark_is_reported_garbled_with_this_rank_s_own_look(store, raw):
    store.set("b/6/0", "1")
    store.set("b/6/abandoned", raw)
    with pytest.raises(Absent) as info:
        barrier(_client(store), "b/6", 0, 2, time.monotonic() + 5)
    assert info.value.garbled == raw.encode() and info.value.absent == (1,)
    assert absent_ranks(raw.encode(), 2) is None


def test_the_interrupt_ends_the_wait_with_its_own_error(store):
    class Stop(Exception):
        pass

    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise Stop("recovering")

    client = _client(store)
    start = time.monotonic()
    with pytest.raises(Stop):
        barrier(client, "b/7", 0, 2, time.monotonic() + 30, interrupt=interrupt)
    assert len(calls) == 3 and time.monotonic() - start < 20  # long before the deadline, on a loaded machine too


def test_the_rank_that_gives_up_lingers_so_the_others_read_why(store):
    start = time.monotonic()
    with pytest.raises(Absent):
        barrier(_client(store), "b/8", 0, 2, time.monotonic() + 0.2, linger=0.6)
    assert time.monotonic() - start >= 0.75


def test_wait_for_keys_by_a_deadline_or_a_stop(store):
    client = _client(store)
    threading.Timer(0.3, lambda: store.set("w/a", "1")).start()
    assert wait_for(client, ["w/a"], time.monotonic() + 10)
    start = time.monotonic()
    assert not wait_for(client, ["w/b"], start + 0.3) and 0.25 < time.monotonic() - start < 3
    start = time.monotonic()
    assert not wait_for(client, ["w/b"], start + 30, stop=lambda: True) and time.monotonic() - start < 3
