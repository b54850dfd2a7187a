"""TCP ports for tests on one machine that no other test takes before their user binds them.

A port that was merely free a moment ago (bind to port 0, close, hand out) can be taken by anyone before its
user binds it. Under the parallel test suite that happened: another test's launcher listened on the port that
:func:`~robustdist.testing.ranks.run_ranks` had chosen, and rank 0 failed with ``EADDRINUSE``. Every such picker
(this module's old one, ``torchrun --standalone``, Ray) and every outgoing connection draws from the kernel's
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``). So the ports here come from below that range
(``20000`` up, above Ray's worker ports), and each one is handed out once per :data:`HOLD_S` across every process
of this user on the machine: a small registry file in the temporary directory, read and written under ``flock``.
Where no such range or registry is available, a port is drawn the old way (bind to port 0).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import stat
import tempfile
import time
from collections.abc import Iterator

__all__ = ["HOLD_S", "free_port", "reserve_port"]

HOLD_S = 3600.0  #: a port handed out is not handed out again for this long (longer than any test)
_LOW = 20000  # Ray's worker ports end at 19999 by default
_MAX_REGISTRY = 1 << 20  # bytes read from the registry: it holds one short line per port handed out in HOLD_S


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
    if span is not None:
        with _registry() as handed:
            if handed is not None:
                found = _draw(span, handed, keep)
                if found is not None:
                    return found
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
    """The port if nothing at all is bound to it (any address, ``TIME_WAIT`` included), kept bound if ``keep``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", port))
    except OSError:
        return None
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
    written back on exit; ``None`` where the registry is not this user's private directory (then nothing is
    recorded). Malformed lines are dropped: the file is only ever written here."""
    directory = os.path.join(tempfile.gettempdir(), f"robustdist-ports-{os.getuid()}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{directory} is not a private directory of this user")
        fd = os.open(os.path.join(directory, "handed"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        handed = _parse(os.pread(fd, _MAX_REGISTRY, 0), time.time())
        yield handed
        data = "".join(f"{port} {at:.0f}\n" for port, at in sorted(handed.items())).encode("ascii")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def _parse(raw: bytes, now: float) -> dict[int, float]:
    handed: dict[int, float] = {}
    for line in raw.decode("ascii", errors="replace").splitlines():
        parts = line.split()
        if len(parts) != 2 or not (parts[0].isdigit() and parts[1].isdigit()):
            continue
        port, at = int(parts[0]), float(parts[1])
        if 0 < port < 65536 and now - HOLD_S < at <= now + 60:
            handed[port] = at
    return handed
