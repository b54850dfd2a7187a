"""Unblocking a gloo collective in progress by shutting down its group's connections
(robustdist.runtime.group_sockets), on real gloo ranks.

Measured before this module (torch 2.13): ``ProcessGroup.abort()`` returns at once but leaves a collective in
progress blocked until the peer's process exits; a shut-down connection fails it at once, on both ends."""

from __future__ import annotations

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
    timer.start()
    outcome, elapsed = _all_reduce(t)
    timer.join()
    store.set("done", "1")
    dist.destroy_process_group()
    return outcome, elapsed, shut[0]


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


def test_only_the_sockets_opened_inside_the_block_are_recorded_and_never_a_reused_descriptor():
    server = socket.create_server(("127.0.0.1", 0))
    old = socket.create_connection(server.getsockname())
    old_peer, _ = server.accept()
    sockets = GroupSockets(exclude_ports=[])
    with sockets.recording():
        conn = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        listener = socket.create_server(("127.0.0.1", 0))  # a listener: never recorded (gloo aborts on it)
    try:
        # conn, and the accepted end `peer`: both connected sockets opened in the block
        assert len(sockets) == 2
        # a descriptor closed and reused by another socket is not touched
        fd = conn.fileno()
        conn.close()
        os.dup2(old.fileno(), fd)  # fd now names `old`'s connection: another socket under a recorded number
        try:
            assert sockets.unblock() == 1  # only `peer`, still the socket recorded under its number
            old.sendall(b"x")  # `old` still works: its connection was not shut down
            assert old_peer.recv(1) == b"x"
            peer.settimeout(5)
            assert peer.recv(1) == b""  # `peer` was
            listener.settimeout(0.01)
            with pytest.raises(TimeoutError):
                listener.accept()  # the listener still listens (shut down, it would fail at once)
        finally:
            os.close(fd)
    finally:
        for s in (server, old, old_peer, peer, listener):
            s.close()


def test_connections_to_the_store_port_are_left_alone():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sockets = GroupSockets(exclude_ports=[port])
    with sockets.recording():
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
    try:
        assert len(sockets) == 1  # the accepted end (its peer port is the client's), not the client
        assert sockets.unblock() == 1
        client.settimeout(5)
        assert client.recv(1) == b""  # the connection was closed from the accepted end
    finally:
        for s in (server, client, accepted):
            s.close()
