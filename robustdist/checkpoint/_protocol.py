"""The commit protocol of ``AtomicCheckpointer.save``, and :class:`Committer`, which runs its steps 1, 2's
agreement, and 3 to 6.

A committed checkpoint is never lost or half-visible, whatever crashes when. Every rank calls
``save(step, state)``; "group" is the checkpointer's own gloo group, so a background save never interleaves
with the training collectives. Without a multi-rank group every collective below is a no-op.

0. Every rank *arrives* (:mod:`._collective`, in ``AtomicCheckpointer.save``): a rank that does not reach
   ``save()`` within ``arrival_timeout`` seconds is named on every rank that did. **Store only, no collective.**
   Before a checkpointer's first save (and only with more than one rank), every rank checks that it sees the
   same directory as rank 0 (:mod:`._shared`: probe files with random tokens; **collective: two all_gathers,
   once per checkpointer**, unless a ``load()`` already passed it); a node-local ``checkpoint.dir`` raises the
   same error on every rank, naming the nodes, before anything is written.
1. :meth:`Committer.begin`. Rank 0 takes the directory lock (once, kept until ``close()``), puts back a
   re-save's committed copy that a crash left aside, removes stale ``.tmp-``/``.old-``/``.trash-`` entries
   left by crashed runs (:mod:`._cleanup`), refuses a step lower than the newest committed one (it would be
   rotated out first, so silently lost; a step whose files this checkpointer's last ``load()`` found corrupt
   does not count, see :attr:`Committer.rejected`), creates ``<dir>/.tmp-step_<step>-<token>/`` (same
   directory as the final name, so the rename never crosses devices) and broadcasts the token or its error.
   **Collective: broadcast**; on rank 0's error every rank raises and nothing is written.
2. Every rank validates ``state``/``per_rank``/``metadata`` and snapshots its state to CPU (the only part an
   async save blocks on; in ``AtomicCheckpointer.save``), then :meth:`Committer.agree`: every rank reports
   its step, its sharded entries' names and its error, if any. **Collective: all_gather.** If a rank failed,
   or the ranks disagree on the step or on the sharded entries, rank 0 removes the staging dir and every rank
   raises the same :class:`~robustdist.runtime.errors.CheckpointError` naming the ranks and their errors, within
   seconds; nothing is written and the next save works. Only then are sharded entries (FSDP2 DTensors)
   written by ``torch.distributed.checkpoint`` into ``<staging>/sharded/``, by all ranks (**collective:
   DCP's own**); a rank whose DCP write fails goes to the report of step 4 with its error.
3. :meth:`Committer.run` (on a background thread for an async save, from here to the end). Rank 0 writes the
   replicated state (``replicated.pt``); every rank writes its RNG state and ``per_rank`` entries
   (``rank_<r>.pt``). Every file is checksummed (CRC-32, see :mod:`._io`) while written, flushed and fsynced.
4. Every rank sets ``robustdist/ckpt/<token>/<rank>`` in the c10d store (when the job has one) and reports
   success or its error. **Collective: all_gather.** If any rank failed, rank 0 removes the staging dir,
   every rank raises the same :class:`~robustdist.runtime.errors.CheckpointError` naming the failed ranks and their
   errors, and nothing is committed. If the report itself fails (a rank died or hung), the ranks whose store
   key is missing are named instead, and rank 0 (if alive) removes the staging dir.
5. Rank 0 first checks that every file a rank reported is in its staging dir, a regular file of the reported
   size (:func:`._shared.unseen_files`): if not (a node-local directory the check of step 0 did not catch, or a
   file removed under the save), it removes the staging dir and broadcasts the refusal instead, every rank
   removes the staging dir it sees and raises the same error, and nothing is committed. Else it writes
   ``manifest.json`` (tmp file, fsync, rename inside the staging dir, fsync of the staging
   dir), renames the staging dir to ``step_<step:010d>`` (an existing one, a re-save, is first renamed aside
   to ``.old-step_<step>-<token>`` and deleted after; a crash between the two renames leaves that copy
   committed, see :mod:`._layout`; a failed second rename puts it back at once), and fsyncs ``<dir>``. It
   broadcasts the outcome. **Collective: broadcast**; every rank raises the same error on failure, saying
   whether the step was committed (a failure after the rename: the fsync of ``<dir>``) or not (the staging
   dir is then removed and the previous checkpoints are untouched).
6. Only then rank 0 (no collective: the other ranks return after step 5's broadcast), as housekeeping whose
   failures are logged as warnings (the checkpoint is committed; nothing else is lost, the ranks stay in
   step): moves aside each step newer than the one just committed that the last ``load()`` rejected as
   corrupt, to ``.rejected-step_<n>-<token>`` (a rename, then an fsync of ``<dir>``; kept for inspection,
   never deleted by robustdist), so it can never shadow the new checkpoint on the next resume; then rotates
   old checkpoints beyond ``keep_last``: each is renamed to ``.trash-*`` (and the directory fsynced) before
   its bytes are deleted on a background thread, so a crash mid-delete never leaves a half-deleted checkpoint
   that looks committed, and deleting never slows the save. The checkpoint just committed is never rotated
   out, nor the one this checkpointer last loaded from (:attr:`Committer.protected`); rejected steps do not
   count towards ``keep_last``.

A background save's error is kept by ``AtomicCheckpointer`` and raised at the next ``save()``, ``wait()`` or
``close()``. The test-only fault points of :mod:`._faults` sit between these steps.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
import uuid
from datetime import datetime, timezone
from typing import Any

import torch

from robustdist._version import __version__
from robustdist.checkpoint import _cleanup, _faults, _layout
from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._io import DirLock, HashingWriter, fsync_dir, os_error
from robustdist.checkpoint._shared import refusal, this_node, unseen_files
from robustdist.checkpoint._types import Context, FileEntry, SaveJob
from robustdist.runtime import dist as _dist
from robustdist.runtime.dist import default_store
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, ranks_phrase
from robustdist.runtime.log import get_logger

__all__ = ["Committer", "staging_dir", "write_file"]

Reports = dict[int, tuple[str | None, dict[str, FileEntry] | None, str]]
"""rank -> ``(its error or None, the files it wrote, its node label)``: the report of step 4."""
log = get_logger(__name__)


def write_file(staging: str, name: str, obj: Any) -> FileEntry:
    """``torch.save`` ``obj`` to ``<staging>/<name>`` (a new file), checksummed while written, fsynced."""
    with Confined.at(staging) as folder:
        writer = HashingWriter(folder, name, on_write=lambda n: _faults.phase("writing"))
    try:
        torch.save(obj, writer)
    except BaseException as e:
        writer.abort()
        if writer.error is not None and writer.error is not e:
            raise writer.error from e  # the real cause (EFBIG, ENOSPC, ...), not torch's follow-up error
        raise
    size, crc = writer.close()
    return {"size": size, "crc32": crc}


class Committer:
    """Steps 1, 2's agreement, and 3 to 6 of the commit protocol (see the module docstring) for one directory,
    on one rank.

    It owns the directory lock, the report, the commit and the rotation; it knows the checkpointer only
    through ``ctx``.

    Args:
        ctx: the directory, the group and this rank's place in it.
        keep_last: committed checkpoints to keep (>= 1).
        config_fingerprint: recorded in every manifest.
        lock_patience: seconds to wait for the directory's lock while another process holds it.
    """

    def __init__(self, ctx: Context, *, keep_last: int, config_fingerprint: str | None, lock_patience: float = 0.0):
        self.ctx, self.keep_last, self.config_fingerprint = ctx, keep_last, config_fingerprint
        self.lock = DirLock(ctx.directory, patience=lock_patience)
        self.node = this_node() if ctx.distributed else ""
        """This rank's node, in the report (rank 0 names it if it cannot see the rank's files)."""
        self.protected: int | None = None
        """The step last loaded from this directory: never rotated out."""
        self.rejected: dict[int, tuple[Any, ...]] = {}
        """Steps whose files the last ``load()`` found corrupt -> the :func:`._layout.identity` of the directory
        it rejected (a directory put there since, by a re-save or another job, is not this one): they do not
        count as newer committed steps, and are moved aside when a lower step commits (step 6)."""
        self._deleters: list[threading.Thread] = []

    # ------------------------------------------------------------------ step 1
    def begin(self, step: int) -> str:
        """Rank 0: lock, recover and clean, check the step order, create the staging dir; every rank learns the
        token (or rank 0's error)."""
        ctx = self.ctx
        token: str | BaseException | None = None
        if ctx.rank == 0:
            try:
                self.lock.ensure()
                _cleanup.clean_stale(ctx.directory)
                self._check_order(step)
                token = uuid.uuid4().hex[:12]
                with Confined(ctx.directory, create=True) as folder:
                    folder.sub(os.path.basename(_layout.staging_dir(ctx.directory, step, token)), fresh=True).close()
            except Exception as e:
                token = e
        if isinstance(token, OSError):  # an unwritable directory, a path too long: named, with the fix
            token = os_error(ctx.directory, token, f"start checkpoint step {step} there")
        token = ctx.collectives.broadcast(token, "start")
        if isinstance(token, BaseException):
            if ctx.rank == 0:
                raise token
            raise CheckpointError(f"rank 0 could not start checkpoint step {step}: {token}; nothing was written. "
                                  "Fix: see rank 0's error.", rank=ctx.err_rank)
        return str(token)

    def is_rejected(self, step: int, name: str | None = None) -> bool:
        """Whether the directory of ``step`` now is the one the last ``load()`` rejected as corrupt."""
        name = name or _layout.step_dirs(self.ctx.directory).get(step)
        if step not in self.rejected or name is None:
            return False
        return _layout.identity(os.path.join(self.ctx.directory, name)) == self.rejected[step]

    def _check_order(self, step: int) -> None:
        steps = [s for s in _layout.committed_steps(self.ctx.directory) if s <= step or not self.is_rejected(s)]
        if steps and step < steps[-1]:
            raise CheckpointError(
                f"checkpoint step {step} is lower than the newest committed step {steps[-1]} in {self.ctx.directory}; "
                "expected steps that never go back (rotation deletes the lowest steps first, so this save would be "
                "lost). Fix: pass the current training step (resume() returns where training continues), or save "
                "into a new checkpoint.dir to branch from an older step.", rank=self.ctx.err_rank)

    # ------------------------------------------------------------------ step 2
    def agree(self, job: SaveJob, error: BaseException | None, sharded: list[str]) -> None:
        """Every rank's step, sharded entry names and snapshot error; raise the same error on every rank (rank 0
        removing the staging dir) if a rank failed or the ranks disagree, before anything is written."""
        ctx = self.ctx
        mine = (_describe(error), job.step, sharded)
        try:
            everyone = ctx.collectives.all_gather(mine, "snapshot") if ctx.distributed else [mine]
        except CheckpointError:
            if ctx.rank == 0:
                _cleanup.remove(job.staging)
            raise
        failed = {r: err for r, (err, _, _) in enumerate(everyone) if err is not None}
        steps = {r: s for r, (_, s, _) in enumerate(everyone)}
        names = {r: n for r, (_, _, n) in enumerate(everyone)}
        odd = [r for r in steps if steps[r] != steps[0]]
        if failed or odd or any(n != names[0] for n in names.values()):
            if ctx.rank == 0:
                _cleanup.remove(job.staging)
        if not failed and odd:
            calls = ", ".join(f"rank {r} save({steps[r]})" for r in [0, *odd][:9])
            raise CheckpointError(
                f"ranks disagree on the step: {calls}; expected every rank to call save() with the same step. "
                "Nothing was written. Fix: pass the same step on every rank (a counter every rank advances, not "
                "a per-rank count).", rank=ctx.err_rank, ranks=odd)
        if not failed and any(n != names[0] for n in names.values()):
            failed = {r: f"its sharded entries are {names[r]}, rank 0's {names[0]}: ranks disagree on the sharded "
                         "entries" for r in names if names[r] != names[0]}
        if failed:
            self._raise_failed(job, failed, error, "validate and snapshot its state", "unsupported values?")

    def _raise_failed(self, job: SaveJob, failed: dict[int, str], error: BaseException | None, expected: str,
                      hint: str) -> None:
        ranks = sorted(failed)
        detail = "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
        exc = CheckpointError(
            f"checkpoint step {job.step} was not committed: {len(ranks)} rank(s) failed ({detail}). Expected every "
            f"rank to {expected}. Nothing was committed and the staging directory was removed; the previous "
            f"checkpoints are untouched. Fix: see the named ranks' errors ({hint}).", rank=self.ctx.err_rank,
            ranks=ranks)
        if error is not None and self.ctx.rank in failed:
            raise exc from error
        raise exc

    # ------------------------------------------------------------------ steps 3 to 6
    def run(self, job: SaveJob) -> None:
        """Write this rank's files, then report, commit and rotate; fill in ``job.info``."""
        files: dict[str, FileEntry] = dict(job.sharded_files)
        error: BaseException | None = None
        try:
            if self.ctx.rank == 0:
                files[_layout.REPLICATED] = write_file(job.staging, _layout.REPLICATED, job.replicated)
            own = _layout.rank_file(self.ctx.rank)
            files[own] = write_file(job.staging, own, job.mine)
            _faults.phase("files_written")
        except BaseException as e:
            error = e
        job.replicated, job.mine = {}, {}  # written: a part left behind by a recovery holds no copy of the state
        job.leaving.enter()  # an in-process recovery may leave it behind from here (._background)
        self.finish(job, files, error)
        job.info.total_seconds = time.perf_counter() - job.start
        job.info.done.set()

    def finish(self, job: SaveJob, files: dict[str, FileEntry] | None, error: BaseException | None) -> None:
        """Steps 4 to 6: report ``files`` (or this rank's ``error``); commit if every rank succeeded; rotate."""
        reports = self._gather_reports(job, files, error)
        job.reported = True
        if job.leaving.left:  # a recovery moved on while this waited for the reports: nothing of it is committed
            raise self._left_behind(job)
        failed = {r: err for r, (err, _, _) in reports.items() if err is not None}
        if failed:
            if self.ctx.rank == 0:
                _cleanup.remove(job.staging)
            self._raise_failed(job, failed, error, "write its files", "disk full? permissions?")
        merged = {name: entry for _, (_, fs, _) in sorted(reports.items()) for name, entry in (fs or {}).items()}
        self._commit(job, self._manifest(job, merged), reports)
        job.info.files, job.info.bytes = len(merged), sum(f["size"] for f in merged.values())

    def _gather_reports(self, job: SaveJob, files: dict[str, FileEntry] | None,
                        error: BaseException | None) -> Reports:
        """Every rank's ``(error or None, files, node)``. A rank that never reports (died, hung) is an error naming
        it."""
        ctx = self.ctx
        mine = (_describe(error), files, self.node)
        if not ctx.distributed:
            return {0: mine}
        store = default_store()
        key = f"robustdist/ckpt/{job.token}"
        if store is not None:
            store.set(f"{key}/{ctx.rank}", "reported")
        start = time.monotonic()
        try:
            everyone = ctx.collectives.all_gather(mine, "report")
        except CheckpointError as e:
            missing = []
            if store is not None:
                try:
                    missing = [r for r in range(ctx.world_size) if not store.check([f"{key}/{r}"])]
                except Exception:
                    missing = []
            who = (f"{ranks_phrase(missing)} never reported" if missing else "a rank did not report") + \
                " (died or hung)"
            if _dist.interrupted() is not None:  # not a death: every rank is leaving for an in-process recovery
                who = "an in-process recovery interrupted the report"
            if ctx.rank == 0:
                _cleanup.remove(job.staging)
            raise CheckpointError(
                f"checkpoint not committed: {who}; the report failed after "
                f"{time.monotonic() - start:.1f} s (bound {ctx.timeout:g} s). Expected every rank to report its files. "
                "Nothing was committed; rank 0 removes the staging directory now (or, if rank 0 is the one that "
                f"died, the next save does). ({e.__cause__ or e})", rank=ctx.err_rank, ranks=missing) from e
        return dict(enumerate(everyone))

    def _commit(self, job: SaveJob, manifest: dict[str, Any], reports: Reports) -> None:
        """Rank 0 checks the reported files, writes the manifest and renames; every rank learns the outcome; rank 0
        then tidies up."""
        ctx = self.ctx
        outcome: tuple[bool, bool, str] | CheckpointError | None = None
        if ctx.rank == 0:  # the rename is storage work, waited for: a recovery leaves only the collective behind
            outcome = (self._refuse_unseen(job, reports) or self._rename_into_place(job, manifest)) \
                if job.leaving.leave_collective() else self._left_behind(job)
            job.committed = outcome is None or (isinstance(outcome, tuple) and outcome[0])
            job.leaving.enter()
        outcome = ctx.collectives.broadcast(outcome, "commit")
        if not job.leaving.leave_collective():  # no rotation without the directory's lock, which close() let go
            raise CheckpointError(f"checkpoint step {job.step} was left behind by an in-process recovery after its "
                                  f"commit collective{' (it is committed)' if job.committed else ''}; old "
                                  "checkpoints were not rotated.", rank=ctx.err_rank)
        if isinstance(outcome, CheckpointError):
            if ctx.rank != 0:  # this rank's own staging dir, where it is not rank 0's (a node-local directory)
                _cleanup.remove(job.staging)
            raise CheckpointError(outcome.message, rank=ctx.err_rank, ranks=outcome.ranks)
        if outcome is not None:
            committed, durable, problem = outcome
            final = os.path.join(ctx.directory, _layout.step_dirname(job.step))
            synced = "The directory was fsynced first" if durable else \
                "The directory fsync did not complete, so the commit may not survive a power loss"
            if committed:
                raise CheckpointError(
                    f"checkpoint step {job.step} was committed ({final} is in place and load() uses it), but rank 0 "
                    f"then failed: {problem}. {synced}; old checkpoints were not rotated out. Fix: check the "
                    "storage's health, then save again.", rank=ctx.err_rank, ranks=[0])
            raise CheckpointError(f"rank 0 could not commit checkpoint step {job.step}: {problem}. Expected the "
                                  "manifest write and rename to succeed; nothing was committed and the previous "
                                  "checkpoints are untouched. Fix: check the directory's disk space and permissions.",
                                  rank=ctx.err_rank, ranks=[0])
        if ctx.rank == 0:
            self._tidy(job)

    def _left_behind(self, job: SaveJob) -> CheckpointError:
        """An in-process recovery left this save behind before its commit: rank 0 removes its staging directory."""
        if self.ctx.rank == 0:
            _cleanup.remove(job.staging)
        return CheckpointError(f"checkpoint step {job.step} was left behind by an in-process recovery; not "
                               "committed (the previous checkpoint stays).", rank=self.ctx.err_rank)

    def _refuse_unseen(self, job: SaveJob, reports: Reports) -> CheckpointError | None:
        """Rank 0's step 5 check: the refusal (the staging dir removed) if a reported file is not where it looks."""
        if self.ctx.world_size <= 1:
            return None
        unseen = unseen_files(job.staging, reports)
        if not unseen:
            return None
        _cleanup.remove(job.staging)
        nodes = {r: node for r, (_, _, node) in reports.items()}
        return refusal(job.step, self.ctx.directory, job.staging, unseen, nodes)

    def _rename_into_place(self, job: SaveJob, manifest: dict[str, Any]) -> tuple[bool, bool, str] | None:
        """Rank 0's step 5: None, or ``(whether the step is committed, whether <dir> was fsynced, the problem)``."""
        directory = self.ctx.directory
        final = _layout.step_dirname(job.step)
        staging = os.path.basename(job.staging)
        old = renamed = None
        try:
            with Confined(directory) as folder:
                with folder.sub(staging) as files:
                    files.write(_layout.MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
                    written = files.stat()
                _faults.phase("manifest_written")
                if folder.lstat(final) is not None:  # re-saving a step: move the old one aside, delete it after
                    old = f".old-{final}-{job.token}"
                    folder.rename(final, old)
                    _faults.phase("moved_aside")
                folder.rename(staging, final)
                renamed = final
                with folder.sub(final) as now:  # the directory written is the one committed (never a link)
                    if (now.stat().st_dev, now.stat().st_ino) != (written.st_dev, written.st_ino):
                        raise CheckpointCorruptError(
                            f"{job.staging}: was replaced by another directory while the step was committed; "
                            "expected the staging directory robustdist wrote. Fix: make sure nothing else writes "
                            f"the checkpoint directory {directory}.")
        except Exception as e:
            _cleanup.remove(job.staging)
            if renamed is not None:  # what took the step's name is not what was written: it is not a step
                _cleanup.remove(os.path.join(directory, renamed))
            if old is not None:
                _cleanup.put_back(directory, old, final)  # else the next save's clean-up does
            return False, False, f"{type(e).__name__}: {e}"
        synced = False
        try:
            fsync_dir(directory)
            synced = True
            _faults.phase("committed")
        except Exception as e:
            return True, synced, f"{type(e).__name__}: {e}"
        finally:
            if old is not None:
                _cleanup.remove(os.path.join(directory, old))
        return None

    def _tidy(self, job: SaveJob) -> None:
        """Rank 0's step 6: move rejected newer steps aside, rotate. Failures are warnings: the step is committed."""
        try:
            self._set_aside_rejected(job)
            self._rotate(job.step)
        except Exception as e:
            log.warning("checkpoint step %d is committed, but tidying %s failed: %s: %s (older checkpoints stay; "
                        "the next save tries again)", job.step, self.ctx.directory, type(e).__name__, e)

    def _set_aside_rejected(self, job: SaveJob) -> None:
        directory = self.ctx.directory
        self.rejected.pop(job.step, None)  # (re-saved: that directory is gone)
        moved = []
        for step, name in _layout.step_dirs(directory).items():
            if step > job.step and self.is_rejected(step, name):
                path = _cleanup.set_aside(directory, name, step, job.token)
                del self.rejected[step]
                moved.append(path)
                log.warning("checkpoint step %d is newer than step %d just committed, but the last load() found its "
                            "files corrupt: moved aside to %s so it never shadows step %d on resume (kept for "
                            "inspection; robustdist never deletes it)", step, job.step, path, job.step)
        if moved:
            fsync_dir(directory)

    def _rotate(self, committed: int) -> None:
        directory = self.ctx.directory
        steps = _layout.committed_steps(directory)
        # keep the step just committed, the one last loaded from (if any), then the next newest up to keep_last
        keep = {committed} | ({self.protected} if self.protected in steps else set())
        for s in reversed(steps):
            if len(keep) >= self.keep_last:
                break
            if not self.is_rejected(s):
                keep.add(s)
        victims = [s for s in steps if s not in keep and s < committed]
        trashed = [path for path in (_cleanup.trash(directory, step) for step in victims) if path]
        if trashed:
            fsync_dir(directory)
            _faults.phase("rotating")
            deleter = threading.Thread(target=_cleanup.delete_all, args=(trashed,), name="robustdist-ckpt-rotate",
                                       daemon=True)
            deleter.start()
            self._deleters = [t for t in self._deleters if t.is_alive()] + [deleter]

    def _manifest(self, job: SaveJob, files: dict[str, FileEntry]) -> dict[str, Any]:
        return {"format": _layout.FORMAT_VERSION, "step": job.step, "world_size": self.ctx.world_size,
                "torch": torch.__version__, "robustdist": __version__, "config_fingerprint": self.config_fingerprint,
                "metadata": job.metadata, "entries": job.kinds, "files": files,
                "created": datetime.now(timezone.utc).isoformat()}

    # ------------------------------------------------------------------ close
    def close(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s each) for rotated-out checkpoints to be deleted; release the lock."""
        try:
            for deleter in self._deleters:
                deleter.join(timeout)
        finally:
            self.lock.release()


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else "".join(traceback.format_exception_only(type(error), error)).strip()
