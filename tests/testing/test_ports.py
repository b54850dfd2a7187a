"""robustdist.testing.ports: ports below the ephemeral range, each handed out once across processes; a port anything
holds (IPv4 or IPv6) is skipped; a registry that is not this user's private file, or whose lock is held too long, is
not used (the old way is, with a warning); a malformed one is read as what it validly says."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from robustdist.testing import ports

_DRAW = """
import sys
from robustdist.testing import ports
print(" ".join(str(ports.free_port()) for _ in range(int(sys.argv[1]))))
"""


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A registry of this test's own (for its child processes too)."""
    monkeypatch.setenv(ports.DIR_ENV, str(tmp_path / "ports"))
    return tmp_path / "ports" / "handed"


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_come_from_below_the_ephemeral_range_and_are_recorded(registry):
    if ports._span() is None:
        pytest.skip("this machine's ephemeral range leaves no other ports")
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20
    assert all(20000 <= p < _ephemeral_low() for p in got)
    recorded = {int(line.split()[0]) for line in registry.read_text().splitlines()}
    assert recorded == set(got)


@pytest.mark.processes
def test_no_port_is_handed_out_twice_across_concurrent_processes(registry):
    """The failure this module exists for: another process handed the same port meanwhile."""
    n = 150
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    children = [subprocess.Popen([sys.executable, "-c", _DRAW, str(n)], stdout=subprocess.PIPE, text=True, env=env)
                for _ in range(2)]
    mine = [ports.free_port() for _ in range(n)]
    theirs = []
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        theirs += [int(v) for v in out.split()]
    everything = mine + theirs
    assert len(everything) == 3 * n
    assert len(set(everything)) == 3 * n


def test_a_port_in_use_is_skipped_and_a_full_range_falls_back_to_the_kernel(registry, monkeypatch):
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(ports, "_span", lambda: (taken - 1, taken + 1))
        first = ports.free_port()
        assert first == taken - 1  # its neighbour; the listening port is never handed out
        second = ports.free_port()  # the range is spent: the kernel's bind(0), not a repeat
        assert second not in (taken - 1, taken)
        assert second >= _ephemeral_low()


def test_reserve_port_keeps_the_port_bound_and_a_store_still_serves_it(registry):
    from torch.distributed import TCPStore

    sock, port = ports.reserve_port()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        assert ports.free_port() != port
        store = TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store
    finally:
        sock.close()


@pytest.mark.parametrize("content", [
    b"not a registry\n\x00\xff\n-1 5\n70000 1\n1 2 3\n",
    b"25000 99999999999\n",  # a time in the future is not trusted
    b"9" * (2 << 20),  # larger than is ever read
    b"9" * 5000 + b" 1\n" + b"25000 " + b"9" * 5000 + b"\n",  # numbers longer than int() takes
])
def test_a_malformed_registry_is_read_as_what_it_validly_says(registry, content):
    registry.parent.mkdir(mode=0o700)
    registry.write_bytes(content)
    port = ports.free_port()
    lines = registry.read_text().splitlines()
    assert lines == [f"{port} {lines[0].split()[1]}"]  # rewritten with valid entries only
    assert abs(int(lines[0].split()[1]) - time.time()) < 60


def test_a_fresh_entry_is_honoured_and_an_expired_one_is_dropped(registry, monkeypatch):
    monkeypatch.setattr(ports, "_span", lambda: (25000, 25002))
    registry.parent.mkdir(mode=0o700)
    now = time.time()
    registry.write_text(f"25000 {now:.0f}\n25001 {now - ports.HOLD_S - 5:.0f}\n")
    assert ports.free_port() == 25001  # 25000 is still held by whoever got it
    assert {int(line.split()[0]) for line in registry.read_text().splitlines()} == {25000, 25001}


def test_a_registry_that_is_not_private_is_not_used(registry, tmp_path, caplog):
    evil = tmp_path / "elsewhere"
    evil.mkdir()
    registry.parent.symlink_to(evil)  # the directory is someone's link
    with caplog.at_level(logging.WARNING, "robustdist.testing.ports"):
        assert ports.free_port() >= _ephemeral_low()
    assert "no registry of the ports handed out (see the debug log); drawing a port from the kernel (bind to port " \
           "0): another process may take it before it is bound" in caplog.text
    assert list(evil.iterdir()) == []
    registry.parent.unlink()
    registry.parent.mkdir(mode=0o755)  # readable by others
    assert ports.free_port() >= _ephemeral_low()
    assert not registry.exists()
    registry.parent.chmod(0o700)
    target = tmp_path / "target"
    target.write_text("")
    registry.symlink_to(target)  # the file is a link
    sock, port = ports.reserve_port()
    sock.close()
    assert port >= _ephemeral_low()
    assert target.read_text() == ""


def test_a_port_held_on_ipv6_only_is_skipped(registry, monkeypatch):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET6) as held:
        try:
            held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            held.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(ports, "_span", lambda: (taken, taken + 2))
        got = [ports.free_port(), ports.free_port()]  # the range's other port, then the kernel's: never `taken`
    assert taken not in got, got  # an IPv4 probe alone finds the port free
    assert f"{taken} " not in registry.read_text()


def test_a_lock_held_too_long_falls_back_to_the_kernel(registry, monkeypatch, caplog):
    assert ports.free_port() < _ephemeral_low()  # makes the registry
    monkeypatch.setattr(ports, "_LOCK_S", 0.2)
    with open(registry, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another holder (a process stopped in a debugger)
        with caplog.at_level(logging.WARNING, "robustdist.testing.ports"):
            assert ports.free_port() >= _ephemeral_low()
    assert "drawing a port from the kernel" in caplog.text
    assert ports.free_port() < _ephemeral_low()  # the lock let go: the registry again
