"""The rows of Ray's GCS actor and placement-group tables as robustdist reads them (filled by
:func:`robustdist.runtime._ray_compat.cluster_tables`, which reaches Ray's private accessor; these are plain data).

Layer 0: imports nothing of Ray or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActorRow", "GroupRow"]


@dataclass(frozen=True)
class ActorRow:
    """One actor of Ray's GCS actor table, as robustdist reads it: ``state`` is Ray's state name (``"ALIVE"``,
    ``"DEAD"``, ...); ``worker_id`` is the actor's own worker ('' bytes before it is placed) and
    ``owner_worker_id`` its owner's."""

    actor_id: bytes
    class_name: str
    state: str
    worker_id: bytes
    owner_worker_id: bytes
    pid: int
    is_detached: bool


@dataclass(frozen=True)
class GroupRow:
    """One placement group of Ray's GCS table: ``state`` is Ray's state name (``"PENDING"``, ``"CREATED"``,
    ``"REMOVED"``, ``"RESCHEDULING"``); ``creator_actor_id`` the actor that created it (b'' for a driver)."""

    group_id: bytes
    creator_actor_id: bytes
    state: str
    is_detached: bool
    bundles: tuple[dict[str, float], ...]
