"""Which copy each rank's state comes from, in a recovery from the in-memory tier (:mod:`.restore`, step 2): the
same answer on every rank, from the lists every rank gathered (``everyone``: per rank, its node's copies as
``(owner, role, step, files, kinds, path, save id)`` rows, and rank 0's durable step)."""

from __future__ import annotations

from typing import Any

from robustdist.checkpoint.local import layout

__all__ = ["Candidate", "Source", "assign", "describe", "reads", "replicated_on", "row"]

Source = tuple[int, int, str]
"""``(holder rank, owner rank, role)``: one copy of one owner's state."""
Candidate = tuple[int, str]
"""``(step, save id)``: one save of one step (copies of two saves of a step are never combined)."""


def _local_index(nodes: list[int], rank: int) -> int:
    return [r for r, n in enumerate(nodes) if n == nodes[rank]].index(rank)


def assign(cand: Candidate, everyone: list[Any], nodes: list[int], excluded: set[tuple[Any, ...]]
            ) -> dict[int, Source] | None:
    """owner -> the copy of ``cand`` (a step and a save id) to use, the same on every rank, or None when some
    owner has no usable copy. ``excluded`` holds ``(node, owner, role, step)``: a bad copy is one directory,
    whichever rank of its node lists it. Among equal choices the rank with the owner's local index is taken,
    so the reads spread over a node's ranks instead of landing on its lowest."""
    out: dict[int, Source] = {}
    step, save = cand
    for owner in range(len(everyone)):
        options = []
        for holder, (rows, _) in enumerate(everyone):
            for o, role, s, files, _, _, sid in rows:
                if o != owner or s != step or sid != save or (nodes[holder], owner, role, step) in excluded:
                    continue
                if owner == 0 and layout.REPLICATED not in files:
                    continue
                rank_order = (0 if holder == owner else 1 if nodes[holder] == nodes[owner] else 2,
                              0 if role == "own" else 1,
                              0 if _local_index(nodes, holder) == _local_index(nodes, owner) else 1, holder)
                options.append((rank_order, (holder, owner, role)))
        if not options:
            return None
        out[owner] = min(options)[1]
    return out


def replicated_on(node: int, cand: Candidate, everyone: list[Any], nodes: list[int],
                   excluded: set[tuple[Any, ...]]) -> Source | None:
    """A copy of rank 0's state holding the replicated entries on ``node`` (own copy first), or None."""
    options = [(0 if role == "own" else 1, holder, (holder, 0, role))
               for holder, (rows, _) in enumerate(everyone) if nodes[holder] == node
               for o, role, s, files, _, _, sid in rows
               if o == 0 and (s, sid) == cand and layout.REPLICATED in files
               and (node, 0, role, s) not in excluded]
    return min(options)[2] if options else None


def reads(rank: int, assigned: dict[int, Source], here: Source | None) -> list[tuple[Source, list[str]]]:
    """What this rank reads from its node: the payloads it serves (and the replicated entries with rank 0's), and
    the replicated entries from ``here`` when its node holds a copy."""
    out: dict[Source, set[str]] = {}
    for owner, src in assigned.items():
        if src[0] == rank:
            out.setdefault(src, set()).update([layout.PAYLOAD] + ([layout.REPLICATED] if owner == 0 else []))
    if here is not None:
        out.setdefault(here, set()).add(layout.REPLICATED)
    return [(src, sorted(names)) for src, names in out.items()]


def row(everyone: list[Any], source: Source, cand: Candidate) -> tuple[Any, ...]:
    holder, owner, role = source
    return next(r for r in everyone[holder][0] if r[0] == owner and r[1] == role and (r[2], r[6]) == cand)


def describe(source: Source, step: int) -> str:
    holder, owner, role = source
    what = "its own copy" if role == "own" else "the replica"
    return f"{what} of rank {owner}'s step {step} held by rank {holder}"
