"""The last complete in-memory step, as this process took it: restored without reading or deserialising a file.

A save's snapshot (:mod:`.._snapshot`) is taken into buffers the tier reuses from one save to the next. Once this
rank's own copy of the step is committed, those buffers are exactly what the copy's files hold, until the next
save's snapshot overwrites them; the tier keeps them as a :class:`Held` (:meth:`LocalTier.save` drops it before the
next snapshot begins). Whether the step is complete across the job is the load's agreement, as for the files. When a tier closes without removing its files, its ``Held`` is carried (:func:`carry`) to the next tier
this process opens on the same directory, lineage, world size and rank: an in-process recovery's next generation.
That tier's load (:func:`take`) uses it for this rank's own copy of the same step and save, in place of its file:
no read, no checksum, no ``torch.load``. Everything else (the agreement on the step across the job, the other
ranks' copies, the checks against the live objects and the restore) is as for a copy read from the files.

A ``Held`` is taken once: the restore hands its tensors to the live objects (an optimizer's state keeps the tensors
it is given), so it is never a source again; a later snapshot never copies into a buffer a live tensor shares
(:func:`robustdist.checkpoint._payload.snapshot` takes a new one).
Process memory, not input: nothing of it is read from outside the process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Held", "carry", "discard", "take"]


@dataclass
class Held:
    """Rank ``rank``'s snapshot of step ``step`` (save ``save``): its ``payload`` (``{"mine", "shards"}``) and, on
    rank 0, the ``replicated`` entries, each bound to its copy (:func:`.layout.bind`): the objects the tier
    serialised into its files."""

    step: int
    save: str
    rank: int
    world_size: int
    lineage: str
    payload: dict[str, Any]
    replicated: dict[str, Any]


_CARRIED: dict[str, Held] = {}
_LOCK = threading.Lock()


def carry(directory: str, held: Held | None) -> None:
    """A tier on ``directory`` closed and kept its files: its ``held`` goes to the next tier on it (None: drop any)."""
    with _LOCK:
        if held is None:
            _CARRIED.pop(directory, None)
        else:
            _CARRIED[directory] = held


def discard(directory: str) -> None:
    """The files of ``directory`` were removed: nothing held for it is a copy of anything any more."""
    carry(directory, None)


def take(directory: str, *, rank: int, world_size: int, lineage: str) -> Held | None:
    """What a tier closed on ``directory`` carried for this rank, world size and lineage (taken: once)."""
    with _LOCK:
        held = _CARRIED.pop(directory, None)
    if held is None or (held.rank, held.world_size, held.lineage) != (rank, world_size, lineage):
        return None
    return held
