"""robustdist.init.reach on one host: the message builder, the socket helpers, check_peers between two real ranks
(each pretending to be a node of its own), and the doctor's per-interface check with the sockets faked.

The real two-interface case, across network namespaces, is in tests/multinode/test_interfaces.py."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from robustdist import doctor
from robustdist.init import reach as _reach
from robustdist.init import reach_store
from robustdist.runtime.errors import InitError
from robustdist.testing.ranks import free_port, run_ranks


def _rep(rank, node_rank, bind, ifaces, *, how=None, default=None, group=None):
    """A representative's description, as check_peers publishes it."""
    return {"rank": rank, "node": f"n{node_rank}", "node_rank": node_rank, "group": group or f"g{rank}",
            "label": f"node {node_rank} (host h{node_rank}, {bind[1]})", "how": how or f"GLOO_SOCKET_IFNAME={bind[0]}",
            "binds": [{"if": bind[0], "addr": bind[1], "port": 1}], "default": default,
            "ifaces": [{"if": n, "addr": a, "port": 2} for n, a in ifaces]}


def _verdict(reps, results, members):
    return _reach.build_message(_reach.diagnose(reps, results), {r["rank"]: r for r in reps}, members)


# ---------------------------------------------------------------------------------------------- messages
def test_ranks_are_folded_into_ranges():
    assert _reach.ranks_phrase([3]) == "rank 3"
    assert _reach.ranks_phrase([9, 0, 1, 2, 3, 5]) == "ranks 0-3, 5, 9"


def test_bind_problem_names_the_interface_the_peers_and_the_interfaces_that_work():
    reps = [_rep(0, 0, ("eth0", "10.0.0.1"), [("eth0", "10.0.0.1")]),
            _rep(8, 1, ("eth1", "10.1.0.2"), [("eth0", "10.0.0.2"), ("eth1", "10.1.0.2"), ("ib0", "10.2.0.2")],
                 default="10.0.0.2"),
            _rep(16, 2, ("eth0", "10.0.0.3"), [("eth0", "10.0.0.3")])]
    results = {0: [{"target": 8, "addr": "10.1.0.2", "detail": "no answer to a TCP connect within 2 s",
                    "theirs": ["eth0", "ib0"], "mine": []}],
               8: [],
               16: [{"target": 8, "addr": "10.1.0.2", "detail": "connection refused", "theirs": ["eth0"], "mine": []}]}
    members = {"g0": list(range(8)), "g8": list(range(8, 16)), "g16": list(range(16, 24))}
    message, blamed = _verdict(reps, results, members)
    assert message == (
        "ranks 8-15 on node 1 (host h1, 10.1.0.2) bind gloo to GLOO_SOCKET_IFNAME=eth1 (10.1.0.2), which ranks 0-7 "
        "on node 0 (host h0, 10.0.0.1) and ranks 16-23 on node 2 (host h2, 10.0.0.3) cannot reach (no answer to a "
        "TCP connect within 2 s); interfaces on node 1 that reach them: eth0 (10.0.0.2). Fix: set "
        "GLOO_SOCKET_IFNAME=eth0 on node 1 (or unset it). (Checked before init_process_group, whose full-mesh "
        "connect would otherwise wait for the whole init timeout.)")
    assert blamed == list(range(8, 16))


def test_hostname_bind_with_several_working_interfaces():
    how = "its hostname's address, h1 -> 127.0.1.1 (GLOO_SOCKET_IFNAME is unset)"
    reps = [_rep(0, 0, ("eth0", "10.0.0.1"), [("eth0", "10.0.0.1")]),
            _rep(1, 1, (None, "127.0.1.1"), [("eth0", "10.0.0.2"), ("ib0", "10.2.0.2")], how=how)]
    results = {0: [{"target": 1, "addr": "127.0.1.1", "detail": "connection refused", "theirs": ["eth0", "ib0"],
                    "mine": []}], 1: []}
    message, blamed = _verdict(reps, results, {"g0": [0], "g1": [1]})
    assert message.startswith(f"rank 1 on node 1 (host h1, 127.0.1.1) binds gloo to {how}, which rank 0 on node 0 ")
    assert ("interfaces on node 1 that reach them: eth0 (10.0.0.2), ib0 (10.2.0.2). Fix: set GLOO_SOCKET_IFNAME to "
            "one of eth0, ib0 on node 1. (Checked") in message
    assert blamed == [1]


def test_route_cut_and_listen_problems_name_their_fix():
    reps = [_rep(0, 0, ("eth0", "10.0.0.1"), [("eth0", "10.0.0.1"), ("eth2", "10.9.0.1")]),
            _rep(1, 1, ("eth0", "10.0.0.2"), [("eth0", "10.0.0.2")]),
            {**_rep(2, 2, ("eth5", "10.5.0.3"), []), "error": "10.5.0.3: Cannot assign requested address"}]
    results = {0: [{"target": 1, "addr": "10.0.0.2", "detail": "connection refused", "theirs": [], "mine": ["eth2"]}],
               1: [{"target": 0, "addr": "10.0.0.1", "detail": "no route to host", "theirs": [], "mine": []}]}
    message, blamed = _verdict(reps, results, {"g0": [0], "g1": [1], "g2": [2]})
    listen, route, cut = message.split(" | ")
    assert listen.startswith("rank 2 on node 2 (host h2, 10.5.0.3) cannot listen on the address gloo would bind "
                             "(GLOO_SOCKET_IFNAME=eth5: 10.5.0.3: Cannot assign requested address)")
    assert route.startswith("rank 0 on node 0 (host h0, 10.0.0.1) cannot reach gloo's address 10.0.0.2 of rank 1 on ")
    assert "only from eth2 (10.9.0.1)" in route and route.endswith("Fix: correct the route to 10.0.0.2 on node 0 "
                                                                   "(`ip route get 10.0.0.2`)")
    assert cut.startswith("rank 1 on node 1 (host h1, 10.0.0.2) cannot reach rank 0 on node 0 (host h0, 10.0.0.1) "
                          "at gloo's address 10.0.0.1 (no route to host), nor at any other address of node 0, from "
                          "any of their interfaces: the nodes are partitioned or a firewall drops TCP")
    assert blamed == [0, 2]  # the route's prober, the unreachable target, the one that cannot listen


def test_a_partition_of_many_nodes_is_summed_up():
    reps = [_rep(r, r, ("eth0", f"10.0.0.{r + 1}"), []) for r in range(9)]
    cut = {"detail": "no answer to a TCP connect within 2 s", "theirs": [], "mine": []}
    results = {0: [{**cut, "target": r, "addr": f"10.0.0.{r + 1}"} for r in range(1, 9)],
               **{r: [{**cut, "target": 0, "addr": "10.0.0.1"}] for r in range(1, 9)}}
    message, blamed = _verdict(reps, results, {f"g{r}": [r] for r in range(9)})
    parts = message.split(" | ")
    assert len(parts) == 6 and parts[-1].startswith("and 4 more problems of the same kinds")
    assert parts[0].startswith("ranks 1-8 on 8 nodes (node 1 (host h1, 10.0.0.2), node 2 (host h2, 10.0.0.3), ...) "
                               "cannot reach rank 0 on node 0 (host h0, 10.0.0.1) at gloo's address 10.0.0.1 ")
    assert blamed == list(range(9))


def test_failures_past_the_diagnosed_few_come_last_and_say_so():
    reps = [_rep(0, 0, ("eth0", "10.0.0.1"), []), _rep(1, 1, ("eth0", "10.0.0.2"), [("eth9", "10.9.0.2")]),
            _rep(2, 2, ("eth0", "10.0.0.3"), [])]
    results = {0: [{"target": 2, "addr": "10.0.0.3", "detail": "connection refused", "theirs": [], "mine": [],
                    "diagnosed": False},
                   {"target": 1, "addr": "10.0.0.2", "detail": "connection refused", "theirs": ["eth9"], "mine": []}]}
    message, blamed = _verdict(reps, results, {"g0": [0], "g1": [1], "g2": [2]})
    bind, unreached = message.split(" | ")
    assert bind.startswith("rank 1 on node 1") and "Fix: set GLOO_SOCKET_IFNAME=eth9 on node 1" in bind
    assert unreached.startswith("rank 0 on node 0 (host h0, 10.0.0.1) cannot reach rank 2 on node 2 (host h2, "
                                "10.0.0.3) at gloo's address 10.0.0.3 (connection refused; not diagnosed: each rank "
                                "tries the other addresses of its first 16 failures only)")
    assert blamed == [1, 2]


def test_no_failure_no_problem():
    reps = [_rep(0, 0, ("eth0", "10.0.0.1"), []), _rep(1, 1, ("eth0", "10.0.0.2"), [])]
    assert _reach.diagnose(reps, {0: [], 1: []}) == []


# ---------------------------------------------------------------------------------------------- sockets
def test_listener_answers_its_token_and_a_stranger_is_told_apart():
    token = b"robustdist-reach test rank 0\n"
    listeners = _reach.Listeners(["127.0.0.1", "127.0.0.2", "10.213.0.250"], token)
    try:
        port = listeners.ports["127.0.0.1"]
        assert "10.213.0.250" in listeners.errors  # a lab address, never one of this host's
        assert _reach.probe(None, "127.0.0.1", port, token, 2.0) == (True, "connected")
        assert _reach.probe("127.0.0.3", "127.0.0.2", listeners.ports["127.0.0.2"], token, 2.0) == (True, "connected")
        ok, detail = _reach.probe(None, "127.0.0.1", port, b"robustdist-reach test rank 1\n", 2.0)
        assert not ok and detail.startswith("another process answered there")
    finally:
        listeners.close()
    assert _reach.probe(None, "127.0.0.1", port, token, 2.0) == (False, "connection refused")


def test_reaches_counts_a_refused_connection_as_a_route():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert _reach.reaches("127.0.0.1", "127.0.0.1", port, 2.0) == (True, "connected")
    ok, detail = _reach.reaches(None, "127.0.0.1", port, 2.0)
    assert ok and detail.startswith("refused")
    assert _reach.reaches("10.213.0.250", "127.0.0.1", port, 2.0)[0] is False  # cannot bind that source


def test_where_gloo_binds():
    assert _reach.gloo_binds({"GLOO_SOCKET_IFNAME": "lo"}) == ([("lo", "127.0.0.1")], "GLOO_SOCKET_IFNAME=lo")
    assert _reach.gloo_binds({"GLOO_SOCKET_IFNAME": "nosuch0"})[0] == []
    binds, how = _reach.gloo_binds({})
    assert len(binds) == 1 and binds[0][0] is None and "GLOO_SOCKET_IFNAME is unset" in how
    assert _reach.node_key() == _reach.node_key() and len(_reach.node_key()) == 16


# ---------------------------------------------------------------------------------------------- check_peers
def _two_nodes(rank, port, deaf):
    """One rank per pretend node: each its own node key and a second loopback address as 'eth0'."""
    _reach.node_key = lambda: f"pretend-node-{rank}"
    _reach.local_interfaces = lambda: {"eth0": f"127.0.0.{rank + 2}"}
    if deaf and rank == 1:  # rank 1 publishes a port where nothing listens as its gloo address
        dead = free_port()

        class Deaf(_reach.Listeners):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.ports["127.0.0.1"] = dead

        _reach.Listeners = Deaf  # type: ignore[misc]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    start = time.monotonic()
    try:
        _reach.check_peers(store, rank, 2, timeout_s=20, env={"GLOO_SOCKET_IFNAME": "lo", "GROUP_RANK": str(rank)})
        outcome = ("ok", None, None)
    except InitError as e:
        outcome = ("error", e.message, e.ranks)
    store.add("finished", 1)  # rank 0 hosts the store: keep it until rank 1 is done
    while rank == 0 and int(store.add("finished", 0)) < 2 and time.monotonic() - start < 20:
        time.sleep(0.02)
    return (*outcome, time.monotonic() - start)


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_check_peers_passes_when_every_listener_answers():
    results = run_ranks(_two_nodes, 2, args=(free_port(), False), init=False, timeout=60)
    assert [r[0] for r in results] == ["ok", "ok"], results
    assert all(r[3] < 10 for r in results)


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_check_peers_raises_the_same_error_on_every_rank():
    results = run_ranks(_two_nodes, 2, args=(free_port(), True), init=False, timeout=60)
    assert [r[0] for r in results] == ["error", "error"], results
    assert results[0][1] == results[1][1]
    assert results[0][1].startswith(
        "rank 1 on node 1 (host {0}, 127.0.0.1) binds gloo to GLOO_SOCKET_IFNAME=lo (127.0.0.1), which rank 0 on "
        "node 0 (host {0}, 127.0.0.1) cannot reach (connection refused); interfaces on node 1 that reach them: eth0 "
        "(127.0.0.3). Fix: set GLOO_SOCKET_IFNAME=eth0 on node 1.".format(socket.gethostname()))
    assert results[0][2] == results[1][2] == (1,)


def test_check_peers_names_the_ranks_that_never_came():
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(InitError) as info:
        _reach.check_peers(store, 0, 3, timeout_s=1.0, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert time.monotonic() - start < 5
    assert "ranks 1-2 did not arrive within 0.4 s" in str(info.value)
    assert str(info.value).startswith("[rank 0] the gloo reachability check (before init_process_group) timed out")


def test_a_single_rank_checks_nothing():
    store = dist.HashStore()
    _reach.check_peers(store, 0, 1, timeout_s=1.0)
    assert store.num_keys() == 0


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_two_ranks_on_one_host_pass_without_probing():
    results = run_ranks(_same_host, 2, args=(free_port(),), init=False, timeout=60)
    assert results == [None, None]


def _same_host(rank, port):
    _reach.probe = lambda *a: (_ for _ in ()).throw(AssertionError("probed a rank on the same host"))
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    _reach.check_peers(store, rank, 2, timeout_s=20, env={"GLOO_SOCKET_IFNAME": "lo"})
    store.add("finished", 1)
    deadline = time.monotonic() + 20
    while rank == 0 and int(store.add("finished", 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- doctor
@pytest.fixture
def two_interfaces(monkeypatch):
    """eth0 reaches the master, eth1 does not; no packet is sent."""
    monkeypatch.setattr(_reach, "local_interfaces", lambda: {"eth0": "10.213.0.2", "eth1": "10.214.0.2"})
    monkeypatch.setattr(_reach, "gloo_default_address", lambda timeout=5.0: ("10.213.0.2", "hostname"))
    outcomes = {"10.213.0.2": (True, "connected"), "10.214.0.2": (False, "no answer to a TCP connect within 2 s")}
    monkeypatch.setattr(_reach, "reaches", lambda src, host, port, timeout=2.0: outcomes[src])


def test_doctor_names_the_gloo_interface_that_does_not_reach_the_master(two_interfaces):
    env = {"MASTER_ADDR": "10.213.0.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "eth1"}
    found = {f.check: f for f in doctor.check_reach(env)}
    assert found["reach.eth0"].value == "10.213.0.2 -> MASTER_ADDR 10.213.0.1:29500: reaches: connected"
    assert found["reach.eth1"].value.startswith("10.214.0.2 -> MASTER_ADDR 10.213.0.1:29500: does not reach")
    problem = found["reach.GLOO_SOCKET_IFNAME"]
    assert (problem.level, problem.value) == ("error", "eth1 does not reach MASTER_ADDR 10.213.0.1:29500")
    assert problem.remedy == (
        "GLOO_SOCKET_IFNAME=eth1 names eth1 (10.214.0.2), which does not reach MASTER_ADDR 10.213.0.1:29500 (no "
        "answer to a TCP connect within 2 s); interfaces here that reach it: eth0 (10.213.0.2). Fix: set "
        "GLOO_SOCKET_IFNAME=eth0 (or unset it)")


def test_doctor_nccl_prefix_and_good_settings(two_interfaces):
    env = {"MASTER_ADDR": "10.213.0.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "eth0",
           "NCCL_SOCKET_IFNAME": "=eth1"}
    found = {f.check: f for f in doctor.check_reach(env)}
    assert found["reach.GLOO_SOCKET_IFNAME"].level == "ok"
    assert found["reach.NCCL_SOCKET_IFNAME"].level == "error"
    assert found["reach.NCCL_SOCKET_IFNAME"].remedy.endswith("Fix: set NCCL_SOCKET_IFNAME=eth0")
    found = {f.check: f for f in doctor.check_reach({**env, "NCCL_SOCKET_IFNAME": "eth"})}
    assert found["reach.NCCL_SOCKET_IFNAME"].level == "ok"  # NCCL's first match, eth0, reaches


def test_doctor_skips_without_a_remote_master(two_interfaces):
    assert doctor.check_reach({})[0].value.startswith("skipped: MASTER_ADDR/MASTER_PORT are not set")
    (f,) = doctor.check_reach({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert f.value.startswith("skipped: MASTER_ADDR 127.0.0.1 is on this host")
    (f,) = doctor.check_reach({"MASTER_ADDR": "10.213.0.2", "MASTER_PORT": "29500"})
    assert f.value.startswith("skipped: MASTER_ADDR 10.213.0.2 is on this host")


def _host_leaves(rank, port):
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    if rank == 0:  # serve the store until rank 1 is inside the check, then leave without taking part
        store.wait([f"robustdist/reach/{_reach._generation + 1}/arrived/1"], timedelta(seconds=20))
        return None
    start = time.monotonic()
    try:
        _reach.check_peers(store, rank, 2, timeout_s=20, env={"GLOO_SOCKET_IFNAME": "lo"})
    except InitError as e:
        return str(e), time.monotonic() - start
    return None


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_a_store_that_goes_away_is_named_as_such():
    _, (message, seconds) = run_ranks(_host_leaves, 2, args=(free_port(),), init=False, timeout=60)
    assert message.startswith("[rank 1] the c10d store failed during the gloo reachability check"), message
    assert "Fix: check the log of the rank hosting the store (MASTER_ADDR)" in message
    assert seconds < 15


@pytest.mark.parametrize("key, value, expected", [
    ("failures/n", 10**8, "expected a count from 0 to 2 (the world size)"),
    ("failures/1", b"{oops", "expected JSON of at most 65536 bytes (not JSON (JSONDecodeError: Expecting "),
    ("failures/1", b'{"prober": 5, "failures": []}', "expected a failure list of one of ranks ["),
    ("failures/1", b'{"prober": REP, "failures": [{"target": "REP"}]}', "expected failures naming a probed rank"),
    ("failures/1", b"[" * 100_000, "expected JSON of at most 65536 bytes (100000 bytes, more than the "
                                   "65536 it can be)"),
    ("reps/1", b"7", "expected a rank from 0 to 1"),
])
def test_a_hostile_value_in_the_store_is_a_named_error_on_every_rank(key, value, expected):
    """Two ranks in threads on one store; before they finish, another process's value lands under one of the
    check's keys. Each rank raises an InitError naming the key and what it expected; none builds a list as long
    as a counter says (10**8 here), none raises a raw error."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    prefix = "robustdist/reach/4242"
    planted, lock = threading.Event(), threading.Lock()

    def plant() -> None:  # once both ranks are past their arrival: as if written meanwhile
        with lock:
            if planted.is_set():
                return
            planted.set()
            if key.endswith("/n"):
                store.add(f"{prefix}/{key}", int(value))
            else:
                if key.startswith("failures/"):
                    store.add(f"{prefix}/failures/n", 1)
                rep = store.get(f"{prefix}/reps/1")  # the ranks' one representative (one node): the prober
                store.set(f"{prefix}/{key}", value.replace(b"REP", rep) if isinstance(value, bytes) else value)

    results: dict[int, BaseException | None] = {}

    class Planting:
        """A rank's store connection; the first rank to wait for the probes plants the value: both read after."""

        def __init__(self) -> None:
            self.store = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, timeout=timedelta(seconds=30))

        def __getattr__(self, name: str) -> object:
            return getattr(self.store, name)

        def wait(self, keys, *args):
            if f"{prefix}/probed" in keys:
                plant()
            return self.store.wait(keys, *args)

    def rank(r: int) -> None:
        client = Planting()
        try:
            _reach.check_peers(client, r, 2, timeout_s=20, env={"GLOO_SOCKET_IFNAME": "lo"}, generation=4242)
            results[r] = None
        except BaseException as e:  # noqa: BLE001 - the test reports what each rank raised
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert planted.is_set()
    for r, error in results.items():
        assert isinstance(error, InitError) and error.rank == r, (r, error)
        assert f"from the c10d store's key '{prefix}/{key.split('/')[0]}" in str(error), str(error)
        assert expected in str(error) and "give each job its own port" in str(error), str(error)


@pytest.mark.parametrize("value, expected", [
    (b'{"rank": 0}', "a description with text fields"),
    (b'{"rank": 1, "node": "n", "label": "l", "how": "h", "group": "g", "binds": [], "ifaces": []}',
     "a description of rank 0"),
    (b'{"rank": 0, "node": "n", "label": "l", "how": "h", "group": "g", "binds": [], "ifaces": []}',
     "a description with lists of interfaces"),
    (b'{"rank": 0, "node": "n", "label": "l", "how": "h", "group": "g", "binds": [{"if": "lo", "addr": 1}], '
     b'"ifaces": []}', "a description with lists of interfaces"),
    (b'{"rank": 0, "node": "n", "label": "l", "how": "h", "group": "g", "binds": [{"if": "lo", "addr": "a", '
     b'"port": 70000}], "ifaces": []}', "a description with lists of interfaces"),
])
def test_a_hostile_description_is_a_named_error(value, expected):
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set("p/desc/0", value)
    with pytest.raises(InitError, match=f"from the c10d store's key 'p/desc/0'; expected {expected}"):
        reach_store.descriptions(store, "p", [0], 2)
    good = b'{"rank": 0, "node": "n", "label": "l", "how": "h", "group": "g", "binds": [{"if": "lo", "addr": "a"}], ' \
           b'"ifaces": [{"if": "lo", "addr": "a", "port": 5}]}'
    store.set("p/desc/0", good)
    assert reach_store.descriptions(store, "p", [0], 2)[0]["binds"] == [{"if": "lo", "addr": "a"}]
