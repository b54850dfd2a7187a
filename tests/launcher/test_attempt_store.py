"""Each attempt's store served by ``robustdist run``'s agent on node 0 (a killed rank 0 replaced alone):
the agents' side (:class:`robustdist.launcher.attempt_store.AttemptStore`, against real TCPStores standing for the
round's rendezvous store) and the workers' (:func:`robustdist.init.elastic_store.served_by_agent` and the client it
makes), with the hostile environments a worker may be given."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from robustdist.init import elastic_store
from robustdist.launcher.attempt_store import AttemptStore
from robustdist.runtime.errors import InitError
from robustdist.runtime.replacing import ATTEMPT_STORE_ENV, ATTEMPT_STORE_KEY, ATTEMPT_TOKEN_KEY, RUN_ENV


class _Handler:
    def __init__(self, backend: str = "c10d", shared: bool = True) -> None:
        self.backend, self.use_agent_store = backend, shared

    def get_backend(self) -> str:
        return self.backend

    def get_run_id(self) -> str:
        return "job"


@pytest.fixture
def rounds(monkeypatch):
    """torchrun's agent store (a TCPStore server), its round-0 view (as torch's c10d rendezvous prefixes it), and the
    environment variables the test may change, restored afterwards."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=15), wait_for_workers=False)
    monkeypatch.setenv(ATTEMPT_STORE_ENV, "stale")  # restored (removed) after the test, whatever start() did
    monkeypatch.setenv(RUN_ENV, "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setattr(elastic_store, "_counted", {})
    return store


def _group(store, rank: int, round_: int = 0, *, handler=None, max_restarts: int = 1):
    spec = SimpleNamespace(rdzv_handler=handler or _Handler(), max_restarts=max_restarts, local_addr="127.0.0.1")
    return SimpleNamespace(spec=spec, store=dist.PrefixStore(f"torch.rendezvous.job.{round_}", store),
                           group_rank=rank, master_addr="127.0.0.1", master_port=store.port)


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError:
        return True


def test_node_0_serves_a_fresh_store_per_attempt_and_every_agent_hands_it_on(rounds):
    node0, node1 = AttemptStore(), AttemptStore(wait_s=10)
    assert node0.start(_group(rounds, 0)) and node0.serves
    served = json.loads(os.environ[ATTEMPT_STORE_ENV])
    assert served["addr"] == "127.0.0.1" and len(served["token"]) == 32
    assert (served["master"], served["run"]) == (f"127.0.0.1:{rounds.port}", "job")  # the job it is for
    assert elastic_store.served_by_agent(0) == served
    client = dist.TCPStore("127.0.0.1", served["port"], is_master=False, timeout=timedelta(seconds=15))
    assert client.get(ATTEMPT_TOKEN_KEY).decode() == served["token"]
    del client
    os.environ[ATTEMPT_STORE_ENV] = "stale"
    assert node1.start(_group(rounds, 1)) and not node1.serves  # another node's agent: reads it in the round's keys
    assert json.loads(os.environ[ATTEMPT_STORE_ENV]) == served
    assert node0.start(_group(rounds, 0, round_=1))  # the next attempt: a new store, the old one closed
    again = json.loads(os.environ[ATTEMPT_STORE_ENV])
    assert again["token"] != served["token"]
    assert _refused(served["port"]) or served["port"] == again["port"]
    node0.close()
    assert _refused(again["port"]) and not node0.serves


@pytest.mark.parametrize("handler, max_restarts", [(_Handler("static"), 1), (_Handler(shared=False), 1),
                                                   (_Handler(), 0), (object(), 1)])
def test_where_torchrun_shares_no_store_or_restarts_nothing_rank_0_serves(rounds, handler, max_restarts):
    agent = AttemptStore()
    assert not agent.start(_group(rounds, 0, handler=handler, max_restarts=max_restarts))
    assert ATTEMPT_STORE_ENV not in os.environ and not agent.serves  # nor an earlier attempt's value


def test_an_agent_that_finds_no_address_or_a_refusal_falls_back(rounds, caplog):
    assert not AttemptStore(wait_s=0.3).start(_group(rounds, 1))  # node 0's agent never published
    assert ATTEMPT_STORE_ENV not in os.environ
    assert "no agent-served store for this attempt" in caplog.text
    for round_, value in enumerate([json.dumps({"none": "could not serve on n0"}), "5", "{oops",
                                    json.dumps({"addr": "a b", "port": 1, "token": "0" * 32})], start=1):
        _group(rounds, 1, round_=round_).store.set(ATTEMPT_STORE_KEY, value)  # node 0's word is input too
        assert not AttemptStore(wait_s=5).start(_group(rounds, 1, round_=round_))
        assert ATTEMPT_STORE_ENV not in os.environ
        assert f"node 0's agent serves no store for this attempt ({value}" in caplog.text


def test_node_0_with_an_address_workers_cannot_use_tells_the_others(rounds):
    group = _group(rounds, 0)
    group.spec.local_addr = "node 0; true"
    assert not AttemptStore().start(group)
    assert "is not a host name or IP address" in json.loads(group.store.get(ATTEMPT_STORE_KEY))["none"]
    group = _group(rounds, 0, round_=1)
    group.spec.local_addr = "localhost"  # names with underscores and dots are served (node_01.cluster would be)
    agent = AttemptStore()
    assert agent.start(group)
    agent.close()


def test_a_worker_without_the_address_joins_the_store_rank_0_uses(rounds, monkeypatch):
    """An agent that timed out on node 0's address gives its workers none: they look where rank 0 publishes its own
    store, and rank 0, served by the agent, publishes the agent's there."""
    server, info = _serve()
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps(info))
    first = elastic_store.attempt_store("127.0.0.1", rounds.port, 0, 2, 15.0)
    monkeypatch.delenv(ATTEMPT_STORE_ENV)
    other = elastic_store.attempt_store("127.0.0.1", rounds.port, 1, 2, 15.0)
    other.set("seen", "1")
    assert first.get("seen") == b"1" and server.get("seen") == b"1"


_OK = {"addr": "127.0.0.1", "port": 29500, "token": "a" * 32, "master": "127.0.0.1:1", "run": "job"}


@pytest.mark.parametrize("value", [
    "{oops", "[" * 5000, json.dumps([1]), json.dumps({**_OK, "port": 0}), json.dumps({**_OK, "port": 70000}),
    json.dumps({**_OK, "port": True}), json.dumps({**_OK, "port": "29500"}), json.dumps({**_OK, "addr": "h; rm -rf /"}),
    json.dumps({**_OK, "token": "zz" * 16}), json.dumps({**_OK, "pad": "x" * 2000}),
    json.dumps({k: v for k, v in _OK.items() if k != "run"}), json.dumps({**_OK, "master": 5})])
def test_a_hostile_attempt_store_variable_is_a_named_error(rounds, monkeypatch, value):
    monkeypatch.setenv(ATTEMPT_STORE_ENV, value)
    with pytest.raises(InitError) as caught:
        elastic_store.served_by_agent(1)
    assert str(caught.value).startswith(f"[rank 1] {ATTEMPT_STORE_ENV}=") and "Fix: unset it" in str(caught.value)
    monkeypatch.delenv(RUN_ENV)  # outside robustdist run the variable is not read at all
    assert elastic_store.served_by_agent(1) is None


@pytest.mark.parametrize("addr", ["node_01.cluster", "10.0.0.1", "fe80::1%eth0", "[::1]"])
def test_host_names_and_addresses_are_taken(rounds, monkeypatch, addr):
    mine = f"127.0.0.1:{rounds.port}"
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps({**_OK, "addr": addr, "master": mine}))
    assert elastic_store.served_by_agent(0)["addr"] == addr


def test_a_value_made_for_another_job_is_not_used(rounds, monkeypatch):
    """A torchrun started inside a worker inherits the variable: its ranks (another MASTER_PORT, another run id) make
    their own store as under torchrun, never the outer job's."""
    mine = f"127.0.0.1:{rounds.port}"
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps({**_OK, "master": mine}))
    assert elastic_store.served_by_agent(0) is not None
    monkeypatch.setenv("MASTER_PORT", "1")
    assert elastic_store.served_by_agent(0) is None
    monkeypatch.setenv("MASTER_PORT", str(rounds.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "inner")
    assert elastic_store.served_by_agent(0) is None


def test_an_attempt_number_that_is_not_a_count_is_a_named_error(rounds):
    for raw in ("x", "-1", "9" * 30, ""):
        rounds.set("robustdist/attempt", raw)
        with pytest.raises(InitError, match="as the attempt number; expected the count rank 0 writes"):
            elastic_store.attempt_of(rounds, 1)


def _serve(token: str = "b" * 32):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=15), wait_for_workers=False)
    server.set(ATTEMPT_TOKEN_KEY, token)
    return server, {"addr": "127.0.0.1", "port": server.port, "token": token, "master": os.environ["MASTER_ADDR"] + ":"
                    + os.environ["MASTER_PORT"], "run": "job"}


def test_rank_0_counts_the_attempt_once_and_a_replacement_of_it_finds_the_count(rounds, monkeypatch):
    server, info = _serve()
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps(info))
    rounds.add("robustdist/attempt_counter", 2)  # two attempts before this one
    store = elastic_store.attempt_store("127.0.0.1", rounds.port, 0, 2, 15.0)
    assert elastic_store.attempt_of(store) == 2
    monkeypatch.setattr(elastic_store, "_counted", {})  # a new process: a replacement of rank 0
    again = elastic_store.attempt_store("127.0.0.1", rounds.port, 0, 2, 15.0)
    assert elastic_store.attempt_of(again) == 2 and int(rounds.add("robustdist/attempt_counter", 0)) == 3
    other = elastic_store.attempt_store("127.0.0.1", rounds.port, 1, 2, 15.0)
    assert elastic_store.attempt_of(other) == 2


def test_another_store_on_the_port_and_no_store_at_all_are_named_errors(rounds, monkeypatch):
    server, info = _serve()
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps({**info, "token": "c" * 32}))
    with pytest.raises(InitError, match=r"is not this attempt's \(its token differs\)"):
        elastic_store.attempt_store("127.0.0.1", rounds.port, 1, 2, 15.0)
    port = info["port"]
    del server
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps({**info, "port": port}))
    start = time.monotonic()
    with pytest.raises(InitError, match="could not reach this attempt's store at 127.0.0.1:"):
        elastic_store.attempt_store("127.0.0.1", rounds.port, 1, 2, 1.5)
    assert time.monotonic() - start < 15  # bounded by the init timeout (and one connect's own bound)
    server, info = _serve()  # a store that is this attempt's, where rank 0 never counts: the wait is bounded too
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps(info))
    with pytest.raises(InitError, match="expected rank 0 to count the attempt there"):
        elastic_store.attempt_store("127.0.0.1", rounds.port, 1, 2, 8.0)  # a handshake may take 5 s here


_KEPT = {"outlives_rank0": True, "host": "127.0.0.1", "port": 29500}


@pytest.mark.parametrize("state, replaced", [(_KEPT, True), ({**_KEPT, "outlives_rank0": False}, False),
                                             ({**_KEPT, "outlives_rank0": "yes"}, False),
                                             ({**_KEPT, "port": 29501}, False),  # an earlier attempt's store
                                             ("x" * 9000, False), (None, False)])
def test_rank_0_is_replaced_alone_only_where_its_state_says_its_store_outlives_it(rounds, monkeypatch, state,
                                                                                    replaced):
    from robustdist.launcher.agent import Replacer
    from robustdist.runtime.replacing import STATE_KEY

    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps(_OK))  # what this agent serves now
    if state is not None:
        rounds.set(STATE_KEY, state if isinstance(state, str) else json.dumps(state))
    group = SimpleNamespace(master_addr="127.0.0.1", master_port=rounds.port)
    replacer = Replacer(spares=0)
    try:
        assert replacer._outlives_rank0(group) is replaced
    finally:
        replacer.close()
