"""One rank's fault becomes a job-wide generation change that every live rank sees (in-process recovery).

Protocol (every rank runs the same code; keys live under ``<scope>/`` in the job's c10d store):

Every key is in the job's store itself, under any ``PrefixStore`` the caller holds (the default group's store
carries a ``default_pg`` prefix; a watch's own connection has none).

* **Generation.** Every rank starts at generation ``g`` (0, or what the caller resumes from) and counts alike:
  after a recovery, every rank moves to ``g + 1``. Nothing in a key is counted per node or per process.
* **Fault.** A rank that faults in generation ``g`` (an exception escaping its step, the watchdog's hang verdict,
  a collective that failed; or rank 0 for a rank whose heartbeats stopped, :mod:`.liveness`: :func:`declare_found`,
  adding ``by``) writes why to ``<scope>/<g>/why/<rank>`` (JSON: rank, node, what, wall time),
  adds 1 to ``<scope>/<g>/fault`` (two ranks faulting at once both count), then sets every rank's wake key
  ``<scope>/<g>/wake/<r>``.
* **Watch.** Each rank's :class:`FaultWatch` thread, on a store connection of its own (the group's client
  serialises its operations, and the main thread may be stuck in a store wait or a collective), waits for its
  own wake key, which a fault or its own :meth:`FaultWatch.close` sets: no polling, so no timed-out waits (torch
  logs each one). On a fault it calls ``on_fault(generation)`` at once, before reading any reason: that
  callback runs on the watch thread, and is where a rank blocked in a collective gets out
  (:meth:`robustdist.runtime.group_sockets.GroupSockets.unblock` for gloo's,
  :func:`robustdist.runtime.dist.interrupt_waits` for robustdist's own arrival checks in the store). Then it reads the reasons into
  :attr:`FaultWatch.fault`. Once :meth:`FaultWatch.close` has returned, the callback is never called.
* **A lost store is a fault too.** When the watch's connection fails and no new one works for ``lost_after``
  seconds, the callback is called and :attr:`FaultWatch.lost` is set: the ranks cannot agree on anything
  more, and the caller escalates to a real restart.
* **Generations never mix.** Every key holds its generation; a watch of ``g`` never reads another generation's
  keys, and a fault declared in ``g - 1`` after the others moved on is ignored by them.
  :func:`clear_generation` deletes a finished generation's keys.
* **Store content is input.** A reason that is not a JSON object, is nested too deep or is too long, and a
  count that is not a number, are read as "unreadable", never raised.

Bounds: a ``TCPStore`` call on a store that stopped answering can wait past its timeout, so the watch thread is
a daemon that :meth:`FaultWatch.close` abandons after ``join_timeout`` (with the callback fenced off).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from robustdist.runtime import _torch_compat
from robustdist.runtime.job_store import StoreThread
from robustdist.runtime.log import get_logger
from robustdist.runtime.node import node_label
from robustdist.runtime.store_barrier import wait_for
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["Fault", "FaultWatch", "agree", "clear_generation", "decide", "declare_fault", "declare_found",
           "read_fault", "wake_all"]

log = get_logger(__name__)

SCOPE = "robustdist/recovery"
_WHY_MAX = 2000  # characters of a reason written to the store
_READ_MAX = 8192  # bytes of a stored reason read as JSON; a longer one is unreadable
_WAIT_S = 300.0  # one wait for the wake key; the loop waits again (a close or a fault ends it at once)


@dataclass(frozen=True)
class Fault:
    """What the ranks read about a fault: its generation, how many ranks declared one, and why (by rank)."""

    generation: int
    count: int
    why: dict[int, dict[str, Any]] = field(default_factory=dict)

    def others(self, rank: int) -> set[int]:
        """The ranks whose fault this is, other than ``rank``'s own: every faulty rank but ``rank``, and ``rank``
        too where another rank declared it (its heartbeats stopped: it did not fault, it was found faulty)."""
        return {r for r, w in self.why.items()
                if r != rank or (isinstance(w.get("by"), int) and w["by"] != rank)}

    def describe(self) -> str:
        """``generation 3: rank 1 (node 0): ValueError: boom at step 41``."""
        if not self.why:
            return f"generation {self.generation}: {self.count} fault(s), no reason recorded"
        parts = [f"rank {r} ({str(w.get('node', '?'))[:200]}): {str(w.get('what', '?'))[:_WHY_MAX]}"
                 for r, w in sorted(self.why.items())]
        return f"generation {self.generation}: " + "; ".join(parts)


def _key(scope: str, generation: int, *rest: object) -> str:
    return "/".join([scope, str(generation), *map(str, rest)])


def _job_store(store: Any) -> Any:
    """The job-wide store under any ``PrefixStore`` (the default group's carries ``default_pg``): every rank, and
    every watch's own connection, must use the same keys."""
    return _torch_compat.innermost_store(store)


def declare_fault(store: Any, *, generation: int, rank: int, world_size: int, what: str, scope: str = SCOPE) -> int:
    """Record this rank's fault in ``generation`` and wake every rank's watch; returns how many ranks have
    declared one there (1: this rank was first)."""
    store = _job_store(store)
    record = {"rank": rank, "node": node_label(), "what": what[:_WHY_MAX], "wall": time.time()}
    store.set(_key(scope, generation, "why", rank), json.dumps(record))
    count = int(store.add(_key(scope, generation, "fault"), 1))
    wake_all(store, generation=generation, world_size=world_size, scope=scope)
    log.info("rank %d declared a fault in generation %d (%d so far): %s", rank, generation, count, what[:300])
    return count


def declare_found(store: Any, *, generation: int, found: dict[int, tuple[str, str]], by: int, world_size: int,
                  scope: str = SCOPE) -> int:
    """Rank ``by`` (-1: the launcher, for a worker it replaced) found the ranks in ``found`` (rank -> (node, what)) faulty (their heartbeats stopped): their
    reasons, with ``by``, then one count per rank and one wake of every watch. A rank that declared a fault of its
    own is left as it said. Returns the count, as :func:`declare_fault` does."""
    store = _job_store(store)
    found = {r: v for r, v in found.items() if not store.check([_key(scope, generation, "why", r)])}
    for r, (node, what) in found.items():
        record = {"rank": r, "node": node[:200], "what": what[:_WHY_MAX], "wall": time.time(), "by": by}
        store.set(_key(scope, generation, "why", r), json.dumps(record))
    count = int(store.add(_key(scope, generation, "fault"), len(found))) if found else 0
    if found:
        wake_all(store, generation=generation, world_size=world_size, scope=scope)
        log.warning("%s found rank(s) %s faulty in generation %d: %s", f"rank {by}" if by >= 0 else "the launcher",
                    sorted(found), generation, "; ".join(what[:300] for _, what in found.values()))
    return count


def wake_all(store: Any, *, generation: int, world_size: int, scope: str = SCOPE) -> None:
    """Wake every rank's watch of ``generation`` to read its fault."""
    store = _job_store(store)
    for r in range(world_size):
        store.set(_key(scope, generation, "wake", r), "fault")


def _reason(raw: bytes) -> dict[str, Any]:
    try:
        value = json_value(raw, _READ_MAX)
    except Unreadable as e:
        return {"what": f"(unreadable reason: {e})"}
    if not isinstance(value, dict):
        return {"what": f"(unreadable reason: a JSON {type(value).__name__}, expected an object)"}
    return value


def read_fault(store: Any, *, generation: int, world_size: int, scope: str = SCOPE) -> Fault | None:
    """The fault of ``generation`` if one was declared, else None (never waits; hostile content is read as
    unreadable, never raised)."""
    store = _job_store(store)
    key = _key(scope, generation, "fault")
    if not store.check([key]):
        return None
    try:
        count = int(store.get(key))
    except ValueError:  # not a number (an add on it would break the store connection: get, never add)
        count = 0
    why: dict[int, dict[str, Any]] = {}
    for r in range(world_size):
        k = _key(scope, generation, "why", r)
        if store.check([k]):
            why[r] = _reason(store.get(k))
    return Fault(generation, count, why)


def clear_generation(store: Any, *, generation: int, world_size: int, scope: str = SCOPE) -> None:
    """Delete ``generation``'s keys (once every rank has moved past it)."""
    store = _job_store(store)
    keys = [_key(scope, generation, k) for k in ("fault", "verdict", "left/kept")]
    keys += [_key(scope, generation, kind, r) for r in range(world_size) for kind in ("why", "wake", "decision", "left")]
    for k in keys:
        store.delete_key(k)


def _never(generation: int) -> None:
    """A closed watch's callback."""


class FaultWatch(StoreThread):
    """A thread that waits for a fault in one generation and calls ``on_fault(generation)`` once when it comes.

    ``connect`` opens the thread's own store connection (see :func:`robustdist.runtime.job_store.connector`);
    ``store`` is any connection (a ``PrefixStore`` too: the keys are the job store's, under every prefix), used by
    :meth:`close` to wake the thread. :meth:`close` ends the watch whether
    or not a fault came; once it returns, ``on_fault`` is never called.
    """

    def __init__(self, connect: Callable[[], Any], store: Any, *, generation: int, world_size: int, rank: int,
                 on_fault: Callable[[int], None], scope: str = SCOPE, lost_after: float = 30.0,
                 retry_s: float = 0.5) -> None:
        super().__init__(connect, f"robustdist-faultwatch-rank{rank}-gen{generation}")
        self.generation, self.world_size, self.rank, self.scope = generation, world_size, rank, scope
        self._store, self._on_fault = _job_store(store), on_fault
        self._lost_after, self._retry = lost_after, retry_s
        self._fence = threading.Lock()  # held by the callback's call and by close(): no callback after close
        self.fault: Fault | None = None
        self.lost = False  # the store could not be reached for lost_after seconds
        self.seen_at: float | None = None  # time.time() when the fault (or the loss) was seen

    def close(self, join_timeout: float = 5.0) -> None:
        """Stop watching; wait at most ``join_timeout`` s for the thread (it may be in a store call that does not
        return: it is a daemon, and is abandoned then; its callback is fenced off either way)."""
        with self._fence:
            self._stop.set()
            # No callback after this: dropping it breaks the generation -> watch -> callback -> generation cycle,
            # so the generation, and the store this watch holds, go when the loop lets go of them (no collection)
            self._on_fault = _never
        try:
            self._store.set(_key(self.scope, self.generation, "wake", self.rank), "closed")
        except Exception as e:  # the store is gone: the thread ends when its own connection fails
            log.debug("rank %d: could not wake the fault watch (%s)", self.rank, e)
        self._end(join_timeout)

    def _call(self) -> bool:
        with self._fence:
            if self._stop.is_set():
                return False
            self.seen_at = time.time()
            try:
                self._on_fault(self.generation)
            except Exception:
                log.exception("rank %d: the fault callback of generation %d raised", self.rank, self.generation)
            return True

    def _run(self) -> None:
        wake = _key(self.scope, self.generation, "wake", self.rank)
        fault = _key(self.scope, self.generation, "fault")
        client = None
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                client = self._client(client)
                if client is None:
                    return
                try:
                    client.wait([wake], timedelta(seconds=_WAIT_S))
                except Exception:  # the long wait ended (torch's words for it vary): ask, never parse
                    if not client.check([wake]):
                        continue
                failing_since = None
                if not client.check([fault]):
                    if self._stop.is_set():  # woken by close()
                        continue
                    # a wake key left by an earlier watch of this generation's number (a store that outlived
                    # it): drop it, then look again, since a fault sets its count before the wake keys
                    client.delete_key(wake)
                    if not client.check([fault]):
                        continue
            except Exception as e:  # the connection is gone: a new one after a pause, or the store is lost
                client = None
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= self._lost_after:
                    log.warning("rank %d: the c10d store has not answered the fault watch for %.0f s (%s: %s); "
                                "treating it as lost", self.rank, now - failing_since, type(e).__name__,
                                str(e)[:200])
                    self.lost = True
                    self._call()
                    return
                self._stop.wait(self._retry)
                continue
            if not self._call():
                return
            try:
                self.fault = read_fault(client, generation=self.generation, world_size=self.world_size,
                                        scope=self.scope) or Fault(self.generation, 0)
            except Exception as e:  # the fault itself is known; only its reasons are missing
                log.debug("rank %d: could not read the fault's reasons (%s)", self.rank, e)
                self.fault = Fault(self.generation, 0)
            return


def decide(store: Any, *, scope: str, generation: int, rank: int, decision: str) -> None:
    """Record ``rank``'s decision for ``generation`` (ASCII: "recover", "done", or anything else: escalate, which
    may say why) where :func:`agree` reads it."""
    _job_store(store).set(_key(scope, generation, "decision", rank), decision.encode("ascii", "replace"))


def agree(store: Any, scope: str, gen: int, rank: int, world: int, mine: str,
          timeout: float) -> tuple[list[str], str]:
    """Every rank's decision for generation ``gen`` ("recover", "escalate" or "done"; a rank that says nothing
    within ``timeout`` counts as "escalate"), and the generation's verdict: the first rank to have read every
    decision, or one that is not "recover" (the outcome is then "escalate" whatever the rest say: nobody waits
    for them), stores its outcome, and every rank acts on that stored one (a rank that comes back after the others
    gave up on it reads their "escalate", never its own view of the decisions). Decisions not read then are
    "undecided"."""
    base = f"{scope}/{gen}/decision"
    store.set(f"{base}/{rank}", mine)
    deadline = time.monotonic() + timeout
    out: list[str] = []
    for r in range(world):
        key = f"{base}/{r}"
        wait_for(store, [key], deadline)
        out.append(store.get(key).decode("ascii", "replace") if store.check([key]) else "escalate")
        if out[-1] != "recover":
            out += [store.get(k).decode("ascii", "replace") if store.check([k]) else "undecided"
                    for k in (f"{base}/{q}" for q in range(r + 1, world))]
            break
    outcome = "recover" if all(d == "recover" for d in out) else "escalate"
    verdict = store.compare_set(f"{scope}/{gen}/verdict", "", outcome)
    return out, verdict.decode("ascii", "replace") if isinstance(verdict, bytes) else str(verdict)
