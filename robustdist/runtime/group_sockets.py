"""Unblock a gloo collective in progress by shutting down its group's connections (in-process recovery).

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
* a connection with the c10d store's port at either end is left alone (``exclude_ports``): on the rank that
  serves the store, the server's accepted connections have the store's port as their *local* port; the store
  outlives the group, and in-process recovery uses it to agree on the next generation;
* an accepted connection is kept only if it came through a listener opened in the same window (gloo's), so a
  server of the process that accepted a connection meanwhile (the store's, any other) is left alone; an
  outbound connection opened in the window by another thread (a Ray or HTTP client) cannot be told from
  gloo's and would be recorded too: the window should hold only the group's creation;
* gloo connects on first use with ``TORCH_GLOO_LAZY_INIT=1``, after the window: nothing is recorded, and
  :meth:`GroupSockets.unblock` returns 0. A caller treats 0 as "cannot unblock" (a real restart), never as
  success; :attr:`GroupSockets.lazy` says when that variable was set.

Standard library only (floor 0 of the runtime): no torch or gloo internals are read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator

__all__ = ["GroupSockets", "close_listeners", "listens_on", "open_sockets", "sockets_on_port"]

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


def close_listeners() -> list[int]:
    """Close this process's listening TCP sockets; return their ports. For a process forked from a rank that never
    accepts a connection (a DataLoader worker): its copies of the rank's listeners (the c10d store's server, gloo's)
    would keep their ports bound after the rank closes its own, and the rank could not serve its next store on the
    job's port (an in-process recovery's next generation: ``EADDRINUSE``). The rank's own listeners stay open.
    Call it before the process starts a thread: a descriptor is checked, then replaced. Each listener's descriptor
    is pointed at ``/dev/null`` rather than closed, so the number stays taken: an object that owns it closes
    ``/dev/null`` later, never a file that reused the number."""
    closed = []
    listeners = [(fd, port) for fd, link in open_sockets().items() if (port := _listening_port(fd, link)) is not None]
    if not listeners:
        return closed
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd, port in listeners:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
                closed.append(port)
    finally:
        os.close(null)
    return closed


def listens_on(port: int) -> bool:
    """Whether this process holds a TCP socket listening on ``port`` (False where ``/proc`` is missing)."""
    return any(_listening_port(fd, link) == port for fd, link in open_sockets().items())


def sockets_on_port(port: int) -> int:
    """How many of this process's TCP sockets have ``port`` at either end: a server listening on it, the
    connections it accepted, and connections to it (0 where ``/proc`` is missing)."""
    count = 0
    for fd, link in open_sockets().items():
        sock = _same_socket(fd, link)
        if sock is None:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                ends = [sock.getsockname()]
                with contextlib.suppress(OSError):  # not connected: a listener
                    ends.append(sock.getpeername())
                count += any(end[1] == port for end in ends)
        except OSError:
            pass
        finally:
            sock.close()
    return count


class GroupSockets:
    """The connections of one or more process groups, recorded at creation, that :meth:`unblock` shuts down."""

    def __init__(self, *, exclude_ports: Iterable[int] = ()) -> None:
        self._exclude = {int(p) for p in exclude_ports}
        self._recorded: dict[int, str] = {}
        self._lock = threading.Lock()
        self.lazy = False  # TORCH_GLOO_LAZY_INIT was set at the last recording: nothing of gloo's was recorded

    def __len__(self) -> int:
        with self._lock:
            return len(self._recorded)

    @contextlib.contextmanager
    def recording(self) -> Iterator[GroupSockets]:
        """Record every connection opened inside the block (sockets open before it, or replaced in it, aside)."""
        self.lazy = os.environ.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() not in ("", "0", "false")
        if self.lazy:
            log.warning("TORCH_GLOO_LAZY_INIT is set: gloo connects on first use, after the group is created, so "
                        "its connections cannot be recorded and a collective in progress cannot be unblocked in "
                        "place (a fault will need a process restart). Fix: unset TORCH_GLOO_LAZY_INIT.")
        before = open_sockets()
        try:
            yield self
        finally:
            after = open_sockets()
            new = {fd: link for fd, link in after.items() if before.get(fd) != link}
            listening = {fd: port for fd, link in after.items() if (port := _listening_port(fd, link)) is not None}
            window_listeners = {port for fd, port in listening.items() if fd in new}
            kept = {fd: link for fd, link in new.items()
                    if fd not in listening and self._belongs(fd, link, set(listening.values()), window_listeners)}
            with self._lock:
                self._recorded.update(kept)
            log.debug("recorded %d connection(s) of a group (%d socket(s) opened, listeners and the store's left "
                      "out)", len(kept), len(new))

    def exclude(self, *ports: int) -> None:
        """Leave connections with any of ``ports`` at either end alone from now on (a store's port learnt after
        the recording): :meth:`unblock` checks them again."""
        with self._lock:
            self._exclude.update(int(p) for p in ports)

    def unblock(self) -> int:
        """Shut down every recorded connection still open as the same socket; returns how many (0: nothing could
        be unblocked, the caller restarts the process instead). Safe from any thread, repeatable, never raises: a
        socket already closed, or a descriptor now naming another socket, is skipped."""
        with self._lock:
            recorded = dict(self._recorded)
        done = 0
        for fd, link in recorded.items():
            sock = _same_socket(fd, link)
            if sock is None:
                continue
            try:
                ends = {int(sock.getsockname()[1]), int(sock.getpeername()[1])}
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and not ends & self._exclude:
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

    def _belongs(self, fd: int, link: str, listener_ports: set[int], window_listeners: set[int]) -> bool:
        sock = _same_socket(fd, link)
        if sock is None:
            return False
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            local = int(sock.getsockname()[1])
            try:
                peer = int(sock.getpeername()[1])
            except OSError:  # not connected: nothing a collective waits on
                return False
            if local in self._exclude or peer in self._exclude:
                return False
            if local in listener_ports:  # accepted by a server of this process: only gloo's, opened in the window
                return local in window_listeners
            return True
        except OSError:
            return False
        finally:
            sock.close()


def _listening_port(fd: int, link: str) -> int | None:
    sock = _same_socket(fd, link)
    if sock is None:
        return None
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and sock.family in (socket.AF_INET,
                                                                                        socket.AF_INET6):
            return int(sock.getsockname()[1])
        return None
    except OSError:
        return None
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
