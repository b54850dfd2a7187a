"""TCP ports for tests on one machine that no other test takes before their user binds them.

A port that was merely free a moment ago (bind to port 0, close, hand out) can be taken by anyone before its
user binds it. Under the parallel test suite that happened: another test's launcher listened on the port that
:func:`~robustdist.testing.ranks.run_ranks` had chosen, and rank 0 failed with ``EADDRINUSE``. Every such picker
(this module's old one, ``torchrun --standalone``, Ray) and every outgoing connection draws from the kernel's
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``). So the ports here come from below that range
(``20000`` up, above Ray's worker ports), and each one is handed out once per :data:`HOLD_S` across every process
of this user on the machine: a small registry file, ``/tmp/robustdist-ports-<euid>/handed`` (the directory in
``ROBUSTDIST_TEST_PORTS_DIR`` instead, where set: tests of this module), read and written under ``flock``; the
location does not follow ``TMPDIR``, which a test may give its child processes. Where no such range or registry is
available, a port is drawn the old way (bind to port 0), with a warning: the race is back then.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import socket
import stat
import time
from collections.abc import Iterator

__all__ = ["DIR_ENV", "HOLD_S", "free_port", "reserve_port"]

log = logging.getLogger(__name__)

DIR_ENV = "ROBUSTDIST_TEST_PORTS_DIR"

HOLD_S = 3600.0  #: a port handed out is not handed out again for this long (longer than any test)
_LOW = 20000  # Ray's worker ports end at 19999 by default
_MAX_REGISTRY = 1 << 20  # bytes read from the registry: it holds one short line per port handed out in HOLD_S
_LOCK_S = 10.0  # the longest wait for the registry's lock (a holder stopped in a debugger): then the old way


def free_port() -> int:
    """A TCP port that is free now and that no other caller of this module is handed for :data:`HOLD_S`."""
    return _claim(keep=False)[1]


def reserve_port() -> tuple[socket.socket, int]:
    """Like :func:`free_port`, and kept bound (``SO_REUSEADDR``, not listening) by this process until the
    caller closes the socket.

    While it stays open no ``bind(0)`` and no outgoing connection gets the port, and a server that sets
    ``SO_REUSEADDR`` (``TCPStore`` does) still binds and listens on it.
    """
    sock, port = _claim(keep=True)
    assert sock is not None
    return sock, port


def _span() -> tuple[int, int] | None:
    """The ports to draw from, ``[low, high)``: below the ephemeral range, else above it; ``None`` if neither
    leaves a thousand ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            first, last = (int(v) for v in f.read(64).split())
    except (OSError, ValueError):
        return None
    if first - _LOW >= 1000:
        return _LOW, first
    if 65535 - last >= 1000:
        return last + 1, 65536
    return None


def _claim(keep: bool) -> tuple[socket.socket | None, int]:
    span = _span()
    why = "no port range outside the ephemeral one"
    if span is not None:
        with _registry() as handed:
            why = "no registry of the ports handed out (see the debug log)"
            if handed is not None:
                found = _draw(span, handed, keep)
                if found is not None:
                    return found
                why = f"no free port left in {span[0]}-{span[1] - 1}"
    log.warning("robustdist.testing.ports: %s; drawing a port from the kernel (bind to port 0): another process may "
                "take it before it is bound", why)
    return _ephemeral(keep)


def _draw(span: tuple[int, int], handed: dict[int, float], keep: bool) -> tuple[socket.socket | None, int] | None:
    low, high = span
    start = random.randrange(low, high)
    for i in range(high - low):
        port = low + (start - low + i) % (high - low)
        if port in handed:
            continue
        found = _bind(port, keep)
        if found is not None:
            handed[port] = time.time()
            return found
    return None


def _bind(port: int, keep: bool) -> tuple[socket.socket | None, int] | None:
    """The port if nothing is bound to it on any IPv4 or IPv6 address (``TIME_WAIT`` included), kept bound if
    ``keep``; None if something is. Any other error (no loopback, no sockets) is raised: no port would do."""
    probes = [(socket.AF_INET, ("", port))]
    if socket.has_ipv6:
        probes.append((socket.AF_INET6, ("::", port)))
    for family, address in probes:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel
            continue
        with probe:
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # the IPv4 side too, as TCPStore binds
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return None
                if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:  # IPv6 disabled on the host
                    continue
                raise
    if not keep:
        return None, port
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock, port


def _ephemeral(keep: bool) -> tuple[socket.socket | None, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if keep:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    if keep:
        return sock, port
    sock.close()
    return None, port


@contextlib.contextmanager
def _registry() -> Iterator[dict[int, float] | None]:
    """The ports handed out in the last :data:`HOLD_S` (port -> time), held under an exclusive ``flock`` and
    written back on a clean exit; ``None`` (nothing recorded) where the registry's directory is not this user's
    private one, its file is not a regular file of this user, or the lock is not had within :data:`_LOCK_S`. Malformed
    lines are dropped: the file is only ever written here."""
    fd = _open_registry()
    if fd is None:
        yield None
        return
    try:
        if not _lock(fd):
            log.debug("robustdist.testing.ports: the registry's lock was not had within %g s", _LOCK_S)
            handed = None
        else:
            handed = _parse(os.pread(fd, _MAX_REGISTRY, 0), time.time())
        yield handed
        if handed is not None:
            data = "".join(f"{port} {at:.0f}\n" for port, at in sorted(handed.items())).encode("ascii")
            try:  # written over the old text first, then cut: a kill in between leaves the old entries, not none
                if os.pwrite(fd, data, 0) == len(data):
                    os.ftruncate(fd, len(data))
            except OSError as e:  # a full disk: the port is still good, only not recorded
                log.debug("robustdist.testing.ports: the registry could not be written (%s)", e)
    finally:
        os.close(fd)


def _open_registry() -> int | None:
    """The registry file, opened read-write without following a link anywhere this user does not own; None where
    it cannot be (the reason at debug level)."""
    uid = os.geteuid()
    directory = os.environ.get(DIR_ENV) or os.path.join("/tmp", f"robustdist-ports-{uid}")
    dfd = fd = None
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        st = os.fstat(dfd)
        if st.st_uid != uid or st.st_mode & 0o077:
            raise OSError(f"{directory} is not a private directory of this user")
        fd = os.open("handed", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            raise OSError(f"{directory}/handed is not a regular file of this user")
    except OSError as e:
        log.debug("robustdist.testing.ports: no registry (%s)", e)
        if fd is not None:
            os.close(fd)
        fd = None
    finally:
        if dfd is not None:
            os.close(dfd)
    return fd


def _lock(fd: int) -> bool:
    deadline = time.monotonic() + _LOCK_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        except OSError:  # a filesystem without locks
            return False


def _parse(raw: bytes, now: float) -> dict[int, float]:
    handed: dict[int, float] = {}
    for line in raw.decode("ascii", errors="replace").splitlines():
        parts = line.split()
        if len(parts) != 2 or not (parts[0].isdigit() and parts[1].isdigit()) or len(parts[0]) > 5 \
                or len(parts[1]) > 12:
            continue
        port, at = int(parts[0]), float(parts[1])
        if 0 < port < 65536 and now - HOLD_S < at <= now + 60:
            handed[port] = at
    return handed
