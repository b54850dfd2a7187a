"""A rank whose heartbeats stop is a fault of that rank (in-process recovery).

Every rank's watchdog writes a heartbeat record to the job's store every ``interval`` seconds from a thread of its
own, whether or not training steps (:mod:`robustdist.health.watchdog_store`). A rank that stops writing them is
stopped (SIGSTOP, a frozen node), cut off (a partition), or dead without its connections ending (a node that lost
power): the others learn nothing from their sockets until a collective times out. So in each generation rank 0
reads every rank's record a few times per interval (on a connection of its own) and, once a rank's record has not
changed for the bound (:func:`bound`: three intervals, and at least half of ``hang_timeout`` up to 30 s), declares
that rank faulty (:func:`robustdist.recovery.faults.declare_found`): every live rank's watch then wakes, gets out of
its collective and decides. The stopped rank answers the decision only once it runs again: a partition that heals,
or a stop that ends, within the decision bound recovers in place; a rank that stays gone makes every rank escalate.

The rule is the watchdog's (:class:`robustdist.runtime.liveness.Changes`): a record is judged by when rank 0 last saw it
change, never by the wall time it carries, so the nodes' clocks need not agree. Rank 0 judges nobody across a pause of
its own (its thread not run for an interval: a stop, a long call holding the GIL), and not itself. A rank that closed
its watchdog, or gave its decision, is leaving the generation, not lost. A rank that has written no record at all is not
judged (a watchdog created on one rank only shifts the key every later one uses: a warning says so, once); the hang
verdict and the fault watch still cover it. Not covered: rank 0 itself stopped (the others' hang verdicts are what
remain).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from robustdist.health import watchdog_store as ws
from robustdist.recovery.faults import declare_found
from robustdist.runtime.job_store import StoreThread, connector
from robustdist.runtime.liveness import Changes
from robustdist.runtime.log import get_logger

__all__ = ["LivenessWatch", "bound", "close", "start_for"]

log = get_logger(__name__)


def bound(interval: float, stale_after: float, hang_timeout: float) -> float:
    """Seconds a rank's record may stay unchanged: the watchdog's stale age, and at least half of ``hang_timeout``
    up to 30 s (a healthy rank's heartbeat thread can be held off that long by a call that keeps the GIL; a false
    verdict costs a rollback)."""
    return max(stale_after, min(30.0, hang_timeout / 2))


class LivenessWatch(StoreThread):
    """Rank 0's thread declaring faulty each rank whose heartbeat record stopped changing for ``limit`` seconds,
    in generation ``generation`` (once; it ends then, when ``fired`` is set, or at :meth:`close`)."""

    def __init__(self, connect: Callable[[], Any], *, prefix: str, world_size: int, interval: float, limit: float,
                 generation: int, scope: str, fired: threading.Event, rank: int = 0):
        super().__init__(connect, f"robustdist-liveness-gen{generation}")
        self.prefix, self.world_size, self.interval, self.limit = prefix, world_size, interval, limit
        self.generation, self.scope, self.rank = generation, scope, rank
        self.poll = min(0.5, max(0.25, interval / 4))
        self._fired = fired
        self._started = 0.0
        self.declared: list[int] = []  # the ranks it declared faulty

    def start(self) -> LivenessWatch:
        self._started = time.monotonic()
        return super().start()

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop looking; wait at most ``join_timeout`` s."""
        self._end(join_timeout)

    def _done(self) -> bool:
        return self._stop.is_set() or self._fired.is_set()

    def _run(self) -> None:
        client: Any = None
        changes = Changes(self.limit, gap=self.poll + self.interval)  # held for an interval: judge nobody
        failing_since = time.monotonic()
        warned: set[str] = set()
        while not self._stop.wait(self.poll):
            if self._fired.is_set():  # a fault of this generation is being handled: nothing more to say
                return
            try:
                client = self._client(client)
                if client is None or self._done():  # connected after the generation ended
                    return
                records = ws.read_records(client, self.prefix, self.world_size)
            except Exception as e:  # a store that stopped answering is the fault watch's to judge
                client = None
                if time.monotonic() - failing_since > self.limit and "read" not in warned:
                    warned.add("read")
                    log.warning("rank %d: could not read the heartbeats of generation %d for %.0f s (%s: %s); "
                                "expected a read every %g s. Stopped ranks are not found meanwhile. Fix: check the "
                                "job's store", self.rank, self.generation, time.monotonic() - failing_since,
                                type(e).__name__, str(e)[:200], self.poll)
                continue
            now = failing_since = time.monotonic()
            changes.see({r: rec["alive"] for r, rec in records.items()}, now)
            quiet = changes.quiet(now)
            lost = [r for r in changes.stopped(now) if r != self.rank and r in records
                    and records[r].get("closed") is not True]  # unreadable now: not judged
            self._unwritten(records, now, warned)
            if lost and not self._done():
                lost = self._still_in(client, lost)
                if lost and not self._done():
                    self._declare(client, records, lost, quiet)
                    return

    def _unwritten(self, records: dict[int, dict[str, Any]], now: float, warned: set[str]) -> None:
        missing = [r for r in range(self.world_size) if r not in records]
        if missing and "missing" not in warned and now - self._started > self.limit:
            warned.add("missing")
            log.warning("rank %d: rank(s) %s wrote no heartbeat under %s in generation %d's first %.0f s; expected "
                        "one every %g s from every rank. Their heartbeats are not judged in this generation. Fix: "
                        "create the same watchdogs on every rank (the key counts the watchdogs each process made)",
                        self.rank, missing[:20], self.prefix, self.generation, self.limit, self.interval)

    def _still_in(self, client: Any, lost: list[int]) -> list[int]:
        """Those of ``lost`` that gave no decision in this generation (one that finished, or decided, is leaving)."""
        return [r for r in lost if not client.check([f"{self.scope}/{self.generation}/decision/{r}"])]

    def _declare(self, client: Any, records: dict[int, dict[str, Any]], lost: list[int],
                 quiet: dict[int, float]) -> None:
        found = {}
        for r in lost:
            rec = records[r]
            step = f"; its last said step {rec['step']}" if rec.get("step") is not None else ""
            found[r] = (str(rec.get("node") or "node unknown")[:200],
                        f"HeartbeatsStopped: no new heartbeat from rank {r} for {quiet[r]:.1f} s (expected "
                        f"one every {self.interval:g} s; the bound {self.limit:g} s{step}): stopped, cut off, or "
                        f"dead without its connections ending; found by rank {self.rank}")
        try:
            declare_found(client, generation=self.generation, found=found, by=self.rank,
                          world_size=self.world_size, scope=self.scope)
            self.declared.extend(found)
        except Exception as e:  # the fault watch judges a store that stopped answering
            log.warning("rank %d: could not declare rank(s) %s faulty (their heartbeats stopped): %s: %s; expected "
                        "the job's store to take the declaration. The hang verdict or the fault watch's lost store "
                        "ends the wait instead. Fix: check the job's store", self.rank, sorted(found),
                        type(e).__name__, str(e)[:200])


def start_for(watchdog: Any, store: Any, *, scope: str, generation: int, rank: int, world_size: int,
              fired: threading.Event) -> LivenessWatch | None:
    """Rank 0's watch for generation ``generation``, where the watchdog publishes heartbeats; None elsewhere."""
    beats = watchdog.heartbeats if watchdog is not None else None
    if rank != 0 or world_size < 2 or beats is None:
        return None
    prefix, interval, stale_after = beats
    return LivenessWatch(connector(store, max(2.0, min(10.0, stale_after))), prefix=prefix,
                         world_size=world_size, interval=interval,
                         limit=bound(interval, stale_after, watchdog.hang_timeout), generation=generation,
                         scope=scope, fired=fired, rank=rank).start()


def close(watch: LivenessWatch | None) -> None:
    if watch is not None:
        watch.close()
