"""The rendezvous at init, bounded by ``distributed.init_timeout``: check the address, reach the store, see
every rank arrive.

torch's own rendezvous has no useful bound where a job is misconfigured. Seen on torch 2.13 CPU: a client of a
closed port retries until the collective timeout; a port answered by something that is not a c10d store
hangs the ``TCPStore`` constructor far past its own timeout; ``init_method=file://`` in a directory that does
not exist hangs in ``FileStore``; a rank that never started leaves gloo's full mesh waiting for the collective
timeout (30 min) without naming it. So robustdist does the rendezvous itself and hands ``init_process_group``
a connected store (``store=``, with the collective timeout). Every rank runs, in order:

1. **Before any connection** (:func:`preflight`). On a job that spans more than one node, a ``MASTER_ADDR``
   (or ``tcp://`` host) that is, or resolves only to, a loopback address is an error: the other nodes would
   connect to themselves. torchrun's c10d rendezvous advertises the master node by its hostname, and
   ``/etc/hosts`` often maps a hostname to ``127.0.1.1`` (Debian's default, containers, network namespaces).
   For ``file://``, the file's directory must exist.
2. **Connect** (:func:`open_store`), as torch's ``env://``/``tcp://``/``file://`` handlers do (see
   ``torch/distributed/rendezvous.py``): under torchrun with the agent's store
   (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of it; otherwise rank 0 serves a
   multi-tenant ``TCPStore`` (``USE_LIBUV`` honoured) and the other ranks are its clients; ``file://`` opens a
   ``FileStore``. Each constructor runs on a daemon thread joined at the deadline. When a client has no
   store by then, one plain socket connect (:func:`robustdist.runtime.netenv.probe`) says why: nothing listens
   (refused), nothing answers, or something answered that is not a c10d store.
3. **Arrival** (:func:`wait_for_arrivals`). Each rank sets its own key and counts itself in; every rank waits
   until ``world_size`` ranks have arrived. At the deadline it names the ranks that did not and marks the round
   abandoned, so the ranks still waiting stop at once with the same names.

One deadline, ``init_timeout`` after step 1 starts, bounds all three steps. :func:`for_group` then sets the
store's timeout to the collective timeout and wraps it as ``PrefixStore("default_pg", store)``, as
``init_process_group`` does with a store its handlers made. Under torchrun with restarts,
:mod:`robustdist.init.elastic_store` replaces step 2 with a fresh store for the attempt (it reaches the agent's
store through :func:`connect_tcp`), and step 3 runs on that store.

Keys of step 3 carry a per-process generation, the same on every rank that makes the same calls. In a store
that outlives an attempt (the agent's store without ``--max-restarts``, a reused ``file://`` file), keys of
an earlier attempt can make a missing rank look present: the arrival check is then no stronger than torch's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from robustdist.runtime import job_store
from robustdist.runtime import netenv
from robustdist.runtime import store_barrier
from robustdist.runtime.deadline import bounded
from robustdist.runtime.errors import InitError, ranks_phrase
from robustdist.runtime.log import get_logger
from robustdist.runtime.node import node_label
from robustdist.runtime.topology import Topology

__all__ = ["Endpoint", "connect_tcp", "endpoint", "for_group", "open_store", "preflight", "try_connect",
           "next_generation", "store_lost", "wait_for_arrivals"]

log = get_logger(__name__)
_RESOLVE_S = 10.0  # at most this long (and never past init_timeout) for MASTER_ADDR to resolve
_PROBE_S = 1.0  # the plain-socket connect that says why no store came
_HANDSHAKE_S = 5.0  # a store client's handshake, once something accepts: a real store answers in milliseconds
_SPOKE_TRIES = 2  # failed handshakes in a row, the port accepting each time, that make it "not a c10d store"
_SERVE_SLACK_S = 60.0  # rank 0's store constructor gives up this long after the deadline (see _serve)
_LINGER_S = 0.6  # a rank serving the store keeps it up this long after abandoning, so the others read why
_ADDR_FIX = ("MASTER_ADDR must name the master node by an address every node reaches: launch torchrun with "
             "--local_addr=<that node's IP>, or export MASTER_ADDR=<that node's IP>, or map its hostname to that IP "
             "in /etc/hosts (not to 127.0.1.1)")
_generation = 0


def store_lost(error: BaseException) -> bool:
    """Whether ``error`` is :func:`wait_for_arrivals`' "the store stopped answering" (an :class:`InitError` with
    ``store_lost`` set): a client of a store rank 0 serves may then look for rank 0's next one (see
    :func:`robustdist.init.store.rendezvous_store`)."""
    return isinstance(error, InitError) and getattr(error, "store_lost", False) is True


def next_generation() -> int:
    """The number of this process's next rendezvous round (every rank counts its own rounds alike)."""
    global _generation
    _generation += 1
    return _generation


@dataclass(frozen=True)
class Endpoint:
    """Where this rank was told the store is. ``told`` is how it was told, for messages."""

    scheme: str
    told: str
    host: str | None = None
    port: int | None = None
    path: str | None = None
    addresses: list[str] = field(default_factory=list)  # what ``host`` resolved to (filled by preflight)


def endpoint(init_method: str, topo: Topology) -> Endpoint:
    """The store's address from ``init_method`` (``env://`` reads ``MASTER_ADDR``/``MASTER_PORT``)."""
    parsed = urlparse(init_method)
    if parsed.scheme == "env":
        if not topo.master_addr or topo.master_port is None:
            raise InitError(f"MASTER_ADDR={topo.master_addr!r}, MASTER_PORT={topo.master_port}: env:// needs both; "
                            "expected the master node's address and a free port on it. Fix: launch with torchrun, or "
                            "export MASTER_ADDR and MASTER_PORT.", rank=topo.rank)
        return Endpoint("env", f"MASTER_ADDR={topo.master_addr!r}, MASTER_PORT={topo.master_port}",
                        host=topo.master_addr, port=topo.master_port)
    if parsed.scheme == "file":
        return Endpoint("file", f"init_method={init_method!r}", path=parsed.path)  # as torch reads it
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None:
        raise InitError(f"init_method={init_method!r} has no host or no port; expected tcp://<host>:<port> of the "
                        "node that serves the store. Fix: write it as tcp://10.0.0.1:29500, or use env://.",
                        rank=topo.rank)
    return Endpoint("tcp", f"init_method={init_method!r}", host=parsed.hostname, port=port)


def preflight(ep: Endpoint, topo: Topology, init_timeout: float) -> Endpoint:
    """Step 1: refuse what cannot work, without connecting. Returns ``ep`` with its resolved addresses."""
    if ep.scheme == "file":
        _check_file(ep, topo)
        return ep
    assert ep.host is not None  # endpoint() and the env check guarantee it
    addresses, reason = netenv.resolve_addresses(ep.host, min(_RESOLVE_S, init_timeout))
    if reason is not None:
        raise InitError(f"{ep.told}: {ep.host!r} does not resolve on {node_label()} ({reason}); expected a hostname "
                        f"or IP address every rank can reach. Fix: {_ADDR_FIX}.", rank=topo.rank)
    if topo.num_nodes > 1 and addresses and all(netenv.local_only(a) for a in addresses):
        literal = addresses == [ep.host]
        found = "is a loopback address" if literal else f"resolves only to loopback ({', '.join(addresses)})"
        raise InitError(
            f"{ep.told}: {ep.host!r} {found} on {node_label()}, but the job spans {topo.num_nodes} nodes (world "
            f"size {topo.world_size}, {topo.local_world_size} per node): every node would look for the store on "
            f"itself and wait out the timeout. Nothing was connected. Expected an address of the master node that "
            f"the other nodes can reach. Fix: {_ADDR_FIX}.", rank=topo.rank)
    return Endpoint(ep.scheme, ep.told, ep.host, ep.port, ep.path, addresses)


def _check_file(ep: Endpoint, topo: Topology) -> None:
    path = ep.path or ""
    parent = os.path.dirname(os.path.abspath(path)) if path else ""
    if not path or os.path.isdir(path) or not os.path.isdir(parent):
        found = ("names no file" if not path else "is a directory" if os.path.isdir(path)
                 else f"is in the directory {parent!r}, which does not exist")
        raise InitError(
            f"{ep.told}: the store file {path!r} {found} on {node_label()} (torch's FileStore would wait there "
            f"without a bound). Expected the path of a file, new or left by no other job, in an existing directory "
            f"that every rank shares. Fix: create the directory first (mkdir -p {parent or '<dir>'}) on a "
            "filesystem every node mounts, or use env:// with torchrun.", rank=topo.rank)


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.1, deadline - time.monotonic()))


def try_connect(host: str, port: int, world_size: int, deadline: float, *,
                retry_refused: bool = True) -> tuple[Any, str, str]:
    """A ``TCPStore`` client of ``host:port`` by ``deadline``; never raises.

    Returns ``(store, "", "")``, or ``(None, kind, detail)`` with a :func:`robustdist.runtime.netenv.probe` kind: plain
    socket connects (cheap, in Python, retried with a backoff while ``retry_refused``) until something accepts,
    then the store handshake, bounded by :data:`_HANDSHAKE_S`. torch retries a handshake inside that bound
    whatever the failure, so a failed one may only mean the server went away meanwhile: a re-initialising rank 0
    whose previous store closed as this rank connected, its next store not up within the bound (a harden/close
    loop does this). So the port is probed again: nothing listening is waited for as before the handshake
    (with ``retry_refused=False``, ``"refused"`` is returned at once); a port that accepts again and fails
    :data:`_SPOKE_TRIES` handshakes in a row is ``"spoke"``, with torch's last error. A handshake still unanswered
    at the deadline is ``"spoke"`` if one had failed, else ``"accepted"``.
    """
    kind, detail, delay = "refused", "connection refused", 0.05
    failed: list[str] = []  # the handshake failures since something last accepted after a refusal
    while (remaining := deadline - time.monotonic()) > 0:
        kind, detail = netenv.probe(host, port, min(_PROBE_S, remaining), listen=False)
        if kind == "accepted":
            handshake = timedelta(seconds=min(_HANDSHAKE_S, max(0.1, remaining / 2)))  # so it ends by the deadline

            def make() -> Any:
                return job_store.connect(host, port, world_size=world_size, timeout=handshake)

            ends_by = time.monotonic() + 2 * handshake.total_seconds()  # torch's last retry delay overshoots
            store, error, finished = bounded(make, deadline, "store-connect", ends_by=ends_by)
            if store is not None:
                return store, "", ""
            if not finished:
                if failed:
                    return None, "spoke", failed[-1]
                return None, "accepted", "it accepted the connection and did not answer the store handshake"
            failed.append(f"the store handshake failed: {_first_line(error)}")
            if len(failed) >= _SPOKE_TRIES:
                return None, "spoke", failed[-1]
            log.debug("%s:%d: %s; probing it again", host, port, failed[-1])
        elif not retry_refused:
            break
        elif kind == "refused":
            failed.clear()  # whatever failed the handshake has gone: wait for the next server as usual
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(2 * delay, 0.5)
    return None, kind, detail


def _first_line(error: BaseException | None) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def connect_tcp(ep: Endpoint, *, rank: int, world_size: int, deadline: float, init_timeout: float,
                serving: str) -> Any:
    """A ``TCPStore`` client of ``ep`` by ``deadline``, or an :class:`InitError` that says why there is none."""
    assert ep.host is not None and ep.port is not None
    store, kind, detail = try_connect(ep.host, ep.port, world_size, deadline)
    if store is not None:
        return store
    if kind == "accepted":  # say what it was: did it send anything?
        kind, detail = netenv.probe(ep.host, ep.port, _PROBE_S)
        detail += "; it did not answer the store handshake" if kind == "accepted" else ""
    raise _unreachable(ep, kind, detail, rank=rank, init_timeout=init_timeout, serving=serving)


def _unreachable(ep: Endpoint, kind: str, detail: str, *, rank: int, init_timeout: float, serving: str) -> InitError:
    where = f"{ep.host}:{ep.port}"
    if kind == "refused":
        found = f"connection refused: nothing listens on port {ep.port} there"
        fix = (f"check that {serving} started (its log) and that MASTER_PORT is the same on every rank; a script that "
               "sets os.environ['MASTER_PORT'] (old tutorials do) points the ranks away from the port the launcher chose: "
               "remove that line. Also, ")
    elif kind in ("accepted", "spoke"):
        found = f"something listens there but it is not a c10d store ({detail})"
        fix = ("the port belongs to another service: use a port nothing else listens on (torchrun --master_port, or "
               "MASTER_PORT), the same on every rank. Also, ")
    else:
        found = f"nothing answers ({detail}): the address may belong to no machine, or a firewall drops the packets"
        fix = "open the port between the nodes if a firewall is in the way. Also, "
    return InitError(
        f"could not reach the c10d store at {where} ({ep.told}, resolved to {', '.join(ep.addresses) or ep.host}) "
        f"from {node_label()} within {init_timeout:g} s (distributed.init_timeout): {found}. Expected {serving} to "
        f"serve a c10d store there. Fix: {fix}{_ADDR_FIX}; raise "
        "distributed.init_timeout if the master node starts slowly.", rank=rank)


def _serve(ep: Endpoint, world_size: int, deadline: float, rank: int) -> Any:
    assert ep.host is not None and ep.port is not None

    def make() -> Any:
        # The master's own client connects to ep.host. On an address this node does not own it retries until
        # its timeout, and torch aborts the process when the constructor then gives up ("terminate called
        # without an active exception" on torch 2.8 and 2.15, when the process is still alive at that moment).
        # So its timeout runs _SERVE_SLACK_S past the deadline: this rank's InitError, and its exit, come first.
        # (The later store operations use the collective timeout, set by for_group.)
        return job_store.serve(ep.host, ep.port, world_size=world_size, multi_tenant=True,
                               timeout=_remaining(deadline) + timedelta(seconds=_SERVE_SLACK_S))

    store, error, _ = bounded(make, deadline, "store-serve")
    if store is not None:
        return store
    raise InitError(
        f"rank 0 could not serve the c10d store on port {ep.port} ({ep.told}) on {node_label()}: "
        f"{error or 'the server did not start before distributed.init_timeout'}. Expected the port to be free on "
        "the master node. Fix: another process (often an earlier run) holds it: choose a free MASTER_PORT "
        "(torchrun --master_port), the same on every rank.", rank=rank) from error


def open_store(ep: Endpoint, topo: Topology, deadline: float, init_timeout: float) -> tuple[Any, bool]:
    """Step 2: ``(store, serves_it)``, where ``serves_it`` is True when this process hosts the store."""
    if ep.scheme == "file":
        assert ep.path is not None
        path = ep.path
        store, error, _ = bounded(lambda: dist.FileStore(path, topo.world_size), deadline, "file-store")
        if store is None:
            raise InitError(f"{ep.told}: could not open the store file on {node_label()} within {init_timeout:g} s "
                            f"({error or 'FileStore did not return'}). Expected a file every rank can create and "
                            "lock. Fix: use a local or shared filesystem that supports file locks (not all NFS "
                            "mounts do), or env:// with torchrun.", rank=topo.rank)
        return store, False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return connect_tcp(ep, rank=topo.rank, world_size=topo.world_size, deadline=deadline,
                           init_timeout=init_timeout, serving="torchrun's agent on the master node"), False
    if topo.rank == 0:
        return _serve(ep, topo.world_size, deadline, topo.rank), True
    return connect_tcp(ep, rank=topo.rank, world_size=topo.world_size, deadline=deadline, init_timeout=init_timeout,
                       serving="rank 0"), False


def wait_for_arrivals(store: Any, rank: int, topo: Topology, deadline: float, *, where: str,
                      init_timeout: float, serves_it: bool, generation: int | None = None) -> None:
    """Step 3: return once every rank has set its key in ``store``; else name the absent ranks by ``deadline``.
    ``generation`` (default: this process's next) names the round; every rank must use the same."""
    if generation is None:
        generation = next_generation()
    base, world = f"robustdist/rendezvous/{generation}", topo.world_size
    try:
        store_barrier.barrier(store, base, rank, world, deadline, value=node_label(), first=0.02, most=0.5,
                              linger=_LINGER_S if serves_it else 0.0)  # the others read the names from this store
        log.debug("all %d ranks arrived at the rendezvous (%s)", world, where)
        return
    except store_barrier.Absent as e:
        absent = e
    except (RuntimeError, OSError, ValueError) as e:  # DistError is a RuntimeError
        lost = InitError(
            f"the c10d store at {where} stopped answering while this rank waited for the others to arrive ({e}). "
            "Expected it to stay up until every rank had arrived. Fix: the rank serving it (rank 0, or torchrun's "
            "agent on the master node) failed or exited: see its log; its error names the ranks that were absent.",
            rank=rank)
        lost.store_lost = True  # type: ignore[attr-defined]
        raise lost from e
    if absent.garbled is not None:
        raise InitError(f"the rendezvous read {absent.garbled[:200]!r} from the key {base + '/abandoned'!r} of the "
                        f"c10d store at {where}; expected the JSON list of absent ranks (0 to {world - 1}, each once) "
                        "a rank of this job writes when it gives up waiting. Fix: another process writes into this "
                        "job's store (a second job on the same MASTER_ADDR:MASTER_PORT, or a stale one): give each "
                        "job its own port.", rank=rank)
    missing = list(absent.absent)
    if rank in missing:  # the others gave up before this rank came: their list names it, not the ones to blame
        raise InitError(
            f"this rank reached the rendezvous (the c10d store at {where}) after the other ranks stopped waiting: "
            f"they waited {init_timeout:g} s (distributed.init_timeout) and found {ranks_phrase(missing)} absent, "
            "this rank among them. Expected every rank to reach init within init_timeout of the first. Fix: find "
            "what delayed this rank before init (its log: slow imports, data loading, or, in a process that "
            "re-initialises, the step that held it); raise distributed.init_timeout if the delay is expected.",
            rank=rank, ranks=missing)
    raise _absent(missing, topo, rank, where, init_timeout)


def _absent(missing: list[int], topo: Topology, rank: int, where: str, init_timeout: float) -> InitError:
    per_node = topo.local_world_size
    nodes = sorted({r // per_node for r in missing})
    on = f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} if every node runs {per_node} rank(s)"
    return InitError(
        f"{ranks_phrase(missing)} did not arrive at the rendezvous (the c10d store at {where}) within "
        f"{init_timeout:g} s (distributed.init_timeout): {topo.world_size - len(missing)} of {topo.world_size} ranks "
        f"did. Expected all {topo.world_size} ranks (WORLD_SIZE) to start and connect. Fix: check that "
        f"{ranks_phrase(missing)} ({on}) started and reached init (the launcher's log on that node), and that "
        "WORLD_SIZE (--nnodes x --nproc_per_node) matches the processes launched; raise distributed.init_timeout "
        "if nodes start slowly.", rank=rank, ranks=missing)


def for_group(store: Any, timeout_s: float) -> Any:
    """The store as ``init_process_group`` would use one from its handlers: the collective timeout, and the
    ``default_pg`` prefix (so keys match what a plain ``init_process_group`` writes).

    From this process's second round on, the prefix also carries the round's generation: a rank-0-served store
    is multi-tenant, so rank 0 re-initialising while something still holds its previous group (a DDP or FSDP
    model the script kept) serves the new group from the previous store, keys and all, and gloo would read the
    previous group's addresses from it."""
    store.set_timeout(timedelta(seconds=timeout_s))
    return dist.PrefixStore("default_pg" if _generation <= 1 else f"default_pg/{_generation}", store)
