"""Step 2 of a save, shared by both tiers: validate the entries and snapshot them to CPU.

``AtomicCheckpointer.save`` (the durable tier) and ``LocalTier.save`` (the in-memory tier,
:mod:`robustdist.checkpoint.local.tier`) take the same snapshot, so what either writes restores the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from robustdist.checkpoint import _payload
from robustdist.checkpoint._sharded import is_sharded_stateful
from robustdist.runtime.errors import CheckpointError

__all__ = ["Snapshot", "check_entries", "collect"]


@dataclass
class Snapshot:
    """What one rank took from ``state``/``per_rank``: entry kinds, the replicated entries (rank 0 only), this
    rank's RNG and per-rank entries (``mine``), and the live sharded entries (DCP writes those)."""

    kinds: dict[str, str] = field(default_factory=dict)
    replicated: dict[str, Any] = field(default_factory=dict)
    mine: dict[str, Any] = field(default_factory=dict)
    sharded: dict[str, Any] = field(default_factory=dict)


def check_entries(state: object, per_rank: object, err_rank: int | None) -> None:
    for what, value in (("state", state), ("per_rank", per_rank if per_rank is not None else {})):
        if not isinstance(value, dict):
            raise CheckpointError(f"{what} is a {type(value).__name__}; expected a dict of named entries. Fix: "
                                  "pass {'model': model, 'optimizer': optimizer, ...}.", rank=err_rank)
    names = [n for n in (*state, *(per_rank or {})) if type(n) is not str or not 0 < len(n) <= 256]  # type: ignore
    if names:
        raise CheckpointError(f"entry name {names[0]!r:.60} is a {type(names[0]).__name__}; expected a str of 1 "
                              "to 256 characters (the manifest records names as JSON strings). Fix: name entries "
                              "with short strings.", rank=err_rank)


def collect(state: dict[str, Any], per_rank: dict[str, Any] | None, *, rank: int, clone: bool,
            staging: dict[tuple[Any, ...], torch.Tensor], err_rank: int | None) -> Snapshot:
    """Snapshot the replicated entries (on rank 0), this rank's RNG and per-rank entries, and every entry's kind;
    the sharded entries are returned live (their writer copies them)."""
    check_entries(state, per_rank, err_rank)
    out = Snapshot()
    shared, own = [_payload.MAX_VALUES], [_payload.MAX_VALUES - 2000]  # one budget per file (RNG state: ~700)
    for name, value in state.items():
        if _payload.is_sharded(value) or is_sharded_stateful(value):
            out.kinds[name] = "sharded"
            out.sharded[name] = value
            continue
        kind, entry = _payload.entry_state(name, value)
        entry = _payload.plain(entry, f"state[{name!r}]", shared)
        if kind != "module":  # load refuses them in plain data and in an object's state (a module's copy is bounded)
            _payload.refuse_views(entry, f"state[{name!r}]")
        out.kinds[name] = kind
        if rank == 0:
            out.replicated[name] = _payload.snapshot(entry, clone=clone, staging=staging, key=("r", name))
    out.mine = {"rng": _payload.capture_rng(), "per_rank": {}}
    for name, value in (per_rank or {}).items():
        kind, entry = _payload.entry_state(name, value)
        entry = _payload.plain(entry, f"per_rank[{name!r}]", own)
        if kind != "module":
            _payload.refuse_views(entry, f"per_rank[{name!r}]")
        out.mine["per_rank"][name] = _payload.snapshot(entry, clone=clone, staging=staging, key=("p", name))
    return out
