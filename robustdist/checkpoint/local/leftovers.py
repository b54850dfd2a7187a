"""Which in-memory tier directories a running job uses, and removing the others (``robustdist clean``).

A job that fails keeps its tier's files (its restart restores from them), and so does a job that is killed, on a
tmpfs where they hold RAM until someone removes them. Every process with a tier open holds a shared ``flock`` on
``<tier>/.in-use`` (:func:`hold`; the kernel drops it when the process ends, however it ends). :func:`clean`
looks at this user's tier directories under a base (``/dev/shm`` by default), each opened confined and checked as
the tier checks its own (a real directory of this user's that no one else can write, never through a link):
one whose lock it can take exclusively is used by no process and is removed while the lock is held; one held is
kept. A directory without the lock file (made by a robustdist without it) cannot be told apart from a running
job's and is kept unless ``force``. Nothing else under the base is looked at, let alone removed. A tier's own
``close`` removes its directory only when every rank voted clean (:func:`voted_clean`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from robustdist.checkpoint.local import layout
from robustdist.runtime.dist import default_store
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.log import get_logger
from robustdist.runtime.store_barrier import wait_for

__all__ = ["IN_USE", "Leftover", "clean", "hold", "release", "voted_clean"]

log = get_logger("robustdist.checkpoint.local.tier")
IN_USE = ".in-use"
_MAX_LISTED = 10_000


def hold(root: str) -> Any:
    """Hold ``root``'s lock shared while this process uses the tier; returns the open file (see :func:`release`).
    A ``clean`` that removed the directory between its creation and this lock is noticed: the directory is made
    again, and held."""
    for _ in range(3):
        with layout.open_root(root) as tier:
            fh = tier.open_lock(IN_USE)
        fcntl.flock(fh, fcntl.LOCK_SH)  # waits only while a clean holds it exclusively, to remove it
        try:
            same = os.path.samestat(os.fstat(fh.fileno()), os.lstat(os.path.join(root, IN_USE)))
        except OSError:
            same = False
        if same:
            return fh
        fh.close()
        layout.make_root(root)
    raise CheckpointError(f"the in-memory checkpoint directory {root} was removed three times while this job made "
                          "it; expected it to stay. Fix: do not run `robustdist clean` on a job that is starting.")


def release(fh: Any) -> None:
    """Let go of :func:`hold`'s lock (closing the file drops it)."""
    if fh is not None:
        fh.close()


@dataclass
class Leftover:
    """A tier directory found by :func:`clean`: its path, the bytes it holds, and what became of it: ``removed``,
    ``unused`` (``dry_run``), ``in use`` (a running process holds it), ``unknown`` (no lock file: kept unless
    ``force``) or ``refused`` (not a directory of this user's that no one else can write; ``why`` says what)."""

    path: str
    bytes: int
    state: str
    why: str = ""


def clean(base: str = "/dev/shm", *, dry_run: bool = False, force: bool = False) -> list[Leftover]:
    """This user's tier directories under ``base``, each removed when no running process uses it (see the module
    docstring). ``dry_run``: remove nothing, say what would go (``unused``)."""
    mine = re.compile(re.escape(f"{layout.PREFIX}{os.getuid()}-") + r"[0-9a-f]{16}")
    try:
        names = sorted(os.listdir(base))[:_MAX_LISTED]
    except OSError as e:
        raise CheckpointError(f"cannot list {base} ({e.strerror or e}); expected a directory. Fix: pass the base "
                              "the job's checkpoint.local_dir named (default /dev/shm).") from None
    found = []
    for name in names:
        if not mine.fullmatch(name):
            continue
        path = os.path.join(base, name)
        try:
            found.append(_judge(path, dry_run=dry_run, force=force))
        except CheckpointError as e:
            found.append(Leftover(path, 0, "refused", str(e)))
    return found


def _judge(path: str, *, dry_run: bool, force: bool) -> Leftover:
    from robustdist.checkpoint.local.memory import held_bytes

    with layout.open_root(path) as tier:  # checked first: a link or another user's directory is never walked
        size = held_bytes(path, limit=_MAX_LISTED)
        if tier.kind(IN_USE) is None:
            if not force:
                return Leftover(path, size, "unknown", "no lock file (written by an older robustdist): whether a "
                                "job uses it cannot be told; `robustdist clean --force` removes it")
            if not dry_run:
                layout.remove_root(path)
            return Leftover(path, size, "unused" if dry_run else "removed")
        fh = tier.open_lock(IN_USE)
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return Leftover(path, size, "in use", "a running process holds it")
            raise
        if dry_run:
            return Leftover(path, size, "unused")
        layout.remove_root(path)  # under the exclusive lock: a job starting now waits, then makes it again
        return Leftover(path, size, "removed")
    finally:
        fh.close()


def voted_clean(tier: Any, clean: bool) -> bool:
    """Whether every rank of ``tier`` (a :class:`~robustdist.checkpoint.local.tier.LocalTier` closing) closed it
    cleanly, so its directory may go. The vote goes through the job's store, not a collective: a rank leaving on
    an error posts its vote and returns at once; a clean rank waits at most ``arrival_timeout`` for the others, and
    any doubt keeps the files (a restart restores from them)."""
    if not tier.distributed:
        return clean
    store = default_store()
    if store is None:
        return False
    base = f"robustdist/local-close/{tier.collectives.token}"
    try:
        store.set(f"{base}/{tier.rank}", "1" if clean else "0")
        if not clean:
            return False
        keys = [f"{base}/{r}" for r in range(tier.world_size)]
        if not wait_for(store, keys, time.monotonic() + tier.arrival_timeout):
            log.warning("in-memory checkpoints: not every rank closed within %g s; the files stay in %s",
                        tier.arrival_timeout, tier.directory)
            return False
        return all(store.get(k) == b"1" for k in keys)
    except Exception as e:  # the store is gone (its host exited): keep the files
        log.debug("in-memory tier close vote failed: %s", e)
        return False
