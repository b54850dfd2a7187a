"""The lineage of the in-memory tier's copies: which durable checkpoint directory they belong to.

A random token rank 0 keeps in ``<checkpoint.dir>/.robustdist-lineage`` names the tier's directory and is
written into every copy; copies of another lineage are never restored (see
:mod:`robustdist.checkpoint.local.tier`).
"""

from __future__ import annotations

import os
import re
import uuid

from robustdist.checkpoint._io import fsync_dir
from robustdist.checkpoint._layout import committed_steps
from robustdist.checkpoint._safeio import read_in
from robustdist.runtime.dist import Collectives
from robustdist.runtime.errors import CheckpointCorruptError
from robustdist.runtime.log import get_logger

__all__ = ["LINEAGE", "lineage_of"]

log = get_logger(__name__)
LINEAGE = ".robustdist-lineage"
_TOKEN = re.compile(r"[0-9a-f]{32}")


def lineage_of(directory: str, rank: int, collectives: Collectives, *, renew: bool = False) -> str:
    """The lineage of the in-memory copies that belong to this durable directory: a random token rank 0 keeps
    in ``<directory>/.robustdist-lineage`` (the durable checkpoint directory; created when missing or not a
    token; shared with every rank). A wiped or replaced checkpoint directory gets a new token, so stale copies
    left in ``/dev/shm`` are never restored. ``renew`` (a fresh launch, attempt 0): a directory that holds no
    committed durable step gets a new token too, so ``rm -rf ckpt/*`` (which keeps dotfiles) starts afresh."""
    token: str | None = None
    if rank == 0:
        try:
            token = read_in(directory, LINEAGE, max_size=64).decode("ascii", "replace").strip()
        except CheckpointCorruptError:
            token = None
        if token is not None and renew and not committed_steps(directory):
            token = None
        if token is None or not _TOKEN.fullmatch(token):
            path = os.path.join(directory, LINEAGE)
            if os.path.lexists(path):
                log.info("%s: a new lineage token (the previous one is missing, not a token, or this is a fresh "
                         "launch on a directory without checkpoints); in-memory copies of the old one are not used",
                         path)
                os.unlink(path)
            token = uuid.uuid4().hex
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(token)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            fsync_dir(directory)
    return str(collectives.broadcast(token, "lineage"))
