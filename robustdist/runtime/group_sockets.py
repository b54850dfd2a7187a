"""Unblock a gloo collective in progress by shutting down its group's connections (in-process recovery, #34).

A rank blocked in a gloo collective whose peer will never join (the peer raised outside any collective, hangs,
or was partitioned) stays blocked until the group's timeout (``distributed.timeout``; torch's default 30 min):
gloo's ``ProcessGroup.abort()`` (torch 2.13) returns at once but does not unblock it; only the peer's socket
closing does. A process that means to recover in place, without a restart, needs another way out.

:class:`GroupSockets` records the sockets a block of code opens (``with sockets.recording(): new_group(...)``),
each by file descriptor *and* inode, so a descriptor number the process later reuses for another socket is never
touched. :meth:`GroupSockets.unblock` shuts each recorded connection down (``shutdown(SHUT_RDWR)`` on a
duplicate of the descriptor, which acts on the connection itself): the collective in progress here fails at
once ("Connection closed by peer"), and so does every peer's, since its end of the connection closes too. The
descriptors stay open and gloo keeps owning them; destroying the group afterwards closes them as usual.

Rules learnt by trying (torch 2.13, gloo):

* a *listening* socket is never shut down: gloo's listener thread then fails an ``accept`` and torch aborts the
  process (``gloo::EnforceNotMet ... accept: Invalid argument``); listeners are left alone;
* connections to the c10d store's port are left alone (``exclude_ports``): the store outlives the group, and
  in-process recovery uses it to agree on the next generation;
* the recording window must hold only the group's creation: any socket another thread opens in it is recorded
  too. robustdist records around its own ``init_process_group``/``new_group`` calls only.

Standard library only (floor 0 of the runtime): no torch or gloo internals are read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator

__all__ = ["GroupSockets", "open_sockets"]

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """``{fd: "socket:[inode]"}`` for every socket this process holds (empty where ``/proc`` is missing)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


class GroupSockets:
    """The connections of one or more process groups, recorded at creation, that :meth:`unblock` shuts down."""

    def __init__(self, *, exclude_ports: Iterable[int] = ()) -> None:
        self._exclude = {int(p) for p in exclude_ports}
        self._recorded: dict[int, str] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._recorded)

    @contextlib.contextmanager
    def recording(self) -> Iterator[GroupSockets]:
        """Record every socket opened inside the block (those open before it, or replaced in it, aside)."""
        before = open_sockets()
        try:
            yield self
        finally:
            new = {fd: link for fd, link in open_sockets().items() if before.get(fd) != link}
            kept = {fd: link for fd, link in new.items() if self._belongs(fd, link)}
            with self._lock:
                self._recorded.update(kept)
            log.debug("recorded %d socket(s) of a group (%d opened, listeners and the store's left out)",
                      len(kept), len(new))

    def unblock(self) -> int:
        """Shut down every recorded connection still open as the same socket; returns how many. Safe from any
        thread, repeatable, never raises: a socket already closed, or a descriptor now naming another socket, is
        skipped."""
        with self._lock:
            recorded = dict(self._recorded)
        done = 0
        for fd, link in recorded.items():
            sock = _same_socket(fd, link)
            if sock is None:
                continue
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            except OSError:  # not connected (any more): nothing to unblock
                pass
            finally:
                sock.close()  # the duplicate only; the group's own descriptor stays open
        log.debug("shut down %d of %d recorded group connection(s)", done, len(recorded))
        return done

    def forget(self) -> None:
        """Drop every record (after the group is destroyed: its descriptor numbers will be reused)."""
        with self._lock:
            self._recorded.clear()

    def _belongs(self, fd: int, link: str) -> bool:
        sock = _same_socket(fd, link)
        if sock is None:
            return False
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) or sock.type != socket.SOCK_STREAM:
                return False
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            try:
                peer = sock.getpeername()
            except OSError:  # not connected: nothing a collective waits on
                return False
            return int(peer[1]) not in self._exclude
        except OSError:
            return False
        finally:
            sock.close()


def _same_socket(fd: int, link: str) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` if ``fd`` still names the socket ``link``, else None. The check
    is made on the duplicate, which holds the socket open: no other socket can take its place meanwhile."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.readlink(f"{_FD_DIR}/{dup}") != link:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:
        with contextlib.suppress(OSError):
            os.close(dup)
        return None
