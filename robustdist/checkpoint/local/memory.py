"""How much memory the in-memory tier needs on a node, and whether it fits (checked at every save whose copies
grew, on every node; see :mod:`robustdist.checkpoint.local.tier`).

On a node, the tier holds ``keep_last`` complete steps plus the one being written, of every copy the node
keeps (its own ranks' copies and the replicas it holds for the previous node)::

    need = (keep_last + 1) x (own copies + held replicas)          in the tier's directory (a tmpfs: RAM)

The directory's free space counts what the tier already holds there (it is replaced as steps rotate), so a
restart that finds its previous copies still fits. RAM must also hold the snapshot, its serialised form and
the replicas being received while they are written.
"""

from __future__ import annotations

import os

__all__ = ["fits", "free", "held_bytes", "node_need", "size"]


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def node_need(sizes: list[int], nodes: list[int], peers: list[int | None], keep_last: int) -> dict[int, int]:
    """Bytes each node needs: ``(keep_last + 1)`` x (its ranks' own copies + the replicas it holds)."""
    need: dict[int, int] = {n: 0 for n in nodes}
    for r, nbytes in enumerate(sizes):
        need[nodes[r]] += nbytes
        peer = peers[r]
        if peer is not None:
            need[nodes[peer]] += nbytes
    return {n: (keep_last + 1) * b for n, b in need.items()}


def free(directory: str) -> tuple[int, int | None]:
    """Free bytes in ``directory``'s filesystem, and the RAM available (``MemAvailable``), if known."""
    st = os.statvfs(directory)
    available = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return st.f_bavail * st.f_frsize, available


def held_bytes(root: str, limit: int = 100_000) -> int:
    """Bytes of the regular files under ``root`` (links not followed; at most ``limit`` entries looked at)."""
    total, seen = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            seen += 1
            if seen > limit:
                return total
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def fits(root: str, node: int, need: int, in_flight: int, others: list[tuple[str, int]]) -> str | None:
    """The problem, in words with the numbers, when ``need`` bytes (plus ``in_flight`` bytes of RAM for the
    snapshot, its serialised form and incoming replicas) do not fit on this node; None when they do."""
    shm, ram = free(root)
    held = held_bytes(root)
    left = f"; other in-memory tiers of this user hold {size(sum(b for _, b in others))} here " \
        f"({', '.join(p for p, _ in others[:3])}: `robustdist clean` removes those no running job uses)" if others else ""
    if need > shm + held:
        return (f"node {node} needs {size(need)} in {root} for the in-memory tier (kept steps + 1 being written, x "
                f"the copies it holds) and has {size(shm)} free plus {size(held)} it already holds{left}")
    if ram is not None and need - held + in_flight > ram:
        return (f"node {node} needs {size(need - held)} more for the in-memory tier plus {size(in_flight)} while "
                f"saving, and has {size(ram)} of RAM available{left}")
    return None
