"""Which node this process is on, in words other ranks can act on.

Hostnames do not tell nodes apart reliably: containers and network namespaces share one, and a node's
hostname often resolves to a loopback address. A node is therefore named by its node rank (torchrun's
``GROUP_RANK``, or ``NODE_RANK``/``SLURM_NODEID``), its hostname, and the IPv4 address it reaches the
rendezvous with: the address of ``GLOO_SOCKET_IFNAME``'s interface when that is set, else the source address
the kernel picks for a route to ``MASTER_ADDR`` (a UDP ``connect`` sends no packet). Nothing here waits on
the network, raises, or needs a process group.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Mapping

__all__ = ["interface_address", "node_address", "node_label", "node_rank"]

_SIOCGIFADDR = 0x8915


def node_rank(env: Mapping[str, str] | None = None) -> int | None:
    """The launcher's node rank (``GROUP_RANK``, ``NODE_RANK`` or ``SLURM_NODEID``), or None if unset or invalid."""
    env = os.environ if env is None else env
    for var in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        value = env.get(var, "")
        if value.isdigit() and len(value) < 10:
            return int(value)
    return None


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` on this host, or None (no such interface, or no IPv4 address)."""
    if not name or len(name) > 15 or "\0" in name:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def route_source(host: str, port: int = 9) -> str | None:
    """The local IPv4 address the kernel would use to reach ``host`` (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except (OSError, UnicodeError, ValueError, OverflowError):
        return None


def node_address(env: Mapping[str, str] | None = None) -> str | None:
    """This node's address as the job sees it (see the module docstring), or None when it cannot be told."""
    env = os.environ if env is None else env
    ifname = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname and (addr := interface_address(ifname)):
        return addr
    master = env.get("MASTER_ADDR", "")
    if master and len(master) < 256:
        try:
            infos = socket.getaddrinfo(master, None, socket.AF_INET, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)
        except (OSError, UnicodeError):
            infos = []  # a name: do not resolve here (resolution may block); the caller resolves with a bound
        if infos:
            return route_source(str(infos[0][4][0]))
    return None


def node_label(env: Mapping[str, str] | None = None) -> str:
    """``node 1 (host gpu-07, 10.0.0.2)``: node rank, hostname and address, as far as they are known."""
    env = os.environ if env is None else env
    rank = node_rank(env)
    details = [f"host {socket.gethostname()}"]
    if (addr := node_address(env)) is not None:
        details.append(addr)
    return f"node {rank if rank is not None else '?'} ({', '.join(details)})"
