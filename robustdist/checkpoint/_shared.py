"""Every rank must see one checkpoint directory: the shared-directory check and the commit's file check.

Rank 0 commits a manifest listing the files every rank wrote, and on load every rank reads rank 0's files.
When ``checkpoint.dir`` is node-local (each node has its own disk or tmpfs at that path), rank 0 would commit
a manifest for files it cannot see, and a resume would read different directories on different nodes. Two
guards refuse that, each with the same :class:`~robustdist.runtime.errors.CheckpointError` on every rank.

:func:`check_shared_dir` runs once per checkpointer before its first ``save()`` and before each ``load()``
until it has passed (in ``AtomicCheckpointer``, right after the arrival check), only when the group has more
than one rank. Its protocol:

1. Every rank creates ``<dir>/.robustdist-probe-<rank>-<random>`` (``O_CREAT|O_EXCL|O_NOFOLLOW``) holding a
   fresh random token and closes it (close-to-open: an NFS client flushes it then). No collective.
2. Every rank's node (:func:`robustdist.runtime.node.node_label`), probe name and token, or its write error.
   **Collective: all_gather.** On a write error a save raises on every rank; a load lets a rank that cannot
   write (a read-only directory) only read, and skips the check (it runs again later) when rank 0 cannot.
3. Rank 0 reads every other rank's probe (on a few threads in a large job); every other rank reads rank 0's:
   the visibility the protocols need (rank 0 commits the others' files; everyone reads rank 0's). A probe is
   read without following a link, non-blocking (a FIFO cannot hang it), as a regular file of at most 256
   bytes, and must hold the token that rank just gathered: a missing, stale (earlier run) or forged file
   fails. A missing probe is looked for again for up to :data:`GRACE_S` seconds (a slow mount). No collective.
4. What each rank could not see. **Collective: all_gather** (bounded, like step 2, by the checkpointer's
   collective timeout). Every rank then removes its own probe (also when a step failed) and, if any rank
   missed a probe, raises the same error naming the nodes that do not see each other's files.

:func:`unseen_files` is the commit's belt and braces (step 5 of :mod:`._protocol`): before rank 0 writes the
manifest, every file a rank reported must be in rank 0's staging directory, a regular file of the reported
size; :func:`refusal` is the error rank 0 then broadcasts instead of committing.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._types import Context, FileEntry
from robustdist.runtime.errors import CheckpointError, ranks_phrase
from robustdist.runtime.log import get_logger
from robustdist.runtime.node import node_label

__all__ = ["GRACE_S", "PROBE_PREFIX", "check_shared_dir", "probe_name", "refusal", "this_node", "unseen_files"]

log = get_logger(__name__)
PROBE_PREFIX = ".robustdist-probe-"
_PROBE_RE = re.compile(re.escape(PROBE_PREFIX) + r"[A-Za-z0-9_.-]{1,150}")
GRACE_S = 1.0
"""Seconds a missing probe or reported file is looked for again before it counts as unseen."""
_MAX_PROBE = 256
_NO_PROBE, _MISSING = "no such file", "missing"
_SHOWN = 8
_UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})
FIX = ("Fix: put checkpoint.dir on shared storage that every node mounts at the same path (NFS, Lustre, or a "
       "bucket mount such as gcsfuse or s3fs), or run the job on one node.")
WHY = ("rank 0 commits a manifest listing the files every rank writes, and every rank reads rank 0's files on "
       "resume")

K = TypeVar("K")
_SERIAL = 64
"""Up to this many files are looked at one by one; more (a large job) on a few threads, since each look is a
round trip to the server on network storage."""

Row = tuple[str, str | None, str | None, str | None, bool]
"""One rank's step 2: ``(node label, probe name, token, write error, whether the error means unwritable)``."""


def this_node() -> str:
    """This process's node in words (``node 1 (host gpu-07, 10.0.0.2)``, :func:`robustdist.runtime.node.node_label`)."""
    return node_label()


def probe_name(rank: int) -> str:
    """A fresh, unguessable probe name for ``rank`` (tests replace it to plant a file at the name)."""
    return f"{PROBE_PREFIX}{rank:05d}-{uuid.uuid4().hex}"


def _write_probe(directory: str, name: str, token: str) -> tuple[str | None, bool]:
    """Create ``<directory>/<name>`` holding ``token``: ``(None, False)`` or ``(the error, whether unwritable)``."""
    try:
        with Confined(directory) as folder:
            folder.put(name, token.encode(), mode=0o600)  # O_EXCL | O_NOFOLLOW; nothing left on a failed write
    except CheckpointError as e:
        cause = getattr(e, "os_error", None)
        if not isinstance(cause, OSError):
            return e.message, False
        return f"{type(cause).__name__}: {cause.strerror or cause}", cause.errno in _UNWRITABLE
    return None, False


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "a special file"


def _read_probe(directory: str, name: str, token: str) -> str | None:
    """None if ``<directory>/<name>`` is a regular file holding exactly ``token``; else what is there instead."""
    if not _PROBE_RE.fullmatch(name):
        return "no probe (an invalid name was reported)"
    try:
        with Confined(directory) as folder:
            info = folder.lstat(name)
            if info is None:
                return _NO_PROBE
            if stat.S_ISLNK(info.st_mode):
                return "a symbolic link, not the probe"
            if not stat.S_ISREG(info.st_mode):
                return f"{_kind(info.st_mode)}, not the probe"
            if info.st_size > _MAX_PROBE:
                return f"a {info.st_size}-byte file, not the probe"
            data = folder.read(name, max_size=_MAX_PROBE)  # not a link, a regular file, bounded: checked again
    except CheckpointError as e:
        return f"an unreadable file ({e.message})"
    if data is None:
        return _NO_PROBE
    if data != token.encode():
        return "a file with other content (stale or forged), not the probe"
    return None


def _look_all(look: Callable[[K], str | None], keys: Iterable[K]) -> dict[K, str]:
    """``key -> look(key)`` for each key whose look finds a problem (threads for many keys)."""
    keys = list(keys)
    if len(keys) <= _SERIAL:
        found = [look(k) for k in keys]
    else:
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="robustdist-ckpt-look") as pool:
            found = list(pool.map(look, keys))
    return {k: why for k, why in zip(keys, found) if why is not None}


def _retry_missing(look: Callable[[], dict[Any, str]]) -> dict[Any, str]:
    """``look()`` again, for up to :data:`GRACE_S` s, while something is missing and nothing else is wrong (a
    file of the wrong kind, size or content stays wrong; a missing one may only be slow to show)."""
    found = look()
    deadline, delay = time.monotonic() + GRACE_S, 0.02
    while found and all(why in (_NO_PROBE, _MISSING) for why in found.values()) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
        found = look()
    return found


def check_shared_dir(ctx: Context, *, writing: bool) -> bool:
    """Steps 1 to 4 of the module docstring on this rank: True once every rank sees one directory, False when
    a load had to skip the check (rank 0 cannot write its probe); raise :class:`CheckpointError` otherwise."""
    if ctx.world_size <= 1:
        return True
    name, token = probe_name(ctx.rank), secrets.token_hex(16)
    problem, unwritable = _write_probe(ctx.directory, name, token)
    try:
        row: Row = (this_node(), name, token, None, False)
        if problem is not None:
            row = (row[0], None, None, problem, unwritable)
        everyone: list[Row] = ctx.collectives.all_gather(row, "shared-directory probe")
        if not _writes_ok(ctx, everyone, writing):
            return False
        targets = [r for r in range(ctx.world_size) if r != 0] if ctx.rank == 0 else [0]
        wrote = {r: (everyone[r][1], everyone[r][2]) for r in targets if everyone[r][1] is not None}
        mine = _retry_missing(lambda: _look_all(lambda r: _read_probe(ctx.directory, str(wrote[r][0]),
                                                                       str(wrote[r][1])), wrote))
        unseen: list[dict[int, str]] = ctx.collectives.all_gather(mine, "shared-directory verdict")
    finally:
        if problem is None:
            _remove(ctx.directory, name)
    failures = [(reader, writer, why) for reader, found in enumerate(unseen) for writer, why in sorted(found.items())]
    if failures:
        _raise_unshared(ctx, everyone, failures, writing)
    log.debug("every rank sees the checkpoint directory %s", ctx.directory)
    return True


def _remove(directory: str, name: str) -> None:
    try:
        with Confined(directory) as folder:
            folder.remove(name, _PROBE_RE)
    except CheckpointError as e:
        log.warning("could not remove the probe file %s: %s (harmless: it is never read as a checkpoint)",
                    os.path.join(directory, name), e)


def _writes_ok(ctx: Context, everyone: list[Row], writing: bool) -> bool:
    """Raise if a save's rank could not write its probe; False if a load cannot check (rank 0 cannot write)."""
    failed = {r: row[3] for r, row in enumerate(everyone) if row[3] is not None}
    if not failed:
        return True
    if not writing and all(everyone[r][4] for r in failed):
        if 0 in failed:
            log.info("the checkpoint directory %s is not writable by rank 0 (%s): the shared-directory check is "
                     "skipped for this load and runs at the first save", ctx.directory, failed[0])
            return False
        return True  # the ranks that cannot write only read rank 0's probe
    shown = "; ".join(f"rank {r} on {everyone[r][0]}: {failed[r]}" for r in sorted(failed)[:_SHOWN])
    raise CheckpointError(
        f"{ranks_phrase(failed)} could not create a probe file in the checkpoint directory {ctx.directory} ({shown}); "
        "expected a directory every rank can write, since every rank writes its own files there. Nothing was "
        f"{'saved' if writing else 'loaded'}. Fix: make checkpoint.dir writable by every rank, on storage every "
        "node shares.", rank=ctx.err_rank, ranks=list(failed))


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 4, 6`` or ``ranks 8-15`` (a node's ranks are usually consecutive)."""
    if len(ranks) > 2 and ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ranks_phrase(ranks[:_SHOWN]) + (f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else "")


def _raise_unshared(ctx: Context, everyone: list[Row], failures: list[tuple[int, int, str]], writing: bool) -> None:
    labels = [row[0] for row in everyone]
    cut = sorted({writer if reader == 0 else reader for reader, writer, _ in failures})
    nodes: dict[str, list[int]] = {}
    for r in cut:
        nodes.setdefault(labels[r], []).append(r)
    parties = [f"{_ranks(ranks)} on {label}" for label, ranks in list(nodes.items())[:_SHOWN]]
    if len(nodes) > _SHOWN:
        parties.append(f"{len(nodes) - _SHOWN} more node(s)")
    seen = [f"rank {reader} found {why} where rank {writer} wrote its probe {everyone[writer][1]}"
            for reader, writer, why in failures[:_SHOWN]]
    if len(failures) > _SHOWN:
        seen.append(f"{len(failures) - _SHOWN} more")
    done = "Nothing was saved or committed" if writing else "Nothing was loaded"
    raise CheckpointError(
        f"the checkpoint directory {ctx.directory} (checkpoint.dir) is not the same directory on every node: "
        f"{', '.join(parties)} and rank 0 on {labels[0]} do not see each other's files ({'; '.join(seen)}). Expected "
        f"one directory that every rank sees: {WHY}. {done}. {FIX}", rank=ctx.err_rank, ranks=[0, *cut])


def unseen_files(staging: str, reports: Mapping[int, tuple[Any, dict[str, FileEntry] | None, str]]
                 ) -> dict[tuple[int, str], str]:
    """Rank 0, before the manifest: ``(rank, file) -> what rank 0 sees instead`` for each reported file that
    is not in ``staging`` as a regular file of the reported size (missing ones are looked for again briefly)."""
    expected = {(r, name): entry for r, (_, files, _) in sorted(reports.items())
                for name, entry in (files or {}).items()}

    def look(key: tuple[int, str]) -> str | None:
        try:
            info = os.lstat(os.path.join(staging, key[1]))
        except OSError:
            return _MISSING
        if stat.S_ISLNK(info.st_mode):
            return "a symbolic link"
        if not stat.S_ISREG(info.st_mode):
            return _kind(info.st_mode)
        if info.st_size != expected[key].get("size"):
            return f"{info.st_size} bytes, not the {expected[key].get('size')} rank {key[0]} wrote"
        return None

    return _retry_missing(lambda: _look_all(look, expected))


def refusal(step: int, directory: str, staging: str, unseen: dict[tuple[int, str], str],
            nodes: Mapping[int, str]) -> CheckpointError:
    """The error every rank raises when rank 0 refuses to commit ``step`` over :func:`unseen_files`."""
    by_rank: dict[int, list[str]] = {}
    for (r, name), why in sorted(unseen.items()):
        by_rank.setdefault(r, []).append(f"{name} ({why})")
    ranks = sorted(by_rank)
    shown = "; ".join(f"rank {r} on {nodes.get(r, 'an unknown node')}: {', '.join(by_rank[r][:_SHOWN])}"
                      + (f" and {len(by_rank[r]) - _SHOWN} more" if len(by_rank[r]) > _SHOWN else "")
                      for r in ranks[:_SHOWN])
    more = f"; {len(ranks) - _SHOWN} more rank(s)" if len(ranks) > _SHOWN else ""
    return CheckpointError(
        f"checkpoint step {step} was not committed: rank 0 does not see files that {ranks_phrase(ranks)} reported "
        f"writing ({shown}{more}). Expected each of them in {staging}, as written, before rank 0 commits the "
        f"manifest that lists them: the checkpoint directory {directory} (checkpoint.dir) is not the same directory "
        "on every node (or something removed the files). Nothing was committed and the staging directory was "
        f"removed; the previous checkpoints are untouched. {FIX}", ranks=ranks)
