"""Steps 4 to 6 of the commit protocol (see ``checkpointer``): report, commit, rotate."""

from __future__ import annotations

import os
import shutil
import traceback
from typing import Any

import torch.distributed as dist

from robustdist.checkpoint import _faults, _layout
from robustdist.checkpoint._io import fsync_dir
from robustdist.errors import CheckpointError
from robustdist.process_group import default_store


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
    everyone: list[Any] = [None] * ckpt.world_size
    try:
        dist.all_gather_object(everyone, mine, group=ckpt.group)
    except Exception as e:
        missing = []
        if store is not None:
            try:
                missing = [r for r in range(ckpt.world_size) if not store.check([f"{key}/{r}"])]
            except Exception:
                missing = []
        who = f"rank(s) {', '.join(map(str, missing))} never reported" if missing else "a rank did not report"
        if ckpt.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"checkpoint not committed: {who} (died or hung) within {ckpt.timeout:g} s; expected every rank to report "
            f"its files. Nothing was committed; the staging directory is removed by the next save. ({e})",
            rank=ckpt.err_rank, ranks=missing) from e
    return dict(enumerate(everyone))


def commit(ckpt: Any, step: int, token: str, staging: str, files: dict[str, Any], metadata: Any,
           kinds: dict[str, str]) -> None:
    """Rank 0 writes the manifest and renames; every rank learns the outcome; rank 0 then rotates."""
    from robustdist.checkpoint.checkpointer import write_manifest

    outcome: list[Any] = [None]
    if ckpt.rank == 0:
        try:
            write_manifest(ckpt, staging, step, files, metadata, kinds)
            _faults.phase("manifest_written")
            final = os.path.join(ckpt.directory, _layout.step_dirname(step))
            old = None
            if os.path.exists(final):  # re-saving a step: move the old one aside, delete it after the commit
                old = os.path.join(ckpt.directory, f".old-{_layout.step_dirname(step)}-{token}")
                os.rename(final, old)
            os.rename(staging, final)
            fsync_dir(ckpt.directory)
            _faults.phase("committed")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:
            outcome[0] = f"{type(e).__name__}: {e}"
            shutil.rmtree(staging, ignore_errors=True)
    if ckpt.distributed:
        dist.broadcast_object_list(outcome, src=0, group=ckpt.group)
    if outcome[0] is not None:
        raise CheckpointError(f"rank 0 could not commit checkpoint step {step}: {outcome[0]}. Expected the manifest "
                              "write and rename to succeed; the previous checkpoints are untouched. Fix: check the "
                              "directory's disk space and permissions.", rank=ckpt.err_rank, ranks=[0])
    if ckpt.rank == 0:
        ckpt._rotate()
