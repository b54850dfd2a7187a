"""Unblocking a gloo collective in progress by shutting down its group's connections
(robustdist.runtime.group_sockets), on real gloo ranks.

Measured before this module (torch 2.13): ``ProcessGroup.abort()`` returns at once but leaves a collective in
progress blocked until the peer's process exits; a shut-down connection fails it at once, on both ends."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from robustdist.runtime import group_sockets
from robustdist.runtime.group_sockets import GroupSockets, open_sockets
from robustdist.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(300)


def _store(rank: int) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=rank == 0,
                         timeout=timedelta(seconds=60))


def _group(rank: int, store: dist.TCPStore, prefix: str, sockets: GroupSockets) -> None:
    with sockets.recording():
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))


def _all_reduce(t: torch.Tensor) -> tuple[str, float]:
    """``("returned" | "unblocked", seconds)``."""
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        return "returned", time.monotonic() - start
    except RuntimeError:
        return "unblocked", time.monotonic() - start


def _unblocked_by_this_rank(rank: int) -> tuple[str, float, int]:
    """Rank 1 hangs in Python (never joins); rank 0 is in an all_reduce, and its own thread shuts the group's
    connections down after 0.5 s."""
    store = _store(rank)
    sockets = GroupSockets(exclude_ports=[store.port])
    _group(rank, store, "g", sockets)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group works, and every connection is up
    if rank == 1:
        store.wait(["done"], timedelta(seconds=120))  # a hang the collective's timeout (120 s) would end
        dist.destroy_process_group()
        return "hung", 0.0, len(sockets)
    shut = []
    timer = threading.Timer(0.5, lambda: shut.append(sockets.unblock()))
    begin = time.monotonic()  # before the timer starts: it fires no sooner than 0.5 s after this
    timer.start()
    outcome, _ = _all_reduce(t)
    elapsed = time.monotonic() - begin
    timer.join()
    store.set("done", "1")
    dist.destroy_process_group()
    return outcome, elapsed, shut[0]


@pytest.mark.processes
def test_a_blocked_collective_fails_at_once_when_its_connections_are_shut_down():
    (outcome, elapsed, shut), (hung, _, recorded1) = run_ranks(_unblocked_by_this_rank, 2, init=False, timeout=120)
    assert outcome == "unblocked" and hung == "hung"
    assert 0.5 <= elapsed < 30, elapsed  # not the collective's 120 s timeout
    assert shut >= 1 and recorded1 >= 1  # one connection per peer, gloo's listener left out


def _recover_in_place(rank: int, rounds: int) -> list[tuple[str, float, int, int]]:
    """Each round: a group and a DDP step; rank 1 then faults outside any collective and shuts its connections
    down, which unblocks rank 0's all_reduce; both destroy the group and make the next one at a new prefix."""
    store = _store(rank)
    model = nn.Linear(4, 4)
    out = []
    for gen in range(rounds):
        sockets = GroupSockets(exclude_ports=[store.port])
        _group(rank, store, f"gen/{gen}", sockets)
        ddp = TorchDDP(model)
        ddp(torch.ones(2, 4)).sum().backward()
        t = torch.full((1,), float(gen))
        if rank == 1:
            time.sleep(0.2)  # the fault
            sockets.unblock()
            outcome, elapsed = "faulted", 0.0
        else:
            outcome, elapsed = _all_reduce(t)
        del ddp
        dist.destroy_process_group()
        sockets.forget()
        out.append((outcome, elapsed, len(open_sockets()), threading.active_count()))
    # the last group is a healthy one: the process can still do real work
    _group(rank, store, "final", GroupSockets())
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    out.append(("final", t.item(), 0, 0))
    return out


@pytest.mark.processes
def test_ranks_recover_in_place_again_and_again_without_leaking():
    rounds = 12
    rank0, rank1 = run_ranks(_recover_in_place, 2, args=(rounds,), init=False, timeout=30 + 10 * rounds)
    assert [o for o, *_ in rank0[:-1]] == ["unblocked"] * rounds and [o for o, *_ in rank1[:-1]] == ["faulted"] * rounds
    assert all(elapsed < 30 for _, elapsed, _, _ in rank0[:-1])  # not the collective's 120 s
    assert rank0[-1][:2] == rank1[-1][:2] == ("final", 3.0)
    for rounds_out in (rank0, rank1):
        socks = [s for _, _, s, _ in rounds_out[1:-1]]
        threads = [n for _, _, _, n in rounds_out[1:-1]]
        assert max(socks) == min(socks), socks  # sockets flat after the first round's
        assert max(threads) == min(threads), threads


def _connected_pair_in(sockets: GroupSockets) -> tuple[socket.socket, socket.socket, socket.socket]:
    """Inside a recording: a listener (as gloo's), a connection to it and its accepted end."""
    with sockets.recording():
        listener = socket.create_server(("127.0.0.1", 0))
        out = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    return listener, out, accepted


def test_a_groups_connections_are_recorded_and_shut_down_but_never_its_listener():
    sockets = GroupSockets(exclude_ports=[])
    listener, out, accepted = _connected_pair_in(sockets)
    try:
        assert len(sockets) == 2  # the outbound connection and the one the window's listener accepted
        assert sockets.unblock() == 2
        out.settimeout(5)
        assert out.recv(1) == b""  # shut down
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            listener.accept()  # still listening (a listener shut down fails accept at once; gloo then aborts)
        assert sockets.unblock() == 0  # repeatable: nothing is left to shut down, and nothing raises
    finally:
        for s in (listener, out, accepted):
            s.close()


def test_a_descriptor_reused_by_another_socket_is_never_touched():
    other_server = socket.create_server(("127.0.0.1", 0))
    old = socket.create_connection(other_server.getsockname())
    old_peer, _ = other_server.accept()
    sockets = GroupSockets(exclude_ports=[])
    listener, out, accepted = _connected_pair_in(sockets)
    fd = out.fileno()
    out.close()
    os.dup2(old.fileno(), fd)  # the recorded number now names `old`'s connection: another socket
    try:
        assert sockets.unblock() == 1  # only `accepted`, still the socket recorded under its number
        old.sendall(b"x")
        assert old_peer.recv(1) == b"x"  # `old` was not shut down
    finally:
        os.close(fd)
        for s in (other_server, old, old_peer, listener, accepted):
            s.close()


def test_a_connection_accepted_by_another_server_of_the_process_is_left_alone():
    server = socket.create_server(("127.0.0.1", 0))  # a server of the process, older than the group
    sockets = GroupSockets(exclude_ports=[])
    with sockets.recording():
        client = socket.create_connection(server.getsockname())  # an outbound one: cannot be told from gloo's
        accepted, _ = server.accept()
    try:
        assert len(sockets) == 1 and sockets.unblock() == 1
        accepted.settimeout(5)
        assert accepted.recv(1) == b""  # the client end was shut down; the accepted end itself was not recorded
    finally:
        for s in (server, client, accepted):
            s.close()


def test_the_store_survives_on_the_rank_that_serves_it():
    """Rank 0 serves the store: its server's accepted connections have the store's port as their local port.
    Neither they nor a client's connection are recorded, and the store works after an unblock."""
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    excluded = GroupSockets(exclude_ports=[server.port])
    with excluded.recording():
        client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timedelta(seconds=30))
        late = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timedelta(seconds=30))
    assert len(excluded) == 0
    assert excluded.unblock() == 0
    client.set("k", "v")
    assert late.get("k") == b"v" and server.get("k") == b"v"


def test_lazy_gloo_connections_are_named(monkeypatch, caplog):
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    sockets = GroupSockets()
    with caplog.at_level("WARNING", logger="robustdist.runtime.group_sockets"), sockets.recording():
        pass
    assert sockets.lazy and "TORCH_GLOO_LAZY_INIT is set" in caplog.text and sockets.unblock() == 0


def _listening_ports() -> list[int]:
    """The ports of this process's listening TCP sockets, read through socket options (not group_sockets' parser)."""
    ports = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            copy = os.dup(int(fd))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # not a socket
            os.close(copy)
            continue
        with sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and \
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                ports.append(sock.getsockname()[1])
    return sorted(ports)


@pytest.mark.processes
def test_a_forked_child_closes_its_copies_of_the_listeners_and_the_port_is_free_again_while_it_lives():
    """A DataLoader worker's case: the parent serves on a port, forks, closes its own server and serves on the
    same port again while the child still runs; only the child's closing its copy makes that possible. The
    parent's listener keeps accepting meanwhile, and a connected socket of the child's is kept."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: closes its listeners, reports, and lives until the parent is done
        try:
            closed = group_sockets.close_listeners()
            kept = client.fileno() in group_sockets.open_sockets()
            os.write(ready_w, f"{closed} {kept}".encode())
            os.read(done_r, 1)
        finally:
            os._exit(0)
    try:
        said = os.read(ready_r, 4000).decode()
        closed, kept = said.rsplit(" ", 1)
        # exactly the parent's listeners (this test's, and any an earlier test left in this worker), the connection kept
        assert sorted(json.loads(closed)) == _listening_ports() and port in json.loads(closed) and kept == "True", said
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            server.accept()[0].close()  # the parent's own listener still serves
        server.close()
        again = socket.create_server(("127.0.0.1", port))  # EADDRINUSE if the living child still listened
        again.close()
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        client.close()
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
