"""Where an in-process recovery's time went, per rank: detection, teardown, rebuild, restore.

Each recovery on this rank appends one :class:`Recovery` to :func:`history` (the newest last; the last 256 are
kept) and logs it at INFO. The phases follow each other on the rank:

* ``detect_s``: from the fault's declaration (its wall time, on the declaring rank's clock) to this rank's watch
  seeing it; 0 on a rank that faulted itself. Across nodes it carries their clocks' offset.
* ``teardown_s``: from the fault reaching the loop (the exception, or the collective cut short) to the generation
  torn down: the ranks' decisions (``decide_s`` of it), the ``Hardened`` closed, the old DDP retired, the store
  handed over.
* ``rebuild_s``: the next generation built (a new group on a fresh store, new wrappers).
* ``restore_s``: ``h.resume()`` in the new generation; ``source`` says where from (``h.last_loaded.source``:
  ``"memory"``, ``"replica"``, ``"peer"``, ``"durable"``; ``None``: the start state) and ``from_process`` whether
  this rank's own state came from its own process's memory, without a file read.

The replay of the steps since the restored checkpoint is the training function's, not measured here.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from robustdist.runtime.log import get_logger

__all__ = ["Recovery", "history"]

log = get_logger(__name__)
_HISTORY: deque[Recovery] = deque(maxlen=256)


@dataclass
class Recovery:
    """One in-process recovery as this rank saw it (see the module docstring)."""

    generation: int
    """The generation recovered into (1 for the first recovery)."""
    rank: int
    own: bool
    """Whether this rank's own fault began it."""
    what: str
    detect_s: float | None = None
    decide_s: float = 0.0
    teardown_s: float = 0.0
    rebuild_s: float = 0.0
    restore_s: float = 0.0
    source: str | None = None
    from_process: bool = False
    step: int | None = None
    """The step resumed from."""

    def describe(self) -> str:
        detect = "-" if self.detect_s is None else f"{self.detect_s:.3f} s"
        where = f"{self.source or 'start state'}{', from this process' if self.from_process else ''}"
        return (f"rank {self.rank}: in-process recovery into generation {self.generation} "
                f"({'its own fault' if self.own else 'another rank' + chr(39) + 's fault'}): detection {detect}, "
                f"teardown {self.teardown_s:.3f} s (decisions {self.decide_s:.3f} s), rebuild {self.rebuild_s:.3f} s, "
                f"restore {self.restore_s:.3f} s (step {self.step}, {where})")


def history() -> list[Recovery]:
    """This process's in-process recoveries, oldest first (the last 256). Empty in a replacement process that joined a
    later generation (``robustdist run``) until it recovers itself: ``generation()`` can be above 0 while this is."""
    return list(_HISTORY)


def detection(watch: Any, own: bool) -> float | None:
    """Seconds from the fault's declaration to ``watch`` seeing it (0 for the rank's own fault; None: unknown)."""
    if own:
        return 0.0
    fault, seen = getattr(watch, "fault", None), getattr(watch, "seen_at", None)
    why = getattr(fault, "why", None)
    walls = [w for w in (_seconds(r.get("wall")) for r in (why.values() if isinstance(why, dict) else ())
                         if isinstance(r, dict)) if w is not None]
    seen = _seconds(seen)
    return max(0.0, seen - min(walls)) if seen is not None and walls else None


def _seconds(value: Any) -> float | None:
    """A finite float from another rank's word (the store's), else None: never an error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


class Clock:
    """Marks one recovery's phases on this rank (the loop's side of :class:`Recovery`)."""

    def __init__(self, record: Recovery) -> None:
        self.record = record
        self._t = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        spent, self._t = now - self._t, now
        return spent

    def restored(self, h: Any, step: int | None) -> None:
        """The restore is done (``step`` None: it failed, a fault like any other): keep and log the record."""
        r = self.record
        r.restore_s = self.lap()
        loaded = getattr(h, "last_loaded", None) if step is not None else None
        r.source = getattr(loaded, "source", None) if step is not None else "failed"
        r.from_process = bool(getattr(loaded, "from_process", False))
        r.step = step
        _HISTORY.append(r)
        log.info("%s", r.describe())
