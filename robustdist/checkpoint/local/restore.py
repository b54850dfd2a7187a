"""Recovery from the in-memory tier (``LocalTier.load``): agree on a step, fetch, verify, restore.

Every rank calls it; the collectives run on the tier's own group.

1. Each rank lists the copies its node holds (:func:`.layout.scan`: validated ``meta.json``, this
   lineage and world size only). **Collective: all_gather** of the lists, with rank 0's durable step.
2. Candidates: the steps, newest first, not older than the durable tier's newest, for which every rank's
   state has at least one copy somewhere in the job (and rank 0's has the replicated entries). For one
   candidate, every rank computes the same assignment: rank r's state comes from r's own copy if it holds one,
   else from a copy on another rank of the same node, else from the replica a peer node holds.
3. Each assigned holder opens its copies (confined, exact size, no holes, a torch zip with a scanned pickle). A
   file only this rank uses is loaded over a mapping of it (:mod:`.mapped`: its structure now, its tensors later);
   one it also sends is read into memory and checked against ``meta.json``'s checksum (:mod:`.sums`) as it is
   read. **Collective: all_gather** of the problems: a copy that failed is excluded, with a warning naming the
   rank, the copy and the reason, and the assignment is made again (the next source, then the next step).
4. Each rank whose state is held elsewhere receives it point to point, and the ranks of a node that holds no copy
   of the replicated entries receive those (:mod:`.wire`, checksummed).
5. Each rank deserialises with ``torch.load(weights_only=True)`` (after the same zip and pickle scan as the
   durable tier), validates the shapes (:mod:`.._schema`) and checks every entry against its live object
   (:mod:`.._live`, as the durable loader does). **Collective: all_gather** of the problems: corrupt content
   excludes its source (back to 3); entries that do not fit the live objects end the in-memory attempt
   (None: the durable tier decides, and names the problem), once a mapped file's bytes are found to be what was
   written (else it is corrupt).
6. Restore as the durable loader does (:mod:`.._restore`: unchecked objects with copies first, then this
   rank's local shards for FSDP entries, then the checked entries; **collective: all_gather** after each
   stage), then the RNG. A mapped file's tensors go into new memory before the unchecked objects are restored,
   and straight into the live tensors they restore just before the checked ones, their checksum judged then
   (**collective: all_gather**; a file whose sum disagrees is excluded and removed, the unchecked objects put
   back, and the assignment made again). The result is bit-identical to loading the same step from the durable
   tier.

A rank's own copy of the step as this process took it (:mod:`.held`: kept across an in-process recovery) is used
in place of reading and deserialising that copy's files (3 and 5); the checks of 5 and the restore of 6 still run.

Nothing is written during recovery, and only a copy found damaged while being copied into place is deleted, so a
crash in it leaves every good copy for the next attempt. A load that wrote into live tensors and then restored
nothing says so (``LocalTier.overwritten``): the caller must not train on from those objects as if fresh.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any, Callable, Protocol

import torch

from robustdist.checkpoint import _payload, _restore, _schema
from robustdist.checkpoint._loading import check_entries
from robustdist.checkpoint._safeio import check_torch_zip
from robustdist.checkpoint._schema import weights_only_reason
from robustdist.checkpoint._types import LoadedCheckpoint
from robustdist.checkpoint.local import layout
from robustdist.checkpoint.local import mapped as _mapped
from robustdist.checkpoint.local.held import Held
from robustdist.checkpoint.local.sources import Candidate, Source, assign, describe, reads, replicated_on, row
from robustdist.checkpoint.local.shards import restore_shards
from robustdist.checkpoint.local.wire import Blob, exchange
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError
from robustdist.runtime.log import get_logger, user_stacklevel, warn


class LocalTier(Protocol):
    """What recovery uses of :class:`robustdist.checkpoint.local.tier.LocalTier` (which imports this module)."""

    directory: str
    lineage: str
    rank: int
    world_size: int
    nodes: list[int]
    timeout: float
    group: Any
    collectives: Any
    overwritten: str
    filled: bool
    refused: list[Any]

__all__ = ["recover"]

log = get_logger(__name__)


class _Skip(Exception):
    """This rank already found its copies corrupt: skip the checks against the live objects."""


# ---------------------------------------------------------------------- reading
def _torch_loads(data: Any, where: str) -> Any:
    fh = io.BytesIO(data)
    check_torch_zip(fh, where, length=len(memoryview(data)), values=_schema.MAX_PAYLOAD_VALUES,
                    payload=True)
    try:
        payload = torch.load(fh, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointCorruptError(f"{where}: refused to load: {weights_only_reason(e)}; nothing was executed") \
            from e
    except Exception as e:
        raise CheckpointCorruptError(f"{where}: not a loadable torch file ({type(e).__name__}: {str(e)[:200]})") from e
    _schema.check_size(where, payload, _schema.MAX_PAYLOAD_VALUES)
    return payload


def _loaded(file: Any, where: str) -> Any:
    """What a copy's file holds: its structure where it is mapped (tensors copied into place later), else
    deserialised from its bytes."""
    if isinstance(file, _mapped.Mapped):
        return file.value
    return _torch_loads(file.numpy() if isinstance(file, torch.Tensor) else file, where)


def _inventory(tier: LocalTier) -> list[tuple[int, str, int, dict[str, int], dict[str, str], str, str]]:
    holdings, skipped = layout.scan(tier.directory)
    for line in skipped[:8]:
        warn(f"rank {tier.rank}: in-memory checkpoint copy skipped as invalid: {line}", stacklevel=user_stacklevel())
    rows = []
    for h in holdings:
        if h.lineage != tier.lineage or h.world_size != tier.world_size:
            continue
        rows.append((h.owner, h.role, h.step, {n: e["size"] for n, e in h.files.items()}, h.kinds, h.path, h.save))
    return rows


def _find(tier: LocalTier, source: Source, cand: Candidate) -> layout.Holding:
    holdings, _ = layout.scan(tier.directory)
    _, owner, role = source
    step, save = cand
    for h in holdings:
        if (h.owner, h.role, h.step, h.save, h.lineage) == (owner, role, step, save, tier.lineage):
            return h
    raise CheckpointCorruptError(f"{layout.step_path(tier.directory, owner, role, step)}: gone since it was listed")


# ---------------------------------------------------------------------- the protocol
def recover(tier: LocalTier, state: dict[str, Any], per_rank: dict[str, Any], at_least: int | None,
            held: Held | None = None) -> LoadedCheckpoint | None:
    """Steps 1 to 6 of the module docstring on this rank; ``held``: this rank's own copy of a step as this process
    took it (:mod:`.held`), used in place of reading and deserialising that copy's files."""
    c = tier.collectives
    everyone = c.all_gather((_inventory(tier), at_least if tier.rank == 0 else None), "local inventory")
    floor = everyone[0][1]
    candidates = sorted({(row[2], row[6]) for rows, _ in everyone for row in rows if floor is None or row[2] >= floor},
                        reverse=True)
    excluded: set[tuple[Any, ...]] = set()
    outcome: LoadedCheckpoint | str | None = None
    for cand in candidates:
        while (assigned := assign(cand, everyone, tier.nodes, excluded)) is not None:
            outcome = _attempt(tier, cand, assigned, everyone, state, per_rank, excluded, held)
            if outcome == "unfit" or isinstance(outcome, LoadedCheckpoint):
                break
        if outcome == "unfit" or isinstance(outcome, LoadedCheckpoint):
            break
    if isinstance(outcome, LoadedCheckpoint):
        return outcome
    if tier.filled:  # every rank filled (a step every rank reaches): whether any live object was written
        tier.overwritten = next((why for why in c.all_gather(tier.overwritten, "local outcome") if why), "")
    return None


def _attempt(tier: LocalTier, cand: Candidate, assigned: dict[int, Source], everyone: list[Any],
             state: dict[str, Any], per_rank: dict[str, Any], excluded: set[tuple[Any, ...]],
             held: Held | None) -> LoadedCheckpoint | str | None:
    """One assignment of sources for ``cand``: the loaded checkpoint, "unfit" (the in-memory attempt ends: the
    durable tier decides), or None (a source was excluded: assign again)."""
    c, rank = tier.collectives, tier.rank
    step = cand[0]
    source0, mine_src = assigned[0], assigned[rank]
    # the replicated entries: from a copy on this rank's node if there is one (no transfer), else sent by source0
    near = {n: replicated_on(n, cand, everyone, tier.nodes, excluded) for n in set(tier.nodes)}
    here = near[tier.nodes[rank]]
    far = [r for r in range(tier.world_size) if near[tier.nodes[r]] is None]
    # this rank's own copy, as this process holds it: its payload, and rank 0's replicated entries unless sent
    own_src = (rank, rank, "own")
    held = held if held is not None and (held.step, held.save) == cand else None
    mem_payload = held is not None and mine_src == own_src
    mem_replicated = held is not None and rank == 0 and here == own_src
    unread = {layout.PAYLOAD} if mem_payload else set()
    if mem_replicated and not (source0 == own_src and far):  # else read: it is sent to the ranks of far nodes
        unread.add(layout.REPLICATED)
    data: dict[Source, dict[str, Any]] = {}
    problems: list[tuple[Source, str]] = []
    # a file only this rank uses is restored where it lies (.mapped: copied once, into place); one it also sends is
    # read into memory
    sent = {(src, layout.PAYLOAD) for owner, src in assigned.items() if src[0] == rank and owner != rank}
    sent |= {(source0, layout.REPLICATED)} if source0[0] == rank and far else set()
    for source, names in reads(rank, assigned, here):
        names = [n for n in names if source != own_src or n not in unread]
        if not names:
            continue
        try:
            holding = _find(tier, source, cand)
            for n in names:
                where = f"{describe(source, step)} ({n})"
                got = _mapped.load(holding, n, where) if (source, n) not in sent and _mapped.usable() else None
                data.setdefault(source, {})[n] = got if got is not None else layout.read_verified(holding, n)
        except CheckpointCorruptError as e:
            problems.append((source, str(e)[:500]))
        except Exception as e:  # an I/O error, memory short, a crafted file torch chokes on: not usable here
            problems.append((source, f"{describe(source, step)}: could not be read ({type(e).__name__}: "
                                     f"{str(e)[:300]})"))
    if _exclude(tier, step, c.all_gather(problems, "local read"), excluded):
        return None
    # step 4: move the bytes (point to point: each payload to its owner, the replicated entries to the ranks of
    # nodes that hold no copy of them)
    sends: dict[int, list[Blob]] = {}
    for owner, src in assigned.items():
        if src[0] == rank and owner != rank:
            sends.setdefault(owner, []).append(Blob.of(data[src][layout.PAYLOAD]))
    if source0[0] == rank and far:
        replicated_blob = Blob.of(data[source0][layout.REPLICATED])  # one CRC however many ranks it goes to
        for r in far:
            sends.setdefault(r, []).append(replicated_blob)
    receive = sorted(({mine_src[0]} if mine_src[0] != rank else set()) | ({source0[0]} if rank in far else set()))
    got = exchange(tier.group, rank, sends, receive, timeout=tier.timeout, what=f"recovery of step {step}") \
        if sends or receive else {}
    payload_file = got[mine_src[0]][0].tensor if mine_src[0] != rank else None if mem_payload else \
        data[mine_src][layout.PAYLOAD]
    replicated_src = here if here is not None else source0
    replicated_file = got[source0[0]][-1].tensor if rank in far else None if mem_replicated else \
        data[replicated_src][layout.REPLICATED]
    # step 5: deserialise and check
    kinds = row(everyone, source0, cand)[4]
    source0 = replicated_src if rank not in far else source0  # the copy whose bytes this rank checks
    checked, replicated, mine, payload = None, None, None, None
    read: list[str] = []  # the held copies that failed their checks (their files were read instead)
    problem: tuple[Any, ...] | None = None
    corrupt_of: Source = source0
    try:
        where0 = f"{describe(source0, step)} ({layout.REPLICATED})"
        corrupt_of = source0
        copy = dict(step=step, lineage=tier.lineage, save=cand[1])

        def check(value: Any) -> Any:
            return _schema.check_replicated(where0, layout.unbind(value, layout.REPLICATED, owner=0, where=where0,
                                                                  **copy), kinds)
        replicated = _held_or_file(tier, held.replicated, check, own_src, cand, layout.REPLICATED, where0, read) \
            if held is not None and mem_replicated else check(_loaded(replicated_file, where0))
        where = f"{describe(mine_src, step)} ({layout.PAYLOAD})"
        corrupt_of = mine_src
        check_own = _payload_check(where, rank, copy)
        payload, mine = _held_or_file(tier, held.payload, check_own, own_src, cand, layout.PAYLOAD, where, read) \
            if held is not None and mem_payload else check_own(_loaded(payload_file, where))
    except CheckpointCorruptError as e:  # the bytes of one copy are wrong: exclude it, try the next source
        problem = ("corrupt", corrupt_of, str(e)[:500])
    except Exception as e:  # a check that itself failed on a crafted value: still that copy's problem
        problem = ("corrupt", corrupt_of, f"could not be checked ({type(e).__name__}: {str(e)[:400]})")
    try:
        if problem is not None:
            raise _Skip
        state = _restore.present(state, kinds, f"in-memory step {step}")
        saved_per_rank = mine.get("per_rank", {})
        check_entries(where, kinds, replicated, state, saved_per_rank, per_rank)
        checked = (replicated, mine, payload["shards"], _restore.plan(kinds, replicated, state, saved_per_rank,
                                                                      per_rank))
    except _Skip:
        pass
    except Exception as e:  # well-formed copies that do not fit the live objects: the durable tier decides
        problem = ("unfit", None, str(e)[:500] if isinstance(e, CheckpointError) else
                   f"{type(e).__name__}: {str(e)[:500]}")
    if problem is not None and problem[0] == "unfit":  # unfit only if its bytes are what was written
        for f, src in ((payload_file, mine_src), (replicated_file, source0)):
            if isinstance(f, _mapped.Mapped) and not f.verify():
                problem = ("corrupt", src, f"{f.where}: its checksum differs from its meta.json (the bytes changed)")
    rows = c.all_gather(problem, "local check")
    corrupt = [(r[1], f"rank {i}: {r[2]}") for i, r in enumerate(rows) if r and r[0] == "corrupt"]
    if corrupt:
        _exclude(tier, step, [[(s, p)] for s, p in corrupt], excluded)
        return None
    unfit = [f"rank {i}: {r[2]}" for i, r in enumerate(rows) if r]
    if unfit:
        warn(f"in-memory checkpoint step {step} does not fit the live objects ({'; '.join(unfit)[:1500]}); the "
             "durable tier is used instead.", stacklevel=user_stacklevel())
        return "unfit"
    assert checked is not None
    tier.filled = True  # every rank gets here together
    mapped = [(f, src) for f, src in ((payload_file, mine_src), (replicated_file, source0))
              if isinstance(f, _mapped.Mapped)]
    try:  # only where the bytes go: on any problem, new memory (never a rank leaving the protocol)
        live = _mapped.destinations(_checked_entries(checked[3], state, replicated, per_rank, mine)) if mapped else {}
    except Exception as e:
        log.warning("rank %d: live tensors not used as destinations (%s: %s)", tier.rank, type(e).__name__, str(e))
        live = {}
    outcome = _restore_all(tier, step, checked, state, mine_src, mem_payload and layout.PAYLOAD not in read,
                           mapped, live)
    if outcome == "corrupt":  # a mapped file's sum disagreed: assign again without it
        _exclude(tier, step, [[row] for row in tier.refused], excluded)
        return None
    return outcome or "unfit"


def _checked_entries(plan: _restore.Plan, state: dict[str, Any], replicated: dict[str, Any],
                     per_rank: dict[str, Any], mine: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, live object, saved state)`` of the entries the plan restores as checked (never copied first)."""
    checked = {id(live) for _, live, _ in plan.checked}
    saved_per_rank = mine.get("per_rank", {})
    return [(n, live, replicated[n]) for n, live in state.items() if id(live) in checked and n in replicated] + \
        [(n, live, saved_per_rank[n]) for n, live in per_rank.items() if id(live) in checked and n in saved_per_rank]


def _payload_check(where: str, owner: int, copy: dict[str, Any]
                   ) -> Callable[[Any], tuple[dict[str, Any], dict[str, Any]]]:
    """Rank ``owner``'s payload of the copy ``copy`` names, checked: ``(payload, its "mine" entry)``."""
    def check(found: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        payload = layout.unbind(found, layout.PAYLOAD, owner=owner, where=where, **copy)
        if not isinstance(payload, dict) or not isinstance(payload.get("shards"), dict):
            raise CheckpointCorruptError(f"{where}: expected a dict with 'mine' and 'shards'")
        return payload, _schema.check_rank_payload(where, payload.get("mine"))
    return check


def _held_or_file(tier: LocalTier, value: Any, check: Callable[[Any], Any], source: Source, cand: Candidate,
                  name: str, where: str, read: list[str]) -> Any:
    """``check(value)``, this rank's own copy as this process holds it; if that fails, the same copy's file (the
    file's own problem is then the copy's)."""
    try:
        return check(value)
    except Exception as e:
        log.warning("rank %d: %s as this process holds it failed its check (%s: %s); reading the file instead",
                    tier.rank, where, type(e).__name__, str(e)[:300])
        read.append(name)
    return check(_torch_loads(layout.read_verified(_find(tier, source, cand), name), where))


def _exclude(tier: LocalTier, step: int, rows: list[Any], excluded: set[tuple[Any, ...]]) -> bool:
    bad = [(tuple(source), text) for row in rows for source, text in row]
    for source, text in bad:
        key = (tier.nodes[source[0]], source[1], source[2], step)
        if key not in excluded:
            excluded.add(key)
            if tier.rank == 0:
                warn(f"in-memory checkpoint: {describe(source, step)} is unusable ({text}); falling back to the next "
                     "source (another copy, an older step, then the durable tier).", stacklevel=user_stacklevel())
    return bool(bad)


def _restore_all(tier: LocalTier, step: int, checked: tuple[Any, ...], state: dict[str, Any],
                 source: Source, from_process: bool, mapped: list[tuple[_mapped.Mapped, Source]],
                 live: dict[int, torch.Tensor]) -> LoadedCheckpoint | str | None:
    """Step 6; None when the restore failed somewhere (the live objects are put back), "corrupt" when a mapped
    file's sum disagreed (``tier.refused`` names it; the unchecked entries are put back).

    The tensors of the mapped files go into new memory first (:meth:`.mapped.Mapped.fill_new`), then the unchecked
    entries are restored (copied first, put back on a problem; a problem there on a rank with mapped files has
    those files verified, so damage is called damage), and only then are the remaining tensors copied straight into
    the live ones and the files' sums judged (:meth:`.mapped.Mapped.fill_live`), before the checked entries are
    restored. A load that wrote into live tensors and then restored nothing records why in ``tier.overwritten``."""
    c = tier.collectives
    replicated, own, shards, plan = checked
    sharded = dict(plan.sharded)
    plan.sharded = {}
    copies: list[Any] = []
    problem = None
    try:
        for f, _ in mapped:
            f.fill_new(live)
    except Exception as e:  # memory short, say
        problem = f"rank {tier.rank}: could not copy a mapped file's tensors ({type(e).__name__}: {str(e)[:300]})"
    if problem is None:
        copies, problem = _restore.restore_unchecked(plan, "", None, tier.group)
    if sharded and problem is None:
        try:
            copies += [(f"state[{n!r}]", v, _restore._capture(v)) for n, v in sharded.items()]
            restore_shards(sharded, shards)
        except Exception as e:
            problem = f"{type(e).__name__}: {str(e)[:500]}"
    damaged = next(((src, f"{f.where}: its checksum differs from its meta.json (the bytes changed)")
                    for f, src in mapped if problem is not None and not f.verify()), None)
    rows = c.all_gather((problem, damaged), "local restore")
    bad = [p for p, _ in rows if p]
    tier.refused = [d for _, d in rows if d]
    if not tier.refused and not bad:
        refused = None
        for f, src in mapped:
            try:
                f.fill_live(live)
            except CheckpointCorruptError as e:
                refused = (src, str(e)[:500])
                with contextlib.suppress(Exception):  # damaged: never copied into place again
                    layout.remove_copy(tier.directory, src[1], src[2], step)
            except Exception as e:  # the live tensors changed under the copy, memory short...
                refused = (src, f"{f.where}: could not be copied into place ({type(e).__name__}: {str(e)[:300]})")
            if refused is not None:
                break
        tier.refused = [row for row in c.all_gather(refused, "local fill") if row]
        if tier.refused and any(f.touched for f, _ in mapped):
            tier.overwritten = tier.overwritten or tier.refused[0][1]
    if tier.refused:
        _restore.put_back(copies)
        return "corrupt"
    if not bad:
        bad = list(c.problems(_restore.restore_checked(plan), "local apply").values())
        if bad and any(f.touched for f, _ in mapped):
            tier.overwritten = tier.overwritten or bad[0]
    if bad:
        _restore.put_back(copies)
        warn(f"in-memory checkpoint step {step} could not be restored ({'; '.join(bad)[:1500]}); the durable tier is "
             "used instead.", stacklevel=user_stacklevel())
        return None
    _payload.restore_rng(own["rng"])
    holder, owner, role = source
    kind = "memory" if role == "own" and tier.nodes[holder] == tier.nodes[tier.rank] else "replica" \
        if role == "replica" else "peer"
    detail = describe(source, step) + (", as this process holds it (no file read)" if from_process else "")
    log.info("rank %d restored step %d from %s", tier.rank, step, detail)
    return LoadedCheckpoint(step=step, path=layout.step_path(tier.directory, owner, role, step), state=replicated,
                            per_rank=own.get("per_rank", {}), metadata={}, manifest={}, source=kind,
                            source_detail=detail, from_process=from_process)
