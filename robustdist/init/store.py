"""The rendezvous of ``safe_init_process_group`` (step 3 of :mod:`robustdist.init.process_group`): find or serve the
store, count the attempt, wait for every rank, check that every node reaches every other, all by one deadline."""

from __future__ import annotations

import os
import time
from typing import Any

from robustdist.config.schema import DistributedConfig
from robustdist.init import elastic_store as _elastic_store
from robustdist.init import reach as _reach
from robustdist.init import rendezvous as _rendezvous
from robustdist.runtime.deadline import bounded
from robustdist.runtime.errors import InitError
from robustdist.runtime.log import get_logger
from robustdist.runtime.node import node_label
from robustdist.runtime.topology import Topology

__all__ = ["rendezvous_store"]

log = get_logger(__name__)


_RECONNECT_S = 10.0  # how long a client looks for rank 0's next store after losing one
_RECONNECTS = 3  # at most this many times per rendezvous


def _arrive(ep: Any, dcfg: DistributedConfig, topo: Topology, mode: str, deadline: float,
            where: str) -> tuple[Any, int, bool]:
    """Open (or serve) the store and wait for every rank: ``(store, attempt part, serves_it)``.

    A client of a store rank 0 serves connects again when that store closes before every rank arrived: in a
    process that re-initialises (harden() after a refused one, a close then a new group), this rank can reach
    rank 0's previous store in the moment before rank 0 frees it, and rank 0 then serves the next one on the same
    port. The round's keys are per generation, so a store still holding an old round is no confusion. Only
    :data:`_RECONNECT_S` seconds (and :data:`_RECONNECTS` times): when nothing serves again, rank 0 failed or
    gave up, and the loss itself is the error ("stopped answering ... rank 0 failed or exited")."""
    generation = _rendezvous.next_generation()
    served_by_rank0 = ep.scheme != "file" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store, serves = _rendezvous.open_store(ep, topo, deadline, dcfg.init_timeout)
    for reconnects in range(_RECONNECTS + 1):
        attempt = _elastic_store.contribution(mode, topo.rank, store, os.environ)
        try:
            _rendezvous.wait_for_arrivals(store, topo.rank, topo, deadline, where=where,
                                          init_timeout=dcfg.init_timeout, serves_it=serves, generation=generation)
            return store, attempt, serves
        except InitError as lost:
            if not _rendezvous.store_lost(lost) or serves or not served_by_rank0 or reconnects == _RECONNECTS \
                    or time.monotonic() >= deadline:
                raise
            log.info("rank %d: the store at %s closed before every rank arrived (%s); looking for rank 0's next "
                     "one for up to %g s", topo.rank, where, lost.__cause__, _RECONNECT_S)
            del store
            try:
                store, serves = _rendezvous.open_store(ep, topo, min(deadline, time.monotonic() + _RECONNECT_S),
                                                       dcfg.init_timeout)
            except InitError as again:
                log.info("rank %d: no store at %s again (%s)", topo.rank, where, str(again)[:200])
                raise lost from lost.__cause__
    raise AssertionError("unreachable")


def rendezvous_store(dcfg: DistributedConfig, topo: Topology) -> tuple[Any, int, bool]:
    """Step 3 of :mod:`robustdist.init.process_group`'s docstring: ``(store, attempt, share)`` with every rank
    arrived in ``store``.

    Everything after the preflight runs on a thread joined at the deadline: a TCPStore client's calls do not
    honour its timeout when the server stops answering after the handshake (a frozen or cut-off master)."""
    deadline = time.monotonic() + dcfg.init_timeout  # one bound for resolving, connecting and arriving
    ep = _rendezvous.preflight(_rendezvous.endpoint(dcfg.init_method, topo), topo, dcfg.init_timeout)
    mode = _elastic_store.attempt_mode(os.environ, dcfg.init_method)
    where: list[str] = [ep.path if ep.scheme == "file" else f"{ep.host}:{ep.port}"]

    def rendezvous() -> tuple[Any, int, bool]:
        if mode == "fresh-store" and ep.host and ep.port:
            generation = _rendezvous.next_generation()  # a re-init in this process publishes a store of its own
            store = _elastic_store.attempt_store(ep.host, ep.port, topo.rank, topo.world_size, dcfg.init_timeout,
                                                 generation=generation)
            attempt, share = _elastic_store.attempt_of(store, topo.rank), False
            serves = topo.rank == 0 and _elastic_store.served_by_agent(topo.rank) is None
            where[0] = f"this attempt's store, published in torchrun's agent store at {ep.host}:{ep.port}"
            _rendezvous.wait_for_arrivals(store, topo.rank, topo, deadline, where=where[0],
                                          init_timeout=dcfg.init_timeout, serves_it=serves, generation=generation)
        else:
            store, attempt, serves = _arrive(ep, dcfg, topo, mode, deadline, where[0])
            share = mode in ("agent-store", "restart-count")
        # Can every node reach the address gloo will bind on every other node? (else init hangs for `timeout`)
        _reach.check_peers(store, topo.rank, topo.world_size, timeout_s=max(10.0, deadline - time.monotonic()))
        return store, attempt, share

    bound = max(deadline, time.monotonic() + 10.0) + 5.0  # the peer check's floor, and time to name the absent
    value, error, finished = bounded(rendezvous, bound, "rendezvous", ends_by=bound + 30.0)
    if error is not None:
        raise error
    if not finished:
        raise InitError(
            f"the c10d store at {where[0]} ({ep.told}) stopped answering "
            f"during the rendezvous: no reply within distributed.init_timeout ({dcfg.init_timeout:g} s) from "
            f"{node_label()}. Expected the process serving it (rank 0, or torchrun's agent on the master node) to "
            "answer until every rank had arrived. Fix: that process is frozen, overloaded or cut off from this node: "
            "see its log and stack (robustdist's watchdog, py-spy), and check the network between the nodes.",
            rank=topo.rank)
    return value  # type: ignore[no-any-return]
