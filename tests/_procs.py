"""Process-tree helpers for the test fixtures (Linux /proc; no psutil dependency)."""

from __future__ import annotations

import os
import signal
import time

# Long-lived helpers that multiprocessing starts once per process on purpose; not leaks.
_ALLOWED = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _ppid_map(*, zombies: bool = True) -> dict[int, int]:
    """pid -> parent pid for every process; zombies (dead, not yet reaped) are included unless told."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields and (zombies or fields[0] != "Z"):
            out[int(entry)] = int(fields[1])
    return out


def descendants(root: int) -> set[int]:
    parents = _ppid_map()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].startswith("Z")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def new_descendants(root: int, before: set[int]) -> list[int]:
    """Descendants of ``root`` not in ``before`` and not below a process in ``before`` (e.g. Ray workers
    spawned by a raylet that already ran), minus multiprocessing's own long-lived helpers."""
    parents = _ppid_map()
    out = []
    for pid in descendants(root) - before:
        up = parents.get(pid)
        while up is not None and up != root and (up not in before or _is_helper(up)):
            up = parents.get(up)
        if up in before and not _is_helper(up):
            continue
        if _is_helper(pid) and not _is_helper(parents.get(pid)):  # the helper itself, not what it forked
            continue
        out.append(pid)
    return sorted(out)


def _is_helper(pid: int | None) -> bool:
    """A multiprocessing helper. Ranks forked by the forkserver share its command line, so a process whose
    parent is a helper too is a forked child (a rank), not a helper."""
    return pid is not None and any(tag in cmdline(pid) for tag in _ALLOWED)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        current = _ppid_map(zombies=False)
        alive = [p for p in alive if p in current]
        if alive:
            time.sleep(0.2)
    return alive


def kill_and_reap(pid: int) -> None:
    """SIGKILL ``pid`` and reap it if it is our child (so no zombie stays behind)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # not our direct child: its own parent reaps it
        pass
