"""Handing the job's store over from one in-process recovery generation to the next (:mod:`.loop`).

Each generation gets a fresh store: rank 0, which serves it on the job's port (the launcher's store, or torch's),
lets the old one go once every rank has left it (:func:`leave`), and the next generation's rendezvous serves a new
one on the same port. The other ranks let go of the old store first (their open connections would keep the
closing server waiting, up to 5 s), then wait (bounded) until the server on the port is a new one
(:func:`await_new_server`), so their rendezvous never reaches the old server in its last moments. A server that
outlives its generation (held by a part of it left behind: an in-memory save stuck in a collective) is marked as
kept by rank 0 (:func:`mark_kept`), and the next generation is served by it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from robustdist.runtime.deadline import bounded
from robustdist.runtime.log import get_logger
from robustdist.runtime.store_barrier import wait_for

__all__ = ["PROBE_S", "await_new_server", "leave", "mark_kept"]

log = get_logger(__name__)
PROBE_S = 1.0  # a look at the job's store port while generations change over: short, and repeated
PROBE_ENDS_S = 15.0  # a look left behind ends by then (a store client's own bound): joined at exit, not cut


def leave(store: Any, scope: str, gen: int, rank: int, world: int, timeout: float = 10.0) -> None:
    """Say this rank is done with generation ``gen``'s store; rank 0 waits (bounded) until every rank has said so
    before letting it go, so no rank still reading the decisions loses it."""
    base = f"{scope}/{gen}/left"
    deadline = time.monotonic() + timeout
    try:
        store.set(f"{base}/{rank}", "1")
        if rank == 0:
            wait_for(store, [f"{base}/{r}" for r in range(world)], deadline)
    except Exception as e:  # the store is gone: nothing left to wait for
        log.debug("rank %d: leaving generation %d's store: %s", rank, gen, e)


def await_new_server(connect: Callable[[], Any], address: tuple[Any, Any], scope: str, gen: int, rank: int,
                      timeout: float = 10.0) -> None:
    """A rank other than 0, where rank 0 serves the store on the job's port: once this rank holds nothing of
    generation ``gen``'s store (a server closing waits, up to 5 s, for the connections still open to it), wait
    (bounded) until the server on that port is a new one (it lacks this rank's "left" key), or rank 0 has marked
    the old one as kept (:func:`mark_kept`; the next generation is then served by it): the next generation's
    rendezvous would otherwise reach the old server in its last moments, and lose it. Each look is a connection
    of its own, on a thread of its own given :data:`PROBE_S` (a store client that meets a server in its last
    moments, or in its first, can wait seconds), so the old server's end says nothing in the log and costs no more
    than a look."""
    key, kept = f"{scope}/{gen}/left/{rank}", f"{scope}/{gen}/left/kept"

    def look() -> bool:  # True: the old server, not marked as kept
        probe = connect()
        return bool(probe.check([key]) and not probe.check([kept]))

    deadline = time.monotonic() + timeout
    pause, seen = 0.02, "nothing"
    while time.monotonic() < deadline:
        try:
            if address[0] and address[1]:  # nothing listening yet: look again soon (a store client backs off)
                with socket.create_connection(address, timeout=PROBE_S):
                    pass
            old, error, finished = bounded(look, time.monotonic() + PROBE_S, "store-probe",
                                           ends_by=time.monotonic() + PROBE_ENDS_S)
            if error is not None:
                raise error
            if finished and not old:
                return
            seen = "the old server, still up" if finished else "a server that did not answer within 1 s"
        except Exception as e:  # nothing listens yet, or the old server closed as this connected
            seen = f"no server ({type(e).__name__})"
            log.debug("rank %d: looking for generation %d's store to close: %s", rank, gen, e)
        time.sleep(pause)
        pause = min(0.5, pause * 1.5)  # many ranks look at one port: back off
    log.info("rank %d: no new store on rank 0's port after %g s (last seen: %s); going on to the next "
             "generation's rendezvous, which waits for rank 0 as usual", rank, timeout, seen)


def mark_kept(connect: Callable[[], Any], address: tuple[Any, Any], scope: str, gen: int) -> None:
    """Rank 0, once it holds nothing of generation ``gen``'s store: a server that still answers is held by a part
    of that generation left behind (an in-memory save stuck in a collective, until that collective's timeout). Say
    so in it, so the other ranks stop waiting for a new server (:func:`await_new_server`): the next generation is
    served by this one (torch shares a port's server within a process)."""
    def mark() -> bool:
        probe = connect()
        if not probe.check([f"{scope}/{gen}/left/0"]):
            return False
        probe.set(f"{scope}/{gen}/left/kept", "1")
        return True

    deadline = time.monotonic() + 3 * PROBE_S
    while True:
        try:  # refused at once where the server closed (the usual case): no store client, no wait
            with socket.create_connection(address, timeout=PROBE_S):
                pass
        except OSError as e:
            log.debug("rank 0: generation %d's store is closed (%s)", gen, e)
            return
        kept, error, finished = bounded(mark, time.monotonic() + PROBE_S, "store-kept",
                                        ends_by=time.monotonic() + PROBE_ENDS_S)
        if finished and error is None:
            if kept:
                log.info("rank 0: generation %d's store outlives it (a part of that generation left behind holds "
                         "it); the next generation is served by it", gen)
            return
        if time.monotonic() >= deadline:
            log.info("rank 0: could not tell whether generation %d's store outlives it (%s); the other ranks wait "
                     "for a new one, within their bound", gen, error or "no answer within 1 s")
            return
        time.sleep(0.05)
