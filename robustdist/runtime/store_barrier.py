"""Waits over a job's key-value store: the one barrier every part uses, and the poll under it.

:func:`wait_for` polls until keys exist, by a deadline. :func:`barrier` is the arrival rule the rendezvous,
the bounded collectives and every other "wait for every rank" share: each rank sets ``<prefix>/<rank>``, counts
itself in ``<prefix>/count`` and polls the count (one small request per poll, whatever the world size). A rank that is still waiting at its deadline writes the ranks it did not find, as a
JSON list, under the barrier's abandon key; every rank that sees that mark (before, while or just after it
arrives) stops too, so all of them fail together and name the same absent ranks. What a rank reads under the
mark is input (another process may write into the store): anything but a JSON list of distinct ranks of this
world, at most as long as a world's list can be, is reported as garbled, never trusted.

Store errors (the store went away) propagate to the caller, which names them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["Absent", "absent_ranks", "barrier", "wait_for"]


def wait_for(store: Any, keys: list[str], deadline: float, *, stop: Callable[[], object] | None = None,
             poll: float = 0.02) -> bool:
    """Poll ``store`` every ``poll`` seconds until every key of ``keys`` exists (True), or ``deadline`` (a
    ``time.monotonic()``) passes or ``stop`` returns a true value (False); ``stop`` may also raise, which ends the
    wait with its error."""
    while not store.check(keys):
        if (stop is not None and stop()) or time.monotonic() >= deadline:
            return False
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
    return True


class Absent(Exception):
    """The barrier did not complete. ``absent``: the ranks the rank that gave up did not find (this rank's own
    look when it gave up itself, or when the mark was garbled); ``when``: "before" (the mark was there before this
    rank arrived), "waiting" (this rank gave up, or saw the mark, while waiting) or "after" (every rank had
    arrived, but one gave up just before); ``garbled``: the mark's bytes when they were not a valid list."""

    def __init__(self, absent: tuple[int, ...], when: str, garbled: bytes | None = None):
        super().__init__(f"absent {list(absent)} ({when})")
        self.absent, self.when, self.garbled = absent, when, garbled


def barrier(store: Any, prefix: str, rank: int, world: int, deadline: float, *, value: str = "1",
            abandon_key: str | None = None, interrupt: Callable[[], None] | None = None, first: float = 0.001,
            most: float = 0.05, linger: float = 0.0) -> None:
    """Set ``<prefix>/<rank>`` to ``value`` and return once every rank of ``world`` has set its key; raise
    :class:`Absent` otherwise (see the module docstring). ``abandon_key`` defaults to ``<prefix>/abandoned``.
    ``interrupt`` is called between polls and raises to end the wait with its own error. Polls back off from
    ``first`` to ``most`` seconds. ``linger``: seconds a rank that gave up waits after marking, so that ranks whose
    store its process serves read the mark before it goes."""
    mark = abandon_key or f"{prefix}/abandoned"
    keys = [f"{prefix}/{r}" for r in range(world)]
    count = f"{prefix}/count"
    if store.check([mark]):
        raise _read_mark(store, mark, world, "before", keys)
    store.set(keys[rank], value)
    arrived = int(store.add(count, 1))  # polled by a counter: one small request whatever the world size
    delay = first
    while arrived < world:
        if interrupt is not None:
            interrupt()
        if store.check([mark]):
            raise _read_mark(store, mark, world, "after" if int(store.add(count, 0)) >= world else "waiting", keys)
        if time.monotonic() >= deadline:
            if int(store.add(count, 0)) >= world:  # the last rank arrived just now
                break
            absent = tuple(r for r, key in enumerate(keys) if not store.check([key]))
            store.set(mark, json.dumps(list(absent)))
            if linger > 0:
                time.sleep(linger)
            raise Absent(absent, "waiting")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(2 * delay, most)
        arrived = int(store.add(count, 0))
    if store.check([mark]):
        raise _read_mark(store, mark, world, "after", keys)


def absent_ranks(raw: bytes, world: int) -> tuple[int, ...] | None:
    """The ranks a barrier's mark lists: a JSON list of distinct ranks of ``world``, at most as long as such a
    list can be; None for anything else (the store is input)."""
    try:
        found = json_value(raw, 12 * world + 16)
    except Unreadable:
        return None
    if not (isinstance(found, list) and all(type(r) is int and 0 <= r < world for r in found)
            and len(set(found)) == len(found)):
        return None
    return tuple(sorted(found))


def _read_mark(store: Any, mark: str, world: int, when: str, keys: list[str]) -> Absent:
    raw = bytes(store.get(mark))
    found = absent_ranks(raw, world)
    if found is None:
        return Absent(tuple(r for r, key in enumerate(keys) if not store.check([key])), when, raw)
    return Absent(found, when)
