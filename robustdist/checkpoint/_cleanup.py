"""Renames and deletes inside the checkpoint directory that crash recovery relies on (rank 0, holding the lock).

* :func:`clean_stale` (step 1 of the commit protocol in :mod:`._protocol`): puts back a re-save's committed
  copy that a crash left aside as ``.old-*``, then removes the ``.tmp-``/``.old-``/``.trash-`` entries that
  crashed runs left.
* :func:`trash` (step 6): a rotated-out checkpoint is first renamed to ``.trash-*``, so it stops counting as
  committed at once; :func:`delete_all` deletes its bytes later, off the save's critical path.
* :func:`set_aside` (step 6): a step the last ``load()`` found corrupt, newer than the one just committed, is
  renamed to ``.rejected-step_<n>-<token>``: no longer a step (the layout scanner, ``verify_all``, rotation
  and :func:`clean_stale` ignore it), but kept for inspection; robustdist never deletes it.
* :func:`remove`: delete a tree, a file or a link, never following a link.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid

from robustdist.checkpoint import _layout
from robustdist.checkpoint._io import fsync_dir
from robustdist.runtime.log import get_logger

__all__ = ["clean_stale", "delete_all", "remove", "set_aside", "trash"]

log = get_logger(__name__)


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


def set_aside(directory: str, name: str, step: int, token: str) -> str:
    """Rename the step directory ``name`` to ``.rejected-step_<step>-<token>`` (the caller fsyncs ``directory``)."""
    dst = os.path.join(directory, f"{_layout.REJECTED_PREFIX}{_layout.step_dirname(step)}-{token}")
    os.rename(os.path.join(directory, name), dst)
    return dst


def delete_all(paths: list[str]) -> None:
    """Delete rotated-out checkpoints off the save's critical path (a crash leaves .trash-*, cleaned later)."""
    for path in paths:
        remove(path)
