"""Steps 4 to 6 of the commit protocol (see ``checkpointer``): report, commit, rotate; and the clean-up of
what crashed runs leave behind."""

from __future__ import annotations

import os
import shutil
import stat
import time
import traceback
import uuid
from typing import Any

from robustdist._dist import default_store
from robustdist.checkpoint import _faults, _layout
from robustdist.checkpoint._io import fsync_dir
from robustdist.errors import CheckpointError, ranks_phrase
from robustdist.log import get_logger

log = get_logger(__name__)


def gather_reports(ckpt: Any, token: str, staging: str, files: dict[str, Any] | None,
                   error: BaseException | None) -> dict[int, tuple[str | None, dict[str, Any] | None]]:
    """Every rank's ``(error or None, files)``. A rank that never reports (died, hung) is an error naming it."""
    mine = (None if error is None else "".join(traceback.format_exception_only(type(error), error)).strip(), files)
    if not ckpt.distributed:
        return {0: mine}
    store = default_store()
    key = f"robustdist/ckpt/{token}"
    if store is not None:
        store.set(f"{key}/{ckpt.rank}", "reported")
    start = time.monotonic()
    try:
        everyone = ckpt.collectives.all_gather(mine, "report")
    except CheckpointError as e:
        missing = []
        if store is not None:
            try:
                missing = [r for r in range(ckpt.world_size) if not store.check([f"{key}/{r}"])]
            except Exception:
                missing = []
        who = f"{ranks_phrase(missing)} never reported" if missing else "a rank did not report"
        if ckpt.rank == 0:
            remove(staging)
        raise CheckpointError(
            f"checkpoint not committed: {who} (died or hung); the report failed after "
            f"{time.monotonic() - start:.1f} s (bound {ckpt.timeout:g} s). Expected every rank to report its files. "
            f"Nothing was committed; the staging directory is removed by the next save. ({e.__cause__ or e})",
            rank=ckpt.err_rank, ranks=missing) from e
    return dict(enumerate(everyone))


def commit(ckpt: Any, step: int, token: str, staging: str, manifest: dict[str, Any]) -> None:
    """Rank 0 writes the manifest and renames; every rank learns the outcome; rank 0 then rotates."""
    from robustdist.checkpoint._io import write_json_atomic

    outcome: Any = None
    if ckpt.rank == 0:
        try:
            write_json_atomic(os.path.join(staging, _layout.MANIFEST), manifest)
            _faults.phase("manifest_written")
            final = os.path.join(ckpt.directory, _layout.step_dirname(step))
            old = None
            if os.path.lexists(final):  # re-saving a step: move the old one aside, delete it after the commit
                old = os.path.join(ckpt.directory, f".old-{_layout.step_dirname(step)}-{token}")
                os.rename(final, old)
                _faults.phase("moved_aside")
            os.rename(staging, final)
            fsync_dir(ckpt.directory)
            _faults.phase("committed")
            if old is not None:
                remove(old)
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
            remove(staging)
    outcome = ckpt.collectives.broadcast(outcome, "commit")
    if outcome is not None:
        raise CheckpointError(f"rank 0 could not commit checkpoint step {step}: {outcome}. Expected the manifest "
                              "write and rename to succeed; the previous checkpoints are untouched. Fix: check the "
                              "directory's disk space and permissions.", rank=ckpt.err_rank, ranks=[0])
    if ckpt.rank == 0:
        ckpt._rotate()


def remove(path: str) -> None:
    """Delete a directory tree, or a file or link (never following it); missing is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def clean_stale(directory: str) -> None:
    """Rank 0, holding the lock: put back a re-save's committed copy that a crash left aside, then remove
    what crashed runs left (staging, replaced and rotated-out directories)."""
    committed = set(_layout.committed_steps(directory))
    for step, name in _layout.step_dirs(directory).items():
        final = os.path.join(directory, _layout.step_dirname(step))
        if name.startswith(".old-") and step in committed and not os.path.lexists(final):
            log.warning("restoring checkpoint step %d from %s: a crash interrupted its re-save", step, name)
            os.rename(os.path.join(directory, name), final)
    for name in os.listdir(directory):
        if name.startswith(_layout.STALE_PREFIXES):
            log.info("removing %s left by an earlier crash", name)
            remove(os.path.join(directory, name))
    fsync_dir(directory)


def trash(directory: str, step: int) -> str | None:
    """Rename a committed step to ``.trash-*`` (invisible to readers at once); its bytes go later."""
    src = os.path.join(directory, _layout.step_dirname(step))
    dst = os.path.join(directory, f".trash-{_layout.step_dirname(step)}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(src, dst)
    except OSError as e:
        log.warning("could not rotate out checkpoint step %d: %s (it stays; the new one is committed)", step, e)
        return None
    return dst
