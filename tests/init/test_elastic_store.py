"""The per-attempt store under torchrun restarts: when it is used, and that a stale address is outlived.
(The real restart, a SIGKILLed rank under torchrun --max-restarts=1, runs in test_harden's demo test.)"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from robustdist.init import elastic_store as _elastic_store
from robustdist.runtime.errors import InitError
from robustdist.testing.ranks import free_port


@pytest.mark.parametrize(("env", "method", "expected"), [
    ({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, "env://", True),
    ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}, "env://", False),
    ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"}, "env://", False),
    ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}, "tcp://h:1", False),
    ({"TORCHELASTIC_MAX_RESTARTS": "x", "TORCHELASTIC_USE_AGENT_STORE": "True"}, "env://", False),
    ({}, "env://", False),
])
def test_used_only_when_torchrun_can_restart_with_its_shared_store(env, method, expected):
    assert _elastic_store.needed(env, method) is expected


def test_a_stale_address_from_the_last_attempt_is_retried_until_rank_zero_publishes():
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    dead = free_port()  # nothing listens there: the previous attempt's rank 0 is gone
    agent.set(_elastic_store._KEY, json.dumps({"addr": "127.0.0.1", "port": dead, "token": "old"}))
    got = {}

    def rank_one():
        got["store"] = _elastic_store.attempt_store("127.0.0.1", port, 1, 2, 30)

    thread = threading.Thread(target=rank_one)
    thread.start()
    threading.Event().wait(1.0)  # rank 1 is now retrying the dead address
    server = _elastic_store.attempt_store("127.0.0.1", port, 0, 2, 30)
    thread.join(30)
    assert not thread.is_alive()
    got["store"].set("hello", "from rank 1")
    assert server.get("hello") == b"from rank 1"


def test_rank_zero_never_publishing_is_a_bounded_init_error():
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    agent.set(_elastic_store._KEY, json.dumps({"addr": "127.0.0.1", "port": free_port(), "token": "old"}))
    with pytest.raises(InitError, match=r"could not reach rank 0's store for this torchrun attempt within 2 s.*Fix"):
        _elastic_store.attempt_store("127.0.0.1", port, 1, 2, 2)


@pytest.mark.parametrize("published", [
    b"[" * 100_000,  # nesting too deep to parse
    b"\xff\xfe not UTF-8",
    json.dumps({"addr": "127.0.0.1", "port": 10**30, "token": "0" * 32}).encode(),
    json.dumps({"addr": "127.0.0.1; rm -rf /", "port": 1, "token": "0" * 32}).encode(),
    json.dumps({"addr": "127.0.0.1", "port": True, "token": "0" * 32}).encode(),
    json.dumps(["127.0.0.1", 1]).encode(),
])
def test_a_garbled_published_address_is_refused_and_named_at_the_deadline(published):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    agent.set(_elastic_store._KEY, published)
    with pytest.raises(InitError) as caught:
        _elastic_store.attempt_store("127.0.0.1", port, 1, 2, 4)  # 4 s: a loaded machine first reads it late
    assert f"the address published under {_elastic_store._KEY!r} is not the JSON rank 0 writes there (another job " \
           "on this port, or a garbled value)" in str(caught.value)
    assert "could not reach rank 0's store for this torchrun attempt within 4 s" in str(caught.value)


def test_rank_zero_refuses_at_once_an_address_the_others_would_refuse_to_dial():
    with pytest.raises(InitError, match=r"\[rank 0\] MASTER_ADDR='m\xfcnchen-01' is not an address robustdist can "
                                        r"publish .* Fix: set MASTER_ADDR"):
        _elastic_store.attempt_store("m\xfcnchen-01", free_port(), 0, 2, 30)


def test_a_second_group_in_one_process_waits_for_its_own_store_not_the_kept_one():
    """A process that makes a second group (a re-init) while a kept model still holds the first one's store
    open: rank 1 must not take the first round's record, whose store still answers with the right token."""
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    first = _elastic_store.attempt_store("127.0.0.1", port, 0, 2, 30)  # round 1's, still open
    got = {}

    def rank_one():
        got["store"] = _elastic_store.attempt_store("127.0.0.1", port, 1, 2, 30, generation=2)

    thread = threading.Thread(target=rank_one)
    thread.start()
    threading.Event().wait(1.0)
    assert thread.is_alive() and "store" not in got  # waiting for round 2's record
    second = _elastic_store.attempt_store("127.0.0.1", port, 0, 2, 30, generation=2)
    thread.join(30)
    assert not thread.is_alive()
    got["store"].set("hello", "from rank 1")
    assert second.get("hello") == b"from rank 1" and not first.check(["hello"])
    del agent
