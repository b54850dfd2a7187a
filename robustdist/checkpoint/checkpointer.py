"""``AtomicCheckpointer``: a committed checkpoint is never lost or half-visible, whatever crashes when.

Commit protocol of ``save(step, state)`` (every rank calls it; "group" is the checkpointer's own gloo group,
so a background save never interleaves with the training collectives):

0. Every rank *arrives* (:mod:`robustdist.checkpoint._collective`): a rank that does not reach ``save()``
   within ``arrival_timeout`` seconds is named on every rank that did. **Store only, no collective.**
1. Rank 0 takes the directory lock (once), puts back a re-save's committed copy that a crash left aside,
   removes stale ``.tmp-``/``.old-``/``.trash-`` entries left by crashed runs, refuses a step lower than the
   newest committed one (it would be rotated out first, so silently lost), creates
   ``<dir>/.tmp-step_<step>-<token>/`` (same directory as the final name, so the rename never crosses
   devices) and broadcasts the token or the error. **Collective: broadcast.**
2. Every rank snapshots its state to CPU (the only part an async save blocks on). Sharded entries (FSDP2
   DTensors) are written by ``torch.distributed.checkpoint`` into ``<staging>/sharded/`` now, by all ranks.
3. Rank 0 writes the replicated state (``replicated.pt``); every rank writes its RNG and per-rank entries
   (``rank_<r>.pt``). Every file is checksummed (CRC-32, see :mod:`robustdist.checkpoint._io`) while written,
   flushed and fsynced.
4. Every rank reports success or its error. **Collective: all_gather.** If any rank failed, every rank raises
   the same :class:`CheckpointError` naming the failed ranks and their errors, rank 0 removes the staging
   dir, and nothing is committed. A rank that died is named from the c10d store.
5. Rank 0 writes ``manifest.json`` (tmp file, fsync, rename inside the staging dir), renames the staging dir
   to ``step_<step:010d>`` (an existing one is moved aside first and deleted after), and fsyncs ``<dir>``.
   It broadcasts the outcome. **Collective: broadcast**; every rank raises the same error on failure.
6. Only then rank 0 rotates old checkpoints beyond ``keep_last``: each is renamed to ``.trash-*`` (and the
   directory fsynced) before its bytes are deleted on a background thread, so a crash mid-delete never
   leaves a half-deleted checkpoint that looks committed, and deleting never slows the save. The
   checkpoint last loaded from is never rotated out, nor the newest.

``load`` (every rank calls it; it arrives like ``save``) is described in :mod:`._loading`: it considers only
committed directories, verifies every file before deserialising it, validates what it read, falls back to
the previous checkpoint with a warning naming the file and the reason, and makes every rank load the same
step. The trust model (what is read from an untrusted directory, and how) is in the README's security
section and in :mod:`._safeio`, :mod:`._schema` and :mod:`._sharded`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

from robustdist import _dist
from robustdist._version import __version__
from robustdist.checkpoint import _faults, _layout, _payload, _protocol
from robustdist.checkpoint._collective import checkpoint_collectives
from robustdist.checkpoint._io import DirLock, HashingWriter, fsync_dir
from robustdist.checkpoint._schema import MAX_STEP, is_int
from robustdist.checkpoint._sharded import is_sharded_stateful, save_sharded
from robustdist.errors import CheckpointError
from robustdist.log import get_logger

__all__ = ["AtomicCheckpointer", "CheckpointInfo", "LoadedCheckpoint"]

log = get_logger(__name__)
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_ARRIVAL_TIMEOUT_S = 60.0


@dataclass
class CheckpointInfo:
    """What a save did. For an async save, ``total_seconds``, ``files`` and ``bytes`` fill in when it commits."""

    step: int
    path: str
    blocking_seconds: float = 0.0
    total_seconds: float | None = None
    files: int | None = None
    bytes: int | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)


@dataclass
class LoadedCheckpoint:
    """What ``load`` found: the saved entries (``state``), this rank's ``per_rank`` entries, the manifest."""

    step: int
    path: str
    state: dict[str, Any]
    per_rank: dict[str, Any]
    metadata: dict[str, Any]
    manifest: dict[str, Any]


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
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep_last: int = 3, async_save: bool = False,
                 group: Any = None, timeout: float | None = None, arrival_timeout: float | None = None,
                 config_fingerprint: str | None = None):
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last!r}; expected an integer >= 1 (the newest checkpoint is always "
                                  "kept). Fix: pass keep_last=1 or more.")
        for name, value in (("timeout", timeout), ("arrival_timeout", arrival_timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value <= 1e9):
                raise CheckpointError(f"{name}={value!r:.40}; expected a number of seconds in (0, 1e9]. Fix: pass "
                                      f"a positive {name} or leave it at its default.")
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        self.keep_last, self.async_save = keep_last, async_save
        self.timeout = float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S
        self.config_fingerprint = config_fingerprint
        self.distributed = _dist.is_multi()
        if self.distributed and group is None:
            from datetime import timedelta

            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.arrival_timeout = float(arrival_timeout) if arrival_timeout is not None else DEFAULT_ARRIVAL_TIMEOUT_S
        self.collectives = checkpoint_collectives(group, self.rank, self.world_size, timeout=self.timeout,
                                                    arrival_timeout=self.arrival_timeout)
        self._lock = DirLock(self.directory)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._protected: int | None = None
        self._closed = False
        self._deleters: list[threading.Thread] = []
        # async saves copy the state into these CPU buffers, reused from one save to the next (save() waits for
        # the previous background write first, so a buffer is never overwritten while it is being written)
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def err_rank(self) -> int | None:
        """The rank to name in errors: only in a distributed job (a single process has no rank to name)."""
        return self.rank if self.distributed else None

    # ------------------------------------------------------------------ public API
    def save(self, step: int, state: dict[str, Any], *, blocking: bool | None = None,
             per_rank: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None) -> CheckpointInfo:
        """Save ``state`` (modules, optimizers, schedulers, scalers, tensors, plain data) as ``step``.

        ``per_rank`` entries are saved by every rank for itself (RNG state is captured automatically);
        ``metadata`` (plain JSON data) goes into the manifest.
        """
        self._check_open()
        self.wait()
        start = time.perf_counter()
        if not is_int(step, 0, MAX_STEP):
            raise CheckpointError(f"step={step!r:.60}; expected a non-negative integer (at most 2**63-1). Fix: pass "
                                  "the training step.", rank=self.err_rank)
        self.collectives.arrive("save")
        blocking = (not self.async_save) if blocking is None else blocking
        token = self._begin(step)
        staging = os.path.join(self.directory, f".tmp-{_layout.step_dirname(step)}-{token}")
        info = CheckpointInfo(step=step, path=os.path.join(self.directory, _layout.step_dirname(step)))
        try:
            metadata = _payload.json_metadata(metadata)
            replicated, mine, sharded, kinds = self._collect(state, per_rank, clone=not blocking)
            sharded_files = save_sharded(sharded, os.path.join(staging, _layout.SHARDED_DIR), self.group) \
                if sharded else {}
        except BaseException as e:  # the other ranks wait in the report: tell them, then raise there
            self._report_and_commit(step, token, staging, None, e, metadata, {}, info)
            raise
        info.blocking_seconds = time.perf_counter() - start
        job = (step, token, staging, replicated, mine, sharded_files, metadata, kinds, info, start)
        if blocking:
            self._write_and_commit(*job)
        else:
            self._thread = threading.Thread(target=self._background, args=job, name=f"robustdist-ckpt-{step}",
                                            daemon=True)
            self._thread.start()
        return info

    def wait(self) -> None:
        """Wait for an in-flight async save; re-raise its error (once) if it failed."""
        if self._thread is not None:
            self._thread.join(self.timeout + 60)
            if self._thread.is_alive():
                raise CheckpointError(f"the background checkpoint save did not finish within {self.timeout:g} s; "
                                      "expected it to commit or fail. Fix: check the storage's health.", rank=self.err_rank)
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"the background checkpoint save failed: {error}", rank=self.err_rank) from error

    def steps(self) -> list[int]:
        """Committed steps (final name and manifest present), oldest first. Files are not verified here."""
        return _layout.committed_steps(self.directory)

    def load(self, step: Any = None, *, state: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
             map_location: Any = "cpu", missing_ok: bool = False) -> LoadedCheckpoint | None:
        """Load the newest valid checkpoint (or ``step``, or a ``ray.train.Checkpoint``); restore into ``state``.

        Collective: every rank calls it. ``per_rank``: live objects restored from this rank's per-rank entries of
        the same names (an entry the checkpoint lacks is left alone). ``missing_ok``: return None, instead of
        raising, when the directory holds no checkpoint at all (a damaged one still raises after fallback)."""
        from robustdist.checkpoint._loading import is_ray_checkpoint, load_checkpoint

        self._check_open()
        self.wait()
        if step is not None and not is_ray_checkpoint(step) and not is_int(step, 0, MAX_STEP):
            raise CheckpointError(f"step={step!r:.60}; expected None (the newest), a committed step (an int, see "
                                  "steps()) or a ray.train.Checkpoint. Fix: pass one of those.", rank=self.err_rank)
        self.collectives.arrive("load")
        loaded = load_checkpoint(self, step, state, per_rank, map_location, missing_ok=missing_ok)
        if loaded is not None and os.path.dirname(loaded.path) == self.directory:
            self._protected = loaded.step
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
        then release the directory lock."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            for deleter in self._deleters:
                deleter.join(self.timeout)
            self._closed = True
            self._staging.clear()
            self._lock.release()

    def __enter__(self) -> AtomicCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol steps
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AtomicCheckpointer is closed; expected an open one. Fix: create a new one.")

    def _begin(self, step: int) -> str:
        """Rank 0: lock, recover and clean, check the step order, create the staging dir; everyone learns the
        token (or rank 0's error)."""
        token: Any = None
        if self.rank == 0:
            try:
                self._lock.ensure()
                _protocol.clean_stale(self.directory)
                self._check_order(step)
                token = uuid.uuid4().hex[:12]
                os.makedirs(os.path.join(self.directory, f".tmp-{_layout.step_dirname(step)}-{token}"))
            except Exception as e:
                token = e
        token = self.collectives.broadcast(token, "start")
        if isinstance(token, BaseException):
            if self.rank == 0:
                raise token
            raise CheckpointError(f"rank 0 could not start checkpoint step {step}: {token}; nothing was written. "
                                  "Fix: see rank 0's error.", rank=self.err_rank)
        return str(token)

    def _check_order(self, step: int) -> None:
        steps = self.steps()
        if steps and step < steps[-1]:
            raise CheckpointError(
                f"checkpoint step {step} is lower than the newest committed step {steps[-1]} in {self.directory}; "
                "expected steps that never go back (rotation deletes the lowest steps first, so this save would be "
                "lost). Fix: pass the current training step (resume() returns where training continues), or save "
                "into a new checkpoint.dir to branch from an older step.", rank=self.err_rank)

    def _collect(self, state: dict[str, Any], per_rank: dict[str, Any] | None, *, clone: bool):
        for what, value in (("state", state), ("per_rank", per_rank if per_rank is not None else {})):
            if not isinstance(value, dict):
                raise CheckpointError(f"{what} is a {type(value).__name__}; expected a dict of named entries. Fix: "
                                      "pass {'model': model, 'optimizer': optimizer, ...}.", rank=self.err_rank)
        names = [n for n in (*state, *(per_rank or {})) if type(n) is not str or not 0 < len(n) <= 256]
        if names:
            raise CheckpointError(f"entry name {names[0]!r:.60} is a {type(names[0]).__name__}; expected a str of 1 "
                                  "to 256 characters (the manifest records names as JSON strings). Fix: name entries "
                                  "with short strings.", rank=self.err_rank)
        replicated, sharded, kinds = {}, {}, {}
        shared, own = [_payload.MAX_VALUES], [_payload.MAX_VALUES - 2000]  # one budget per file (RNG state: ~700)
        for name, value in state.items():
            if _payload.is_sharded(value) or is_sharded_stateful(value):
                kinds[name] = "sharded"
                sharded[name] = value
                continue
            kind, entry = _payload.entry_state(name, value)
            entry = _payload.plain(entry, f"state[{name!r}]", shared)
            kinds[name] = kind
            if self.rank == 0:
                replicated[name] = _payload.snapshot(entry, clone=clone, staging=self._staging, key=("r", name))
        mine = {"rng": _payload.capture_rng(), "per_rank": {}}
        for name, value in (per_rank or {}).items():
            kind, entry = _payload.entry_state(name, value)
            entry = _payload.plain(entry, f"per_rank[{name!r}]", own)
            mine["per_rank"][name] = _payload.snapshot(entry, clone=clone, staging=self._staging, key=("p", name))
        return replicated, mine, sharded, kinds

    def _background(self, *job: Any) -> None:
        info: CheckpointInfo = job[8]
        try:
            self._write_and_commit(*job)
        except BaseException as e:  # surfaces at the next save(), wait() or close()
            self._error = e
            log.error("background checkpoint save of step %d failed: %s", info.step, e)
        finally:
            info.done.set()

    def _write_and_commit(self, step: int, token: str, staging: str, replicated: dict[str, Any],
                          mine: dict[str, Any], sharded_files: dict[str, Any], metadata: Any, kinds: dict[str, str],
                          info: CheckpointInfo, start: float) -> None:
        files: dict[str, Any] = dict(sharded_files)
        error: BaseException | None = None
        try:
            if self.rank == 0:
                files[_layout.REPLICATED] = self._write(staging, _layout.REPLICATED, replicated)
            files[_layout.rank_file(self.rank)] = self._write(staging, _layout.rank_file(self.rank), mine)
            _faults.phase("files_written")
        except BaseException as e:
            error = e
        self._report_and_commit(step, token, staging, files, error, metadata, kinds, info)
        info.total_seconds = time.perf_counter() - start
        info.done.set()

    def _write(self, staging: str, name: str, obj: Any) -> dict[str, Any]:
        path = os.path.join(staging, name)
        writer = HashingWriter(path, on_write=lambda n: _faults.phase("writing"))
        try:
            torch.save(obj, writer)
        except BaseException as e:
            writer.abort()
            if writer.error is not None and writer.error is not e:
                raise writer.error from e  # the real cause (EFBIG, ENOSPC, ...), not torch's follow-up error
            raise
        size, sha = writer.close()
        return {"size": size, "crc32": sha}

    def _report_and_commit(self, step: int, token: str, staging: str, files: dict[str, Any] | None,
                           error: BaseException | None, metadata: Any, kinds: dict[str, str],
                           info: CheckpointInfo) -> None:
        reports = _protocol.gather_reports(self, token, staging, files, error)
        failed = {r: err for r, (err, _) in reports.items() if err is not None}
        if failed:
            if self.rank == 0:
                _protocol.remove(staging)
            ranks = sorted(failed)
            detail = "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
            exc = CheckpointError(
                f"checkpoint step {step} was not committed: {len(ranks)} rank(s) failed ({detail}). Expected every "
                "rank to write its files. Nothing was committed and the staging directory was removed; the previous "
                "checkpoints are untouched. Fix: see the named ranks' errors (disk full? permissions?).",
                rank=self.err_rank, ranks=ranks)
            if error is not None and self.rank in failed:
                raise exc from error
            raise exc
        merged = {name: entry for _, (_, fs) in sorted(reports.items()) for name, entry in (fs or {}).items()}
        _protocol.commit(self, step, token, staging, self._manifest(step, merged, metadata, kinds))
        info.files, info.bytes = len(merged), sum(f["size"] for f in merged.values())

    def _rotate(self) -> None:
        steps = self.steps()
        # keep the newest, the one last loaded from (if any), then the next newest up to keep_last in all
        keep = {steps[-1]} if steps else set()
        if self._protected in steps:
            keep.add(self._protected)
        for s in reversed(steps):
            if len(keep) >= self.keep_last:
                break
            keep.add(s)
        victims = [s for s in steps if s not in keep]
        trashed = [path for path in (_protocol.trash(self.directory, step) for step in victims) if path]
        if trashed:
            fsync_dir(self.directory)
            _faults.phase("rotating")
            deleter = threading.Thread(target=_delete_all, args=(trashed,), name="robustdist-ckpt-rotate", daemon=True)
            deleter.start()
            self._deleters = [t for t in self._deleters if t.is_alive()] + [deleter]

    def _manifest(self, step: int, files: dict[str, Any], metadata: Any, kinds: dict[str, str]) -> dict[str, Any]:
        return {"format": _layout.FORMAT_VERSION, "step": step, "world_size": self.world_size,
                "torch": torch.__version__, "robustdist": __version__, "config_fingerprint": self.config_fingerprint,
                "metadata": metadata, "entries": kinds, "files": files,
                "created": datetime.now(timezone.utc).isoformat()}


def _delete_all(paths: list[str]) -> None:
    """Delete rotated-out checkpoints off the save's critical path (a crash leaves .trash-*, cleaned later)."""
    for path in paths:
        _protocol.remove(path)
