"""Before gloo's full-mesh connect: can every node reach the address gloo binds on every other node?

gloo listens on one address per rank (``GLOO_SOCKET_IFNAME``'s interface, else the first address of this
host's hostname that binds, else loopback) and peers connect to it from whatever source address their kernel
picks. If that address is on an interface no other node reaches (a second NIC, a ``127.0.1.1`` hostname),
``init_process_group`` waits for the full timeout (30 minutes by default) and says nothing useful.
:func:`check_peers` finds that in seconds and names the rank, the interface, the peers and the interfaces that
work.

**Protocol** (every rank, after the c10d store is connected, before ``init_process_group``; keys live under
``robustdist/reach/<generation>``, the generation counting calls in this process, so it is the same on every
rank; a list is a counter ``<list>/n`` and items ``<list>/<i>``, written with ``add`` and ``set``, atomic on
every store):

1. Each rank works out where gloo will bind and which network stack it is on (:func:`node_key`: boot id and
   network namespace). Ranks sharing a stack and a bind address form a *group*; the first to ``add`` the
   group's counter is its *representative*: it opens a listener on the bind address and on each of this
   host's other IPv4 addresses (port 0; each answers with a token naming the rank), sets its description
   (``desc/<rank>``) and adds its rank to the ``reps`` list. Every rank adds itself to its group's member list
   and counts itself in; the last to arrive sets ``all``. A rank whose bind address cannot be told (its
   hostname does not resolve in time) takes no part in the probes.
2. Every rank waits for ``all`` (bounded). On a timeout it names the ranks that never arrived.
3. Each representative reads the others' descriptions and connects, in parallel threads, to the bind
   address of every representative on another network stack, as gloo does (no source address bound). Where
   that fails it tries, in a second parallel round, the target's other addresses (which interfaces of that
   node *would* work) and its own other source addresses (whether its own routing is at fault). It adds
   its failures, if any, to the ``failures`` list and counts itself done; the last one sets ``probed``. Ranks on the
   same stack are not probed: their traffic stays on the host.
4. Every rank waits for ``probed`` (bounded; on a timeout it names the representatives that did not finish)
   and closes its listeners. No ``failures`` key: done. Otherwise every rank reads the failures, the
   descriptions and the member lists and builds the error from them alone, so every rank raises the *same*
   :class:`InitError`; rank 0 (usually the store's host) then waits briefly until every rank has read them.

Cost on success: a constant number of store round trips per rank and a few bytes each, except that each
representative reads every representative's description; one connection per pair of network stacks (per
distinct bind address), so N nodes make N*(N-1) probes however many ranks each runs, with up to 64 in flight
per representative. Time: milliseconds when all is well, about two connect timeouts (2 s each) on a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from robustdist.init import reach_store as _store
from robustdist.init.reach_verdict import MAX_DIAGNOSED, build_message, diagnose, ranks_phrase
from robustdist.runtime import netenv
from robustdist.runtime.errors import InitError
from robustdist.runtime.log import get_logger
from robustdist.runtime.node import interface_address, node_label, node_rank, route_source

__all__ = ["CONNECT_TIMEOUT_S", "check_peers", "gloo_binds", "gloo_default_address", "local_interfaces",
           "node_key", "reaches", "diagnose", "build_message", "ranks_phrase"]

log = get_logger(__name__)
CONNECT_TIMEOUT_S = 2.0  # per connection: a SYN lost once is resent after 1 s
_MAX_THREADS = 256  # connections in flight per representative (they wait, they do not compute)
_MAX_IFACES = 32  # interfaces per host that get a listener and are tried as sources
_generation = 0  # calls in this process: the same sequence on every rank, so keys of repeated calls never collide


# ---------------------------------------------------------------------------------------------- this host
def local_interfaces() -> dict[str, str]:
    """``{name: IPv4 address}`` for this host's interfaces that have one, loopback left out."""
    found = {name: interface_address(name) for name in netenv.interfaces()}
    usable = {name: addr for name, addr in found.items() if addr and not netenv.local_only(addr)}
    return dict(list(usable.items())[:_MAX_IFACES])


def node_key() -> str:
    """Identifies this network stack: ranks with the same key reach each other through the host itself."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/net"))
    except OSError:
        pass  # not Linux: the hostname alone
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def gloo_default_address(timeout: float = 5.0) -> tuple[str | None, str]:
    """Where gloo binds with ``GLOO_SOCKET_IFNAME`` unset, and how that came about; ``(None, why)`` when the
    hostname did not resolve within ``timeout`` (gloo itself would still be waiting)."""
    host = socket.gethostname()
    addresses, error = netenv.resolve_addresses(host, timeout)
    if error is not None and "did not answer" in error:
        return None, f"hostname {host} did not resolve within {timeout:g} s"
    for addr in addresses:  # gloo takes the first address that binds, in resolver order
        try:
            with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return addr, f"its hostname's address, {host} -> {addr} (GLOO_SOCKET_IFNAME is unset)"
        except OSError:
            continue
    return "127.0.0.1", (f"loopback, 127.0.0.1 (GLOO_SOCKET_IFNAME is unset and its hostname {host} resolves to no "
                         "address of this host, so gloo falls back to loopback)")


def gloo_binds(env: Mapping[str, str], timeout: float = 5.0) -> tuple[list[tuple[str | None, str]], str]:
    """``([(interface or None, address), ...], how)``: where gloo will listen; ``([], why)`` when unknown."""
    value = env.get("GLOO_SOCKET_IFNAME", "")
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names:
        binds = [(name, interface_address(name)) for name in names]
        if any(addr is None for _, addr in binds):
            return [], f"GLOO_SOCKET_IFNAME={value} names an interface without an IPv4 address here"
        return [(name, str(addr)) for name, addr in binds], f"GLOO_SOCKET_IFNAME={value}"
    addr, how = gloo_default_address(timeout)
    return ([(None, addr)] if addr else []), how


# ---------------------------------------------------------------------------------------------- sockets
def _connect(src: str | None, addr: str, port: int, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        if src:
            sock.bind((src, 0))
        sock.connect((addr, port))
        return sock
    except BaseException:
        sock.close()
        raise


def _failure(e: OSError, timeout: float) -> str:
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"no answer to a TCP connect within {timeout:g} s"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    return e.strerror or str(e) or type(e).__name__


def reaches(src: str | None, host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> tuple[bool, str]:
    """Whether a TCP connect from ``src`` (None: the kernel's choice) to ``host:port`` gets an answer. A
    refused connection counts: the route works, nothing listens. Returns ``(reached, what happened)``."""
    try:
        _connect(src, host, port, timeout).close()
    except ConnectionRefusedError:
        return True, "refused (nothing listens there yet, but the route works)"
    except (OSError, OverflowError, ValueError) as e:
        return False, _failure(e, timeout) if isinstance(e, OSError) else str(e)
    return True, "connected"


def probe(src: str | None, addr: str, port: int, token: bytes, timeout: float) -> tuple[bool, str]:
    """Connect to a :class:`Listeners` socket and check that it answers ``token`` (not some other process)."""
    start = time.monotonic()
    try:
        sock = _connect(src, addr, port, timeout)
    except OSError as e:
        return False, _failure(e, timeout)
    data = b""
    with sock:
        sock.settimeout(max(0.2, timeout - (time.monotonic() - start)))
        try:
            while len(data) < len(token) and (chunk := sock.recv(len(token) - len(data))):
                data += chunk
        except OSError:
            pass
    if data == token:
        return True, "connected"
    return False, f"another process answered there ({data[:40]!r} instead of this job's token)"


class Listeners:
    """TCP listeners on ``addrs`` (port 0) that answer every connection with ``token``, from one thread."""

    def __init__(self, addrs: Sequence[str], token: bytes, backlog: int = 128):
        self.token = token
        self.ports: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self._socks: list[socket.socket] = []
        for addr in dict.fromkeys(addrs):
            sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.bind((addr, 0))
                sock.listen(min(backlog, socket.SOMAXCONN))
            except OSError as e:
                sock.close()
                self.errors[addr] = e.strerror or str(e)
                continue
            self._socks.append(sock)
            self.ports[addr] = int(sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="robustdist-reach-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            for sock in self._socks:
                sel.register(sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(0.05):
                    try:
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    except OSError:
                        continue
                    with conn:
                        conn.settimeout(0.5)
                        try:
                            conn.sendall(self.token)
                        except OSError:
                            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for sock in self._socks:
            sock.close()


# ---------------------------------------------------------------------------------------------- protocol
def _token(prefix: str, rank: int) -> bytes:
    return f"robustdist-reach {prefix} rank {rank}\n".encode()


def _store_wait(store: Any, keys: list[str], deadline: float, missing: Callable[[], str], rank: int) -> None:
    try:
        store.wait(keys, timedelta(seconds=max(0.01, deadline - time.monotonic())))
    except RuntimeError as e:  # a timeout (DistStoreError) or a lost store (DistNetworkError, re-raised)
        if time.monotonic() < deadline - 0.05:
            raise
        raise InitError(f"the gloo reachability check (before init_process_group) timed out: {missing()}; "
                        "expected every rank to start and reach init together. Fix: look for an earlier error "
                        "in the log of the ranks named, or raise distributed.init_timeout if nodes start slowly.",
                        rank=rank) from e


def _absent(store: Any, keys: dict[int, str]) -> list[int]:
    out = []
    for r, key in keys.items():
        try:
            if not store.check([key]):
                out.append(r)
        except RuntimeError:
            out.append(r)
    return out


def _describe(rank: int, env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    binds, how = gloo_binds(env, timeout)
    default = binds[0][1] if binds and not env.get("GLOO_SOCKET_IFNAME") else gloo_default_address(timeout)[0]
    me = {"rank": rank, "node": node_key(), "label": node_label(env), "node_rank": node_rank(env), "how": how,
          "binds": [{"if": name, "addr": addr} for name, addr in binds], "default": default,
          "ifaces": [{"if": name, "addr": addr} for name, addr in sorted(local_interfaces().items())]}
    me["group"] = f"{me['node']}|{','.join(b['addr'] for b in me['binds'])}"
    return me


def check_peers(store: Any, rank: int, world_size: int, *, timeout_s: float, env: Mapping[str, str] = os.environ,
                connect_timeout_s: float = CONNECT_TIMEOUT_S, generation: int | None = None) -> None:
    """Every rank, before ``init_process_group``: raise :class:`InitError` (the same on every rank) when some
    node cannot connect to the address gloo binds on another; see the module docstring for the protocol.

    Args:
        store: the job's c10d store (``TCPStore`` or ``PrefixStore``), already connected.
        rank, world_size: this rank and the job's size.
        timeout_s: bound on the whole check (waiting for late ranks included).
        env: where ``GLOO_SOCKET_IFNAME`` and the node rank are read.
        connect_timeout_s: bound on one connection attempt.
        generation: the key namespace (default: the next of this process's calls; a test that plays two ranks
            in one process passes the same value to both).
    """
    global _generation
    if world_size <= 1:
        return
    if generation is None:
        _generation += 1
        generation = _generation
    prefix = f"robustdist/reach/{generation}"
    deadline = time.monotonic() + timeout_s
    ct = max(0.2, min(connect_timeout_s, timeout_s / 5))
    me = _describe(rank, env, ct)
    if not me["binds"]:
        log.warning("cannot tell where gloo will bind (%s): this rank's address is left out of the reachability "
                    "check", me["how"], all_ranks=True)
    listeners: Listeners | None = None
    try:
        if me["binds"] and int(store.add(f"{prefix}/rep/{me['group']}", 1)) == 1:
            listeners = _listen(store, prefix, me, world_size)
        _push(store, f"{prefix}/members/{me['group']}", str(rank))
        store.set(f"{prefix}/arrived/{rank}", "1")
        if int(store.add(f"{prefix}/count", 1)) == world_size:
            store.set(f"{prefix}/all", "1")
        arrived = {r: f"{prefix}/arrived/{r}" for r in range(world_size)}
        _store_wait(store, [f"{prefix}/all"], deadline - 3 * ct, lambda: ranks_phrase(_absent(store, arrived))
                    + f" did not arrive within {timeout_s - 3 * ct:.3g} s", rank)
        if not _store.count(store, f"{prefix}/reps/n", world_size):
            return  # no rank could tell where gloo binds: nothing to probe
        if listeners is not None:
            _probe_and_publish(store, prefix, me, ct, world_size)
        _store_wait(store, [f"{prefix}/probed"], deadline, lambda: ranks_phrase(_absent(store, {
            r: f"{prefix}/probed/{r}" for r in _store.rep_ranks(store, prefix, world_size)})) + " did not finish probing",
            rank)
        ranks = _store.rep_ranks(store, prefix, world_size)
        failures = [_store.stored(f"{prefix}/failures/{i}", v, lambda f: _store.failures_of(f, ranks))
                    for i, v in enumerate(_store.items(store, f"{prefix}/failures", world_size), 1)]
        if not failures:
            log.debug("gloo reachability: every node reaches every other node's gloo address")
            return
        reps = _store.descriptions(store, prefix, ranks, world_size)
        problems = diagnose(list(reps.values()), {f["prober"]: f["failures"] for f in failures})
        members = {r["group"]: _store.member_ranks(store, prefix, r["group"], world_size) for r in reps.values()}
        _ack(store, prefix, rank, world_size, ct)
    except InitError as e:
        if e.rank is None:  # a value read from the store: the rank that read it
            raise InitError(e.message, rank=rank) from None
        raise
    except RuntimeError as e:
        raise InitError(f"the c10d store failed during the gloo reachability check ({e}); expected it to stay up "
                        "until init. Fix: check the log of the rank hosting the store (MASTER_ADDR) for an "
                        "earlier error.", rank=rank) from e
    finally:
        if listeners is not None:
            listeners.close()
    message, blamed = build_message(problems, reps, members)
    raise InitError(message, rank=rank, ranks=blamed)


def _listen(store: Any, prefix: str, me: dict[str, Any], world_size: int) -> Listeners:
    """A representative opens its listeners and publishes its description (under ``desc/<rank>``)."""
    listeners = Listeners([b["addr"] for b in me["binds"]] + [i["addr"] for i in me["ifaces"]],
                          _token(prefix, me["rank"]), backlog=world_size)
    for item in me["binds"] + me["ifaces"]:
        item["port"] = listeners.ports.get(item["addr"])
    me["error"] = "; ".join(f"{b['addr']}: {listeners.errors[b['addr']]}" for b in me["binds"]
                            if b["addr"] in listeners.errors) or None
    try:
        store.set(f"{prefix}/desc/{me['rank']}", json.dumps(me))
        _push(store, f"{prefix}/reps", str(me["rank"]))
    except BaseException:
        listeners.close()
        raise
    return listeners


def _probe_and_publish(store: Any, prefix: str, me: dict[str, Any], ct: float, world_size: int) -> None:
    """A representative probes the others, publishes its failures (if any), and counts itself done; the last
    one sets ``probed``, which every rank waits for. Only representatives read the descriptions."""
    ranks = _store.rep_ranks(store, prefix, world_size)
    reps = list(_store.descriptions(store, prefix, ranks, world_size).values())
    failures = _probe_all(me, reps, prefix, ct)
    if failures or me.get("error"):
        _push(store, f"{prefix}/failures", json.dumps({"prober": me["rank"], "failures": failures}))
    store.set(f"{prefix}/probed/{me['rank']}", "1")
    if int(store.add(f"{prefix}/probed_count", 1)) == len(ranks):
        store.set(f"{prefix}/probed", "1")


def _push(store: Any, key: str, value: str) -> None:
    """Add ``value`` to the list ``key`` with ``add`` and ``set`` only: atomic on every store (``append`` is
    not on a FileStore)."""
    store.set(f"{key}/{int(store.add(f'{key}/n', 1))}", value)


def _ack(store: Any, prefix: str, rank: int, world_size: int, timeout: float) -> None:
    """On failure: keep rank 0 (usually the store's host) up until every rank has read what it needs."""
    store.set(f"{prefix}/read/{rank}", "1")
    if rank == 0:
        try:
            store.wait([f"{prefix}/read/{r}" for r in range(world_size)], timedelta(seconds=timeout))
        except RuntimeError:
            pass


def _probe_all(me: dict[str, Any], reps: list[dict[str, Any]], prefix: str, ct: float) -> list[dict[str, Any]]:
    """This representative's probes of every other stack's bind addresses, as gloo connects (no source bound);
    for each failure, a second parallel round tells which other addresses of the target this host reaches
    (``theirs``) and which of this host's other source addresses reach the target (``mine``). Returns the
    failures."""
    targets = [(t, b) for t in reps if t["node"] != me["node"] for b in t["binds"] if b.get("port")]
    if not targets:
        return []
    with ThreadPoolExecutor(min(_MAX_THREADS, len(targets)), thread_name_prefix="robustdist-reach") as pool:
        first = pool.map(lambda tb: probe(None, tb[1]["addr"], tb[1]["port"], _token(prefix, tb[0]["rank"]), ct),
                         targets)
        failed = [(t, b, detail) for (t, b), (ok, detail) in zip(targets, first) if not ok]
        report = [{"target": t["rank"], "addr": b["addr"], "detail": detail, "theirs": [], "mine": [],
                   "diagnosed": n < MAX_DIAGNOSED} for n, (t, b, detail) in enumerate(failed)]
        jobs: list[tuple[dict[str, Any], str, str, tuple[str | None, str, int, bytes]]] = []
        for item, (t, b, _) in zip(report[:MAX_DIAGNOSED], failed):
            token, default_src = _token(prefix, t["rank"]), route_source(b["addr"])
            jobs += [(item, "theirs", i["if"], (None, i["addr"], i["port"], token))
                     for i in t["ifaces"] if i.get("port") and i["addr"] != b["addr"]]
            jobs += [(item, "mine", i["if"], (i["addr"], b["addr"], b["port"], token))
                     for i in me["ifaces"] if i["addr"] != default_src]
        for (item, side, name, _), (ok, _) in zip(jobs, pool.map(lambda job: probe(*job[3], ct), jobs)):
            if ok:
                item[side].append(name)
    for item in report:
        log.debug("cannot reach rank %d at %s (%s); their interfaces that work: %s; mine: %s", item["target"],
                  item["addr"], item["detail"], item["theirs"], item["mine"], all_ranks=True)
    return report
