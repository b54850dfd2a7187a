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

Every rename and delete goes through :class:`.._confined.Confined` (by descriptor, never through a link).
"""

from __future__ import annotations

import os
import re
import uuid

from robustdist.checkpoint import _layout
from robustdist.checkpoint._confined import Confined
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.log import get_logger

__all__ = ["clean_stale", "delete_all", "put_back", "remove", "set_aside", "trash"]

log = get_logger(__name__)

_OURS = re.compile(r"\.(?:tmp|old|trash)-step_[A-Za-z0-9_.-]{1,200}|step_\d{10,19}")
"""The names robustdist deletes in a checkpoint directory: steps, their staging, set-aside and trashed copies
(never ``.rejected-*``, the lock, or anything else)."""


def remove(path: str, ours: re.Pattern[str] = _OURS) -> None:
    """Delete the step, staging or trashed directory ``path`` (a tree, a file or a link, never following a link
    at any level, through :class:`.._confined.Confined`); its name must match ``ours`` (the names robustdist
    deletes there). Missing is fine, a failure is a warning."""
    parent, name = os.path.split(path)
    try:
        with Confined(parent) as folder:
            folder.remove_tree(name, ours)
    except CheckpointError as e:
        log.warning("could not remove %s: %s (harmless: it is never read as a checkpoint; the next save's clean-up "
                    "tries again)", path, e)


def clean_stale(directory: str) -> None:
    """Rank 0, holding the lock: put back a re-save's committed copy that a crash left aside, then remove
    what crashed runs left (staging, replaced and rotated-out directories)."""
    committed = set(_layout.committed_steps(directory))
    with Confined(directory) as folder:
        for step, name in _layout.step_dirs(directory).items():
            final = _layout.step_dirname(step)
            if name.startswith(".old-") and step in committed and folder.lstat(final) is None:
                log.warning("restoring checkpoint step %d from %s: a crash interrupted its re-save", step, name)
                folder.rename(name, final)
        for name in folder.names():
            if _OURS.fullmatch(name) and name.startswith(_layout.STALE_PREFIXES):
                log.info("removing %s left by an earlier crash", name)
                remove(os.path.join(directory, name))
        folder.sync(strict=True)


def put_back(directory: str, old: str, final: str) -> None:
    """Rename a re-save's set-aside copy ``old`` back to ``final`` if nothing took that name (best effort: the
    next save's :func:`clean_stale` does it otherwise)."""
    try:
        with Confined(directory) as folder:
            if folder.lstat(final) is None:
                folder.rename(old, final)
    except CheckpointError as e:
        log.warning("could not put %s back as %s: %s (the next save does)", old, final, e)


def trash(directory: str, step: int) -> str | None:
    """Rename a committed step to ``.trash-*`` (invisible to readers at once); its bytes go later."""
    src = _layout.step_dirname(step)
    dst = f".trash-{src}-{uuid.uuid4().hex[:8]}"
    try:
        with Confined(directory) as folder:
            folder.rename(src, dst)
    except CheckpointError as e:
        log.warning("could not rotate out checkpoint step %d: %s (it stays; the new one is committed)", step, e)
        return None
    return os.path.join(directory, dst)


def set_aside(directory: str, name: str, step: int, token: str) -> str:
    """Rename the step directory ``name`` to ``.rejected-step_<step>-<token>`` (the caller fsyncs ``directory``)."""
    dst = f"{_layout.REJECTED_PREFIX}{_layout.step_dirname(step)}-{token}"
    with Confined(directory) as folder:
        folder.rename(name, dst)
    return os.path.join(directory, dst)


def delete_all(paths: list[str]) -> None:
    """Delete rotated-out checkpoints off the save's critical path (a crash leaves .trash-*, cleaned later)."""
    for path in paths:
        remove(path)
