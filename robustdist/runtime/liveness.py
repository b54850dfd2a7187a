"""The liveness rule: a rank is lost when its record in the job's store has not changed for a bound, judged on the
reader's own monotonic clock.

Each rank's watchdog rewrites a small record every interval from a thread of its own, whatever its training thread
does (:mod:`robustdist.health.watchdog_store`). Whoever reads those records keeps a :class:`Changes` and asks it which
records stopped changing: each rank's watchdog, from a little more than the bound before its hang verdict on
(the report then names the lost ranks), and rank 0's liveness watch throughout an in-process recovery's generation
(:mod:`robustdist.recovery.liveness`: it declares them faulty). A record is judged only by when this reader saw it
change, never by a time written in it, so the nodes' clocks need not agree. A reader whose own reads were held off
for longer than ``gap`` (a stop, a call that held the GIL, a store that did not answer) restarts every clock rather
than judge across its own pause. A rank never seen is not judged here; each caller says what a record never written
means.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Hashable, Mapping

__all__ = ["Changes"]


class Changes:
    """When each rank's record last changed, as this reader saw it.

    Args:
        limit: seconds a record may stay unchanged before its rank is :meth:`stopped`.
        gap: seconds between two of this reader's looks beyond which it judges nobody (every clock restarts).
    """

    def __init__(self, limit: float, *, gap: float = math.inf):
        self.limit, self.gap = float(limit), float(gap)
        self._seen: dict[int, tuple[Hashable, float]] = {}  # rank -> (its record's token, when it last changed)
        self._last: float | None = None
        self._lock = threading.Lock()  # a watchdog's heartbeat thread and its report thread both look

    def see(self, tokens: Mapping[int, Hashable], now: float | None = None) -> None:
        """One look: each rank's current token (any value that changes with every write of its record)."""
        with self._lock:  # the clock read under the lock: two readers' looks are applied in the order taken
            now = time.monotonic() if now is None else now
            if self._last is not None and now - self._last > self.gap:
                self._seen = {r: (token, now) for r, (token, _) in self._seen.items()}
            self._last = now
            for r, token in tokens.items():
                if r not in self._seen or self._seen[r][0] != token:
                    self._seen[r] = (token, now)

    def quiet(self, now: float | None = None) -> dict[int, float]:
        """Seconds each rank seen so far has gone without a change."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return {r: max(0.0, now - since) for r, (_, since) in self._seen.items()}

    def stopped(self, now: float | None = None) -> list[int]:
        """The ranks whose records have not changed for more than :attr:`limit` seconds."""
        return sorted(r for r, q in self.quiet(now).items() if q > self.limit)
