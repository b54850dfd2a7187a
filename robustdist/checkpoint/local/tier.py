"""``LocalTier``: an in-memory checkpoint tier, replicated to a peer node, beside the durable one.

A durable checkpoint (:class:`~robustdist.checkpoint.AtomicCheckpointer`) survives anything, but it is slow to
write at scale, so it is taken rarely, and a crash loses every step since. This tier is taken often and cheaply:

* **Save** (collective, every rank): the only blocking part is the snapshot to host memory (the same snapshot
  the durable tier takes, :mod:`.._snapshot`; under FSDP each rank's own shards). On a background thread,
  each rank then serialises its state and commits it into its node's tier directory
  (``<base>/robustdist-<uid>-<hash of the lineage>``, ``base`` ``/dev/shm`` by default; staged, checksummed,
  renamed into place: :mod:`.layout`), sends a copy to its peer (the same
  local rank on the next node, over this tier's own gloo group: :mod:`.wire`), and commits the copy
  it receives. Rank 0 also writes the replicated entries, once for the job (not once per rank), and
  replicates them to its peer. Every copy carries the save's id (rank 0's, agreed with the snapshot), so
  copies of one step from two different saves are never combined. Finally one small all_gather: the step is
  *complete* only when every rank's copy and its replica are in place. Only then are older steps deleted, on
  each node by its lowest rank (``keep_last`` complete steps stay),
  so a crash at any point leaves the previous complete step intact. A background error is raised at the next
  ``save``, ``wait``, ``load`` or ``close``, naming the ranks.
* **Memory** is checked at the first save and whenever the copies grow (:mod:`.memory`): each node
  needs ``(keep_last + 1)`` times the copies it holds; a tier that does not fit in the directory's free space
  (plus what it already holds there) or in available RAM is refused on every rank, with the numbers and the
  fix, before anything is written. Other tiers of this user left on the node are named.
* **Load** (collective): every rank lists what its node holds; the ranks agree on the newest step that is
  complete across the job from any source (its own copy, the replica a peer node holds for it, or a copy
  left on this node by another rank) and newer than the durable tier's; each rank fetches what it lacks from
  the rank that holds it, verifies it and restores it exactly as the durable tier would
  (:mod:`.restore`). A corrupt or missing copy falls back, with a warning naming the rank and the
  source, to the next source, then the next step; ``load`` returns None when the durable tier must be used.

One node (or ``replicas=0``): no replica is kept; a node loss is then a job loss, recovered from the durable
tier. The tier's files stay when a job fails (the restart needs them) and are removed by ``close(clean=True)``
when every rank closes cleanly (a vote in the job's store: a rank leaving on an error never waits).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from robustdist.checkpoint import _background, _faults
from robustdist.checkpoint._schema import MAX_STEP, is_int
from robustdist.checkpoint._snapshot import collect
from robustdist.checkpoint.local import held as _held
from robustdist.checkpoint.local import layout, leftovers, memory
from robustdist.checkpoint.local import restore as _local_restore
from robustdist.checkpoint.local.lineage import LINEAGE, lineage_of
from robustdist.checkpoint.local.memory import node_need
from robustdist.checkpoint.local.shards import local_shards
from robustdist.checkpoint.local.wire import Blob, exchange, nbytes, serialise
from robustdist.runtime import dist as _dist
from robustdist.runtime import exit_drain
from robustdist.runtime.dist import Collectives
from robustdist.runtime.errors import CheckpointError, ranks_phrase
from robustdist.runtime.log import get_logger
from robustdist.runtime.node import node_label, node_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from robustdist.checkpoint._types import LoadedCheckpoint

__all__ = ["LINEAGE", "LocalSaveInfo", "LocalTier", "lineage_of", "node_need"]  # lineage: .lineage

log = get_logger(__name__)
OPS = ("local save", "local load")
@dataclass
class LocalSaveInfo:
    """What a local save did: ``blocking_seconds`` (the snapshot), then, when the background part is done,
    ``total_seconds``, ``bytes`` (what this rank wrote and received) and whether the step is ``complete``."""

    step: int
    blocking_seconds: float = 0.0
    total_seconds: float | None = None
    bytes: int | None = None
    complete: bool = False
    done: threading.Event = field(default_factory=threading.Event, repr=False)


class LocalTier:
    """The in-memory tier (see the module docstring).

    Args:
        base: where the tier's directory is made (default ``/dev/shm``, else the temp directory); the tier
            writes only inside ``<base>/robustdist-<uid>-<hash of lineage>`` (:attr:`directory`). The same path
            on every node.
        lineage: names what the copies belong to (harden uses a token kept in the durable directory); copies
            of another lineage or world size are never sources.
        replicas: 1 (a copy on the next node) or 0.
        keep_last: complete steps kept (1 or 2).
        timeout: seconds bounding every wait (default 1800).
        arrival_timeout: seconds every rank has to reach ``save``/``load`` once another rank has, and a clean
            ``close`` waits for the other ranks' votes (default 60).
    """

    def __init__(self, base: str | os.PathLike[str] | None = None, *, lineage: str = "default",
                 replicas: int = 1, keep_last: int = 1, timeout: float | None = None,
                 arrival_timeout: float | None = None):
        if replicas not in (0, 1) or isinstance(replicas, bool):
            raise CheckpointError(f"replicas={replicas!r}; expected 0 or 1. Fix: pass replicas=1 (a copy on the next "
                                  "node) or 0.")
        if keep_last not in (1, 2) or isinstance(keep_last, bool):
            raise CheckpointError(f"keep_last={keep_last!r}; expected 1 or 2 complete in-memory steps. Fix: pass 1 "
                                  "or 2 (the durable tier keeps the history).")
        self.lineage = str(lineage)
        base = os.fspath(base) if base is not None else ("/dev/shm" if os.path.isdir("/dev/shm")
                                                          else os.environ.get("TMPDIR", "/tmp"))
        self.directory = layout.tier_root(os.path.abspath(base), self.lineage)
        """The tier's own directory: the only one it writes, rotates or removes."""
        layout.make_root(self.directory)
        self._in_use = leftovers.hold(self.directory)  # what `robustdist clean` sees: a job uses this directory
        self.keep_last = keep_last
        self.timeout = float(timeout) if timeout is not None else 1800.0
        self.arrival_timeout = float(arrival_timeout) if arrival_timeout is not None else 60.0
        self.distributed = _dist.is_multi()
        self.group: ProcessGroup | None = None
        if self.distributed:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
            exit_drain.install()
        try:
            self.rank = _dist.rank(self.group) if self.distributed else 0
            self.world_size = _dist.world_size(self.group) if self.distributed else 1
            self.collectives = Collectives(self.group, self.rank, self.world_size, timeout=self.timeout,
                                           arrival_timeout=self.arrival_timeout, error=CheckpointError,
                                           scope="local-ckpt", noun="in-memory checkpoint", owner="in-memory tier",
                                           ops=OPS, knob="checkpoint.arrival_timeout")
            keys = self.collectives.all_gather(_node_key(), "node map")
        except BaseException:
            group, self.group = self.group, None
            _dist.destroy_group(group, "the in-memory tier's group")
            leftovers.release(self._in_use)
            raise
        order = list(dict.fromkeys(keys))
        self.nodes = [order.index(k) for k in keys]
        """Node index of every rank (in order of each node's lowest rank)."""
        self.peers = self._peers(replicas)
        """The rank holding each rank's replica (None: no replica)."""
        self.senders = [r for r, p in enumerate(self.peers) if p == self.rank]
        self.leader = self.nodes.index(self.nodes[self.rank]) == self.rank
        """Whether this rank is its node's lowest: it rotates every copy on the node."""
        if replicas and len(order) == 1 and self.rank == 0:
            log.info("in-memory checkpoints: one node, so no replica is kept (a replica must be on another node); "
                     "a node loss is a job loss here, recovered from the durable tier")
        self.others = layout.siblings(self.directory) if self.leader else []
        if self.others:
            log.warning("other in-memory checkpoint tiers of this user hold %s of RAM on this node (%s). Fix: `robustdist "
                        "clean --dir %s` removes those no running job uses", memory.size(sum(b for _, b in self.others)),
                        ", ".join(p for p, _ in self.others[:3]), os.path.dirname(self.directory))
        self.last_complete: int | None = None
        """The newest step this rank saw complete (saved or loaded)."""
        self.overwritten, self.filled = "", False
        """``overwritten``: why the last :meth:`load` wrote into live tensors and then restored nothing ("" when it
        did not): the live objects are then neither as they were nor a checkpoint, and the caller must not start
        from scratch with them. ``filled``: whether it got as far as copying into place."""
        self.refused: list[Any] = []
        self.node_bytes: int | None = None
        """What the tier needs on this node (updated at each save whose copies grew), for ``ray_memory_plan``."""
        self.on_complete: Callable[[int], None] | None = None
        """Called on the background thread with the step each time a save completes (harden's progress mark)."""
        self._checked_sizes: list[int] | None = None
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}
        self._held: _held.Held | None = None  # the last committed own copy as this process took it (.held)
        self.carry = False  # a close keeping the files hands _held to this process's next tier here (.held)
        self._carried = _held.take(self.directory, rank=self.rank, world_size=self.world_size, lineage=self.lineage)
        self._thread: threading.Thread | None = None
        self._leaving = _background.Leaving()  # the last save's background part: in its collectives? left behind?
        self._error: BaseException | None = None
        self._closed = False

    def _peers(self, replicas: int) -> list[int | None]:
        if not replicas:
            return [None] * self.world_size
        count = max(self.nodes) + 1
        members = {n: [r for r, m in enumerate(self.nodes) if m == n] for n in range(count)}
        peers: list[int | None] = []
        for r, n in enumerate(self.nodes):
            if count == 1:
                peers.append(None)
                continue
            local = members[n].index(r)
            nxt = members[(n + 1) % count]
            peers.append(nxt[local % len(nxt)])
        return peers

    @property
    def err_rank(self) -> int | None:
        return self.rank if self.distributed else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], *, per_rank: dict[str, Any] | None = None) -> LocalSaveInfo:
        """Snapshot ``state``/``per_rank`` and commit it in the background (see the module docstring)."""
        self._check_open()
        self.wait()
        start = time.perf_counter()
        if not is_int(step, 0, MAX_STEP):
            raise CheckpointError(f"step={step!r:.60}; expected a non-negative integer. Fix: pass the training step.",
                                  rank=self.err_rank)
        self.collectives.arrive("local save")
        self._held = self._carried = None  # the snapshot below overwrites the buffers; a newer step is coming
        snap, shards, error = None, {}, None
        try:
            snap = collect(state, per_rank, rank=self.rank, clone=True, staging=self._staging, err_rank=self.err_rank)
            shards = local_shards(snap.sharded, self._staging)
        except BaseException as e:  # told to every rank in the agreement below; every rank raises there
            error = e
        size = nbytes(snap.replicated) + nbytes(snap.mine) + nbytes(shards) if snap is not None else 0
        save_id = self._agree_snapshot(step, error, size)
        assert snap is not None
        info = LocalSaveInfo(step=step, blocking_seconds=time.perf_counter() - start)
        job = (step, save_id, snap.kinds, snap.replicated, {"mine": snap.mine, "shards": shards}, info, start)
        self._leaving = _background.Leaving()
        self._thread = _background.start(self, self._complete, job, leaving=self._leaving, done=info.done,
                                         what=f"in-memory checkpoint step {step}",
                                         name=f"robustdist-local-ckpt-{step}", logger=log)
        return info

    def _agree_snapshot(self, step: int, error: BaseException | None, nbytes: int) -> str:
        """Every rank's snapshot outcome, step and size; the save id (rank 0's). Raises the same error on every
        rank when one failed or they disagree; checks the memory when the copies grew."""
        text = None if error is None else f"{type(error).__name__}: {str(error)[:1500]}"
        everyone = self.collectives.all_gather((text, step, nbytes, uuid.uuid4().hex[:16]), "local snapshot")
        failed = {r: row[0] for r, row in enumerate(everyone) if row[0]}
        steps = {row[1] for row in everyone}
        if failed:
            detail = "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items()))
            exc = CheckpointError(f"in-memory checkpoint step {step} was not taken: {ranks_phrase(failed)} could not "
                                  f"snapshot ({detail}). Nothing was written; the previous complete step stays. Fix: "
                                  "see the named ranks' errors.", rank=self.err_rank, ranks=sorted(failed))
            raise exc from error
        if len(steps) > 1:
            raise CheckpointError(f"ranks disagree on the in-memory checkpoint step ({sorted(steps)}); expected every "
                                  "rank to pass the same step. Nothing was written. Fix: pass the same step on every "
                                  "rank.", rank=self.err_rank)
        sizes = [row[2] for row in everyone]
        if self._checked_sizes is None or any(a > b for a, b in zip(sizes, self._checked_sizes)):
            self._check_memory(sizes)
            self._checked_sizes = sizes
        return str(everyone[0][3])

    def _check_memory(self, sizes: list[int]) -> None:
        node = self.nodes[self.rank]
        need = memory.node_need(sizes, self.nodes, self.peers, self.keep_last)[node]
        self.node_bytes = need
        mine = [r for r in range(self.world_size) if self.nodes[r] == node]
        held = [r for r, p in enumerate(self.peers) if p is not None and self.nodes[p] == node]
        in_flight = 2 * sum(sizes[r] for r in mine) + sum(sizes[r] for r in held)  # snapshot + serialised; incoming
        problem = memory.fits(self.directory, node, need, in_flight, self.others) if self.leader else None
        bad = list(self.collectives.problems(problem, "local memory check").items())
        if bad:
            shown = "; ".join(f"rank {r}: {p}" for r, p in bad[:4])
            raise CheckpointError(
                f"the in-memory checkpoint tier does not fit: {shown}. Expected it to fit beside training. Fix: set "
                "checkpoint.local_keep_last to 1, checkpoint.replicas to 0, point checkpoint.local_dir at a larger "
                "tmpfs (or raise /dev/shm's size), or turn the tier off (checkpoint.local_every_n_steps: null). "
                "Nothing was written.", rank=self.err_rank, ranks=[r for r, _ in bad])

    def _complete(self, step: int, save_id: str, kinds: dict[str, str], replicated: dict[str, Any],
                  payload: dict[str, Any], info: LocalSaveInfo, start: float) -> None:
        """The background part of a save (:func:`robustdist.checkpoint._background.start` runs it)."""
        info.bytes = self._write_and_replicate(step, save_id, kinds, replicated, payload)
        info.complete = True
        info.total_seconds = time.perf_counter() - start
        if self.on_complete is not None:
            self.on_complete(step)

    def _write_and_replicate(self, step: int, save_id: str, kinds: dict[str, str], replicated: dict[str, Any],
                             payload: dict[str, Any]) -> int:
        token = uuid.uuid4().hex[:12]
        meta = {"world_size": self.world_size, "lineage": self.lineage, "kinds": kinds, "save": save_id}
        copy = dict(step=step, owner=self.rank, lineage=self.lineage, save=save_id)
        payload = layout.bind(payload, layout.PAYLOAD, **copy)
        replicated = layout.bind(replicated, layout.REPLICATED, **copy)
        blobs = [Blob.of(serialise(payload))] + ([Blob.of(serialise(replicated))] if self.rank == 0 else [])
        names, written, problem = (layout.PAYLOAD, layout.REPLICATED), 0, None
        try:
            layout.remove_stale(self.directory, self.rank, "own")
            written += layout.commit_copy(self.directory, self.rank, "own", step, token, {
                n: b.view() for n, b in zip(names, blobs)}, meta, {n: b.checksum for n, b in zip(names, blobs)})
            # what the own copy holds, until the next snapshot: a load that agrees on this save uses it (.held)
            self._held = _held.Held(step, save_id, self.rank, self.world_size, self.lineage, payload, replicated)
        except Exception as e:  # still take part in the exchange (the peers wait for it), then report
            problem = f"writing its own copy into {self.directory}: {type(e).__name__}: {e}"
        _faults.phase("local_own_committed")
        leaving = self._leaving  # from here to the end only collectives, then rotation once they succeed
        stayed = leaving.enter()
        peer = self.peers[self.rank]
        sends = {peer: blobs} if peer is not None else {}
        try:
            if not stayed:
                raise CheckpointError("left behind by an in-process recovery", rank=self.err_rank)
            received = exchange(self.group, self.rank, sends, self.senders, timeout=self.timeout,
                                what=f"replication of step {step}") if sends or self.senders else {}
            for src, got in received.items():
                layout.remove_stale(self.directory, src, "replica")
                written += layout.commit_copy(self.directory, src, "replica", step, token,
                                              {n: b.view() for n, b in zip(names, got)}, meta,
                                              {n: b.checksum for n, b in zip(names, got)})
        except Exception as e:
            problem = problem or f"replicating: {e}"
        _faults.phase("local_replicated")
        if not leaving.enter():  # no collective on the old group once a recovery has moved on
            raise CheckpointError(f"in-memory checkpoint step {step} was left behind by an in-process recovery",
                                  rank=self.err_rank)
        failed = self.collectives.problems(problem, "local commit")
        stayed = leaving.leave_collective()  # past the collectives: wait() now waits for the rotation
        if failed:
            detail = "; ".join(f"rank {r}: {p}" for r, p in sorted(failed.items()))
            kept = (f"The previous complete step ({self.last_complete}) stays." if self.last_complete is not None
                    else "The copies of earlier steps stay.")
            raise CheckpointError(f"in-memory checkpoint step {step} is not complete: {ranks_phrase(failed)} failed "
                                  f"({detail[:2000]}). {kept} Fix: "
                                  "see the named ranks' errors (a full /dev/shm? a dead peer?).", rank=self.err_rank,
                                  ranks=sorted(failed))
        if not stayed:  # a recovery moved on without this save: the next generation owns the directory now
            raise CheckpointError(f"in-memory checkpoint step {step} was left behind by an in-process recovery; "
                                  "not rotated.", rank=self.err_rank)
        keep = {step} | ({self.last_complete} if self.keep_last == 2 and self.last_complete is not None else set())
        if self.leader:  # every copy on this node, stale ones of earlier rank-to-node mappings included
            layout.rotate_all(self.directory, keep)
        self.last_complete = step
        return written

    def wait(self) -> None:
        """Wait for the background part of the last save; raise its error (once) if it failed.

        During an in-process recovery a background part stuck in one of its collectives is left behind after
        :data:`~robustdist.checkpoint._background.ABANDON_S` seconds (:mod:`robustdist.checkpoint._background`);
        its files stay for the restart path, and this raises."""
        if self._thread is not None:
            waited = self.timeout + 60.0
            outcome = _background.join(self._thread, waited, self._leaving)
            if outcome == "left":
                self._thread = None
                raise CheckpointError(f"the in-memory checkpoint's background part was still in a collective "
                                      f"{_background.ABANDON_S:g} s after the recovery interrupted it; left to fail "
                                      "on its own. The previous complete step stays, and the next generation "
                                      "resumes from it: nothing to fix.", rank=self.err_rank)
            if outcome == "timeout":
                raise CheckpointError(f"the in-memory checkpoint's background part did not finish within "
                                      f"{waited:g} s; expected it to finish or fail. Fix: check the peers' "
                                      "logs.", rank=self.err_rank)
            self._thread = None
        if self._error is not None:
            raise _background.taken_error(self, "the in-memory checkpoint's background part failed", self.err_rank)

    # ------------------------------------------------------------------ load
    def load(self, *, state: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
             at_least: int | None = None) -> LoadedCheckpoint | None:
        """Restore the newest step complete across the job (from any rank's copy or replica) that is at least
        ``at_least`` (rank 0's value counts: the durable tier's newest step); None when there is none, so the
        caller loads the durable tier. Collective. After None, :attr:`overwritten` says whether the live objects
        were partly written by a copy found damaged mid-restore: then only a restore of another checkpoint may
        follow, not training from scratch."""
        self._check_open()
        try:
            self.wait()
        except CheckpointError as e:  # a failed last save leaves the previous complete step: recover from it
            if self._thread is not None:  # still running: its collectives would interleave with the load's
                raise
            log.warning("the last in-memory save failed before this load: %s", e)
        self.collectives.arrive("local load")
        held, self._carried = self._carried, None  # its own _held is not used: a load here reads the files
        if held is not None:  # used once: the restored objects may keep its tensors, so new buffers next save
            self._held, self._staging = None, {}
        self.overwritten, self.filled = "", False
        loaded = _local_restore.recover(self, dict(state or {}), dict(per_rank or {}), at_least, held=held)
        if loaded is not None:
            self.last_complete, self.overwritten = loaded.step, ""
        return loaded

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, clean: bool = False) -> None:
        """Wait for the background part, vote, and remove this tier's directory on this node only if every rank
        voted clean; then destroy the tier's group and raise the background part's error, if any.

        The vote goes through the job's store, not a collective: a rank leaving on an error (``clean=False``)
        posts its vote and returns at once, even when its peers are dead; a clean rank waits at most
        ``arrival_timeout`` for the other votes, and keeps the files (logging where) when one is missing or not
        clean. The files are kept for a restart in every doubtful case."""
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        try:
            try:
                self.wait()
            except BaseException as e:  # raised after the vote
                error, clean = e, False
            if self._thread is None and leftovers.voted_clean(self, clean):
                _held.discard(self.directory)
                try:
                    layout.remove_root(self.directory)
                except CheckpointError as e:
                    log.warning("in-memory tier: could not remove %s: %s", self.directory, e)
            else:  # a later tier of this process on the directory (an in-process recovery) restores from it
                # (a save left behind set _held, if at all, before its collectives: its copy is committed)
                _held.carry(self.directory, self._held if self.carry and self._thread is None else None)
                if self.leader:
                    log.info("in-memory checkpoints kept in %s for a restart (`robustdist clean --dir %s` removes "
                             "them once no job uses them)", self.directory, os.path.dirname(self.directory))
        finally:
            self._staging.clear()
            self._held = self._carried = None
            group, self.group = self.group, None
            _dist.destroy_group(group, "the in-memory tier's group")
            leftovers.release(self._in_use)
        if error is not None:
            try:
                raise error
            finally:  # the error's traceback holds this frame: no cycle keeping the tier (its buffers) alive
                error = None

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this LocalTier is closed; expected an open one. Fix: create a new one.")


def _node_key() -> str:
    """What tells this node from the others: the launcher's node rank, else the hostname and address."""
    rank = node_rank()
    return f"rank {rank}" if rank is not None else node_label()
