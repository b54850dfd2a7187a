"""One rank's fault becomes a job-wide generation change that every live rank sees (in-process recovery, #34).

Protocol (every rank runs the same code; keys live under ``<scope>/`` in the job's c10d store):

* **Generation.** Every rank starts at generation ``g`` (0, or what the caller resumes from) and counts alike:
  after a recovery, every rank moves to ``g + 1``. Nothing in a key is counted per node or per process.
* **Fault.** A rank that faults in generation ``g`` (an exception escaping its step, the watchdog's hang verdict,
  a collective that failed) ``add``\\ s 1 to ``<scope>/<g>/fault`` and writes why to ``<scope>/<g>/why/<rank>``
  (JSON: rank, node, what, wall time). Adding, not setting: two ranks faulting at once both count, and the
  first writer wins nothing a second must know about.
* **Watch.** Each rank's :class:`FaultWatch` thread, on a store connection of its own (the group's client
  serialises its operations, and the main thread may be stuck in a store wait or a collective), waits for
  ``<scope>/<g>/fault`` to exist and then calls ``on_fault`` once, with every rank's reason it can read. That
  callback runs on the watch thread: it is where a rank blocked in a collective gets out
  (:meth:`robustdist.runtime.group_sockets.GroupSockets.unblock`). The store's own notification carries it:
  detection is a store round trip, not a poll interval.
* **Generations never mix.** Every key holds its generation; a watch of ``g`` never reads ``g - 1``'s keys, and
  a fault declared in ``g - 1`` after the others moved on is ignored by them (it names the old generation).

Bounds: a ``TCPStore`` call on a store that stopped answering can wait past its timeout, so the watch thread is
a daemon that :meth:`FaultWatch.close` abandons after ``join_timeout``; its waits are slices of ``slice_s``
seconds so a close is seen within one slice.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from robustdist.runtime.log import get_logger
from robustdist.runtime.node import node_label

__all__ = ["Fault", "FaultWatch", "declare_fault", "read_fault"]

log = get_logger(__name__)

SCOPE = "robustdist/recovery"
_WHY_MAX = 2000  # characters of a reason kept in the store


@dataclass(frozen=True)
class Fault:
    """What the ranks read about a fault: its generation, how many ranks declared one, and why (by rank)."""

    generation: int
    count: int
    why: dict[int, dict[str, Any]] = field(default_factory=dict)

    def describe(self) -> str:
        """``generation 3: rank 1 (node 0): ValueError: boom at step 41``."""
        if not self.why:
            return f"generation {self.generation}: {self.count} fault(s), no reason recorded"
        parts = [f"rank {r} ({w.get('node', '?')}): {w.get('what', '?')}" for r, w in sorted(self.why.items())]
        return f"generation {self.generation}: " + "; ".join(parts)


def _key(scope: str, generation: int, *rest: object) -> str:
    return "/".join([scope, str(generation), *map(str, rest)])


def declare_fault(store: Any, *, generation: int, rank: int, what: str, scope: str = SCOPE) -> int:
    """Record this rank's fault in ``generation``; returns how many ranks have declared one there (1: first)."""
    record = {"rank": rank, "node": node_label(), "what": what[:_WHY_MAX], "wall": time.time()}
    store.set(_key(scope, generation, "why", rank), json.dumps(record))
    count = int(store.add(_key(scope, generation, "fault"), 1))
    log.info("rank %d declared a fault in generation %d (%d so far): %s", rank, generation, count, what[:300])
    return count


def read_fault(store: Any, *, generation: int, world_size: int, scope: str = SCOPE) -> Fault | None:
    """The fault of ``generation`` if one was declared, else None (never waits)."""
    key = _key(scope, generation, "fault")
    if not store.check([key]):
        return None
    count = int(store.add(key, 0))
    why: dict[int, dict[str, Any]] = {}
    keys = [_key(scope, generation, "why", r) for r in range(world_size)]
    for r, k in enumerate(keys):
        if store.check([k]):
            try:
                why[r] = json.loads(store.get(k))
            except ValueError:
                why[r] = {"what": "(unreadable reason)"}
    return Fault(generation, count, why)


class FaultWatch:
    """A thread that waits for a fault in one generation and calls ``on_fault`` once when it comes.

    ``connect`` opens the thread's own store connection (see
    :func:`robustdist.health.watchdog_store.connector`). :meth:`close` ends the thread (within ``slice_s``),
    whether or not a fault came.
    """

    def __init__(self, connect: Callable[[], Any], *, generation: int, world_size: int, rank: int,
                 on_fault: Callable[[Fault], None], scope: str = SCOPE, slice_s: float = 0.5) -> None:
        self.generation, self.world_size, self.rank, self.scope = generation, world_size, rank, scope
        self._connect, self._on_fault, self._slice = connect, on_fault, slice_s
        self._stop = threading.Event()
        self.fault: Fault | None = None
        self.seen_at: float | None = None  # time.time() when the fault was seen
        self._thread = threading.Thread(target=self._run, name=f"robustdist-faultwatch-rank{rank}-gen{generation}",
                                        daemon=True)

    def start(self) -> FaultWatch:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, join_timeout: float = 5.0) -> None:
        """Stop watching; wait at most ``join_timeout`` s for the thread (it may be in a store call that does not
        return: it is a daemon and is abandoned then)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_timeout)

    def _run(self) -> None:
        key = _key(self.scope, self.generation, "fault")
        client = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = self._connect()
                try:
                    client.wait([key], timedelta(seconds=self._slice))
                    hit = True
                except Exception:  # a slice that ended (torch's words for it vary): ask, never parse
                    hit = bool(client.check([key]))
            except Exception as e:  # the connection is gone: a new one after a slice
                log.debug("rank %d: the fault watch's store connection failed (%s: %s); reconnecting",
                          self.rank, type(e).__name__, str(e)[:200])
                client = None
                self._stop.wait(self._slice)
                continue
            if not hit:
                continue
            if self._stop.is_set():
                return
            self.seen_at = time.time()
            try:
                self.fault = read_fault(client, generation=self.generation, world_size=self.world_size,
                                        scope=self.scope) or Fault(self.generation, 1)
            except Exception as e:  # the fault itself is known; only its reasons are missing
                log.debug("rank %d: could not read the fault's reasons (%s)", self.rank, e)
                self.fault = Fault(self.generation, 1)
            try:
                self._on_fault(self.fault)
            except Exception:
                log.exception("rank %d: the fault callback of generation %d raised", self.rank, self.generation)
            return
