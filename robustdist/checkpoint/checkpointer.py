"""``AtomicCheckpointer``: a committed checkpoint is never lost or half-visible, whatever crashes when.

This module is the facade: it validates arguments, makes every rank *arrive* (:mod:`._collective`),
snapshots and collects the state, and hands the save to the :class:`._protocol.Committer`, at once or on a
background thread; ``load`` hands over to :mod:`._loading`. The protocols are written once, beside the code
that runs them:

* the commit protocol of ``save`` (steps 0 to 6: which rank does what, which step is a collective) in the
  docstring of :mod:`robustdist.checkpoint._protocol`;
* the shared-directory check that runs before the first ``save`` or ``load`` (every rank must see one
  directory) in :mod:`robustdist.checkpoint._shared`;
* the load protocol (agree on a valid step, verify before deserialising, fall back) in the docstring of
  :mod:`robustdist.checkpoint._loading`;
* the on-disk layout in :mod:`._layout`, and the trust model (what is read from an untrusted directory, and
  how) in ``docs/security.md``, :mod:`._safeio`, :mod:`._schema` and :mod:`._sharded`.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from robustdist.checkpoint import _background, _layout, _payload
from robustdist.checkpoint._collective import checkpoint_collectives
from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._loading import is_ray_checkpoint, load_checkpoint
from robustdist.checkpoint._protocol import Committer
from robustdist.checkpoint._schema import MAX_STEP, is_int
from robustdist.checkpoint._sharded import save_sharded
from robustdist.checkpoint._shared import check_shared_dir
from robustdist.checkpoint._snapshot import collect
from robustdist.checkpoint._types import CheckpointInfo, Context, LoadedCheckpoint, SaveJob
from robustdist.runtime import dist as _dist
from robustdist.runtime import exit_drain
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.log import get_logger

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.serialization import MAP_LOCATION

    from robustdist.runtime.dist import Collectives

__all__ = ["AtomicCheckpointer", "CheckpointInfo", "LoadedCheckpoint"]

log = get_logger(__name__)
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_ARRIVAL_TIMEOUT_S = 60.0
WAIT_GRACE_S = 60.0
"""Seconds ``wait()``/``close()`` give a background save beyond ``timeout`` (its own waits are bounded by it)."""


def _check_args(keep_last: object, timeout: object, arrival_timeout: object, max_file_bytes: object = None) -> None:
    if max_file_bytes is not None and (not isinstance(max_file_bytes, int) or isinstance(max_file_bytes, bool)
                                       or max_file_bytes < 1):
        raise CheckpointError(f"max_file_bytes={max_file_bytes!r:.40}; expected a positive number of bytes or None "
                              "(derived from the live state). Fix: pass the size of the largest payload file.")
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last!r}; expected an integer >= 1 (the newest checkpoint is always "
                              "kept). Fix: pass keep_last=1 or more.")
    for name, value in (("timeout", timeout), ("arrival_timeout", arrival_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= 1e9):
            raise CheckpointError(f"{name}={value!r:.40}; expected a number of seconds in (0, 1e9]. Fix: pass "
                                  f"a positive {name} or leave it at its default.")


class AtomicCheckpointer:
    """Crash-safe, verified, distributed checkpoints in ``directory`` (see the module docstring).

    Args:
        directory: where ``step_<step>`` directories live (created if missing).
        keep_last: committed checkpoints to keep (>= 1).
        async_save: default for ``save(blocking=...)``: write and commit on a background thread.
        group: the process group for the protocol's collectives; by default a gloo group of all ranks created
            here (every rank must construct the checkpointer).
        timeout: seconds bounding every wait (default 1800, robustdist's process-group default).
        arrival_timeout: seconds every rank has to reach ``save()``/``load()`` once another rank has (default
            60); a rank that does not is named on the ranks that did.
        config_fingerprint: recorded in the manifest (``HardenConfig.fingerprint()``).
        max_file_bytes: the largest payload file (``replicated.pt``, ``rank_*.pt``) a load reads. Default: 1 GiB
            plus 100 times the bytes of the live tensors it is restored into; a larger file is refused unread (a
            hostile directory cannot make a small model's load read gigabytes). Raise it only for plain data
            (entries with no live object to size) that really is larger.
        lock_patience: seconds a save waits for the directory's lock while another process holds it (default 0:
            refused at once, naming the holder). A Ray Tune trial that moves to another actor waits for the actor
            it left to release it.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep_last: int = 3, async_save: bool = False,
                 group: ProcessGroup | None = None, timeout: float | None = None,
                 arrival_timeout: float | None = None, config_fingerprint: str | None = None,
                 max_file_bytes: int | None = None, lock_patience: float = 0.0):
        _check_args(keep_last, timeout, arrival_timeout, max_file_bytes)
        if isinstance(lock_patience, bool) or not isinstance(lock_patience, (int, float)) \
                or not 0 <= lock_patience <= 1e9:
            raise CheckpointError(f"lock_patience={lock_patience!r:.40}; expected a number of seconds in [0, 1e9]. "
                                  "Fix: pass 0 (refuse a held lock at once) or a positive number of seconds.")
        directory = os.path.abspath(os.fspath(directory))
        try:
            Confined(directory, create=True, what="the checkpoint directory").close()
        except CheckpointError as e:  # read-only, a path too long, a file in the way: named on every rank
            raise type(e)(e.message, rank=_dist.rank() if _dist.is_multi() else None) from None
        # The directory itself may be a link you made (/scratch -> /lustre/...): resolved once, here. Everything
        # inside it is opened without following links (see _safeio), so the records in it stay readable.
        directory = os.path.realpath(directory)
        self.async_save = async_save
        seconds = float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S
        self.arrival_timeout = float(arrival_timeout) if arrival_timeout is not None else DEFAULT_ARRIVAL_TIMEOUT_S
        distributed = _dist.is_multi()
        self._own_group: ProcessGroup | None = None
        """The group created here (destroyed by ``close()``); None when the caller passed one."""
        if distributed and group is None:
            group = self._own_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
            exit_drain.install()
        rank = _dist.rank(group) if distributed else 0
        world_size = _dist.world_size(group) if distributed else 1
        collectives = checkpoint_collectives(group, rank, world_size, timeout=seconds,
                                             arrival_timeout=self.arrival_timeout)
        self._ctx = Context(directory=directory, group=group, rank=rank, world_size=world_size,
                            distributed=distributed, timeout=seconds, collectives=collectives,
                            max_file_bytes=max_file_bytes)
        self._committer = Committer(self._ctx, keep_last=keep_last, config_fingerprint=config_fingerprint,
                                    lock_patience=lock_patience)
        self._shared_ok = world_size <= 1
        """Whether every rank was seen to share the directory (:mod:`._shared`), checked at the first save/load."""
        self._thread: threading.Thread | None = None
        self._job: SaveJob | None = None  # the background save's job, while it runs
        self._error: BaseException | None = None
        self._closed = False
        # async saves copy the state into these CPU buffers, reused from one save to the next (save() waits for
        # the previous background write first, so a buffer is never overwritten while it is being written)
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}

    # ------------------------------------------------------------------ read-only attributes
    @property
    def directory(self) -> str:
        """The checkpoint directory (absolute)."""
        return self._ctx.directory

    @property
    def group(self) -> ProcessGroup | None:
        """The process group of the protocol's collectives (None without a multi-rank group)."""
        return self._ctx.group

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def distributed(self) -> bool:
        """Whether a multi-rank default group was up when this checkpointer was made."""
        return self._ctx.distributed

    @property
    def timeout(self) -> float:
        return self._ctx.timeout

    @property
    def collectives(self) -> Collectives:
        return self._ctx.collectives

    @property
    def keep_last(self) -> int:
        return self._committer.keep_last

    @property
    def config_fingerprint(self) -> str | None:
        return self._committer.config_fingerprint

    @property
    def err_rank(self) -> int | None:
        """The rank to name in errors: only in a distributed job (a single process has no rank to name)."""
        return self._ctx.err_rank

    # ------------------------------------------------------------------ public API
    def save(self, step: int, state: dict[str, Any], *, blocking: bool | None = None,
             per_rank: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None) -> CheckpointInfo:
        """Save ``state`` (modules, optimizers, schedulers, scalers, tensors, plain data) as ``step``.

        ``per_rank`` entries are saved by every rank for itself (RNG state is captured automatically);
        ``metadata`` (plain JSON data) goes into the manifest. Collective: every rank calls it (the protocol is
        in :mod:`robustdist.checkpoint._protocol`).
        """
        self._check_open()
        self.wait()
        start = time.perf_counter()
        if not is_int(step, 0, MAX_STEP):
            raise CheckpointError(f"step={step!r:.60}; expected a non-negative integer (at most 2**63-1). Fix: pass "
                                  "the training step.", rank=self.err_rank)
        self.collectives.arrive("save")
        if not self._shared_ok:
            self._shared_ok = check_shared_dir(self._ctx, writing=True)
        blocking = (not self.async_save) if blocking is None else blocking
        token = self._committer.begin(step)
        info = CheckpointInfo(step=step, path=os.path.join(self.directory, _layout.step_dirname(step)))
        job = SaveJob(step=step, token=token, staging=_layout.staging_dir(self.directory, step, token), info=info,
                      start=start)
        sharded: dict[str, Any] = {}
        error: BaseException | None = None
        try:  # step 2: every local check and snapshot, before any collective but the agreement
            job.metadata = _payload.json_metadata(metadata)
            sharded = self._collect(job, state, per_rank, clone=not blocking)
        except BaseException as e:  # the other ranks learn it in the agreement; every rank raises there
            error = e
        self._committer.agree(job, error, sorted(sharded))
        if sharded:
            try:
                job.sharded_files = save_sharded(sharded, os.path.join(job.staging, _layout.SHARDED_DIR), self.group)
            except BaseException as e:  # the other ranks wait in the report: tell them, then raise there
                self._committer.finish(job, None, e)
                raise
        info.blocking_seconds = time.perf_counter() - start
        if blocking:
            self._committer.run(job)
        else:
            self._job = job
            self._thread = _background.start(self, self._committer.run, (job,), leaving=job.leaving, done=info.done,
                                             what=f"background checkpoint save of step {step}",
                                             name=f"robustdist-ckpt-{step}", logger=log)
        return info

    def wait(self) -> None:
        """Wait for an in-flight async save; re-raise its error (once) if it failed.

        During an in-process recovery a background save stuck in its report or commit collective is left behind
        after :data:`~robustdist.checkpoint._background.ABANDON_S` seconds (:mod:`._background`): it commits
        nothing more (a step rank 0 had renamed into place stays, and the error says so), rank 0 removes its
        staging directory, and it rotates nothing; this raises, and the directory lock is released."""
        if self._thread is not None:
            waited, job = self.timeout + WAIT_GRACE_S, self._job
            assert job is not None  # set with the thread
            outcome = _background.join(self._thread, waited, job.leaving)
            if outcome == "left":
                self._thread = self._job = None
                if job.committed:
                    fate = f"step {job.step} was committed before that (resume may use it)"
                elif job.reported and self.rank != 0:
                    fate = "rank 0 may have committed it before that (resume uses the newest complete checkpoint)"
                else:
                    fate = "it commits nothing (the previous checkpoint stays)"
                raise CheckpointError(f"the background save of checkpoint step {job.step} was still in its "
                                      f"{'commit' if job.reported else 'report'} collective "
                                      f"{_background.ABANDON_S:g} s after an in-process recovery interrupted the "
                                      f"waits; left to fail on its own: {fate}. The next generation resumes from "
                                      "the newest complete checkpoint: nothing to fix.", rank=self.err_rank)
            if outcome != "done":
                raise CheckpointError(f"the background checkpoint save did not finish within {waited:g} s (the "
                                      f"checkpoint timeout {self.timeout:g} s + {WAIT_GRACE_S:g} s); expected it to "
                                      "commit or fail. Fix: check the storage's health.", rank=self.err_rank)
            self._thread = self._job = None
        if self._error is not None:
            raise _background.taken_error(self, "the background checkpoint save failed", self.err_rank)

    def check_ready(self, op: str = "load") -> None:
        """Every rank reaches ``op`` (a rank that does not is named, as in ``save``/``load``), and, the first time,
        every rank sees this directory (:mod:`._shared`). Collective. ``Hardened.resume`` calls it before the
        restart-loop guard writes its record here, so a node-local directory is refused before anything is
        written."""
        self._check_open()
        self.wait()
        self.collectives.arrive(op)
        if not self._shared_ok:
            self._shared_ok = check_shared_dir(self._ctx, writing=op == "save")

    def steps(self) -> list[int]:
        """Committed steps (final name and manifest present), oldest first. Files are not verified here."""
        return _layout.committed_steps(self.directory)

    def load(self, step: Any = None, *, state: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
             map_location: MAP_LOCATION = "cpu", missing_ok: bool = False) -> LoadedCheckpoint | None:
        """Load the newest valid checkpoint (or ``step``, or a ``ray.train.Checkpoint``); restore into ``state``.

        Collective: every rank calls it (the protocol is in :mod:`robustdist.checkpoint._loading`).
        ``per_rank``: live objects restored from this rank's per-rank entries of the same names (an entry the
        checkpoint lacks is left alone). ``missing_ok``: return None, instead of raising, when the directory holds
        no checkpoint at all (a damaged one still raises after fallback)."""
        self._check_open()
        self.wait()
        if step is not None and not is_ray_checkpoint(step) and not is_int(step, 0, MAX_STEP):
            raise CheckpointError(f"step={step!r:.60}; expected None (the newest), a committed step (an int, see "
                                  "steps()) or a ray.train.Checkpoint. Fix: pass one of those.", rank=self.err_rank)
        self.collectives.arrive("load")
        if not self._shared_ok:
            self._shared_ok = check_shared_dir(self._ctx, writing=False)
        rejected: dict[int, tuple[Any, ...]] = {}
        try:
            loaded = load_checkpoint(self._ctx, step, state, per_rank, map_location, missing_ok=missing_ok,
                                     rejected=rejected)
        finally:  # what this load found corrupt no longer counts as a newer committed step (see _protocol)
            self._committer.rejected = rejected
        if loaded is not None and os.path.dirname(loaded.path) == self.directory:
            self._committer.protected = loaded.step
        return loaded

    def ray_checkpoint(self, step: int | None = None) -> Any:
        """A ``ray.train.Checkpoint`` of a committed step (default: the newest), for ``ray.train.report``."""
        import ray.train

        steps = self.steps()
        chosen = steps[-1] if step is None and steps else step
        if chosen is None or chosen not in steps:
            raise CheckpointError(f"no committed checkpoint step {chosen} in {self.directory} (committed: {steps}); "
                                  "expected a committed step. Fix: save() first, or pass one of those steps.")
        return ray.train.Checkpoint.from_directory(os.path.join(self.directory, _layout.step_dirname(chosen)))

    def close(self) -> None:
        """Wait for an in-flight save (re-raising its error) and for rotated-out checkpoints to be deleted,
        then release the directory lock (its file is emptied first, so it names no holder) and destroy the
        process group created here (a local call on every rank in torch: no collective).

        A background save still running after ``timeout`` + 60 s keeps the lock and the group (another writer
        would otherwise delete its staging directory mid-write): close() raises and can be called again."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            if self._thread is not None and self._thread.is_alive():
                self._keep_lock()
            self._closed = True
            self._staging.clear()
            try:
                self._committer.close(self.timeout)
            finally:
                group, self._own_group = self._own_group, None
                _dist.destroy_group(group, "the checkpointer's group")

    def _keep_lock(self) -> None:
        raise CheckpointError(
            f"close(): the background save of {self.directory} is still running after {self.timeout:g} s + "
            f"{WAIT_GRACE_S:g} s; expected it to commit or fail. The directory lock is kept (and the checkpointer's "
            "group), so that no other checkpointer takes the directory and deletes the save's staging directory "
            "while it is written; the kernel releases the lock when this process exits. Fix: check the storage's "
            "health, then call close() again (or exit).", rank=self.err_rank)

    def __enter__(self) -> AtomicCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ save internals
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AtomicCheckpointer is closed; expected an open one. Fix: create a new one.")

    def _collect(self, job: SaveJob, state: dict[str, Any], per_rank: dict[str, Any] | None, *,
                 clone: bool) -> dict[str, Any]:
        """Step 2: snapshot into ``job`` (:mod:`._snapshot`); return the sharded entries, which DCP writes from the
        live objects."""
        snap = collect(state, per_rank, rank=self.rank, clone=clone, staging=self._staging, err_rank=self.err_rank)
        job.kinds, job.replicated, job.mine = snap.kinds, snap.replicated, snap.mine
        return snap.sharded
