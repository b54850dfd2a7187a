"""The lineage of the in-memory tier's copies: which durable checkpoint directory they belong to.

A random token rank 0 keeps in ``<checkpoint.dir>/.robustdist-lineage`` names the tier's directory and is
written into every copy; copies of another lineage are never restored (see
:mod:`robustdist.checkpoint.local.tier`).
"""

from __future__ import annotations

import re
import uuid

from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._layout import committed_steps
from robustdist.runtime.dist import Collectives
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError
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
    committed durable step gets a new token too, so ``rm -rf ckpt/*`` (which keeps dotfiles) starts afresh.

    Collective. A token that cannot be written (a directory planted at its name, a read-only directory) is a
    :class:`CheckpointError` on every rank, naming the path and the fix."""
    found: tuple[str, str] = ("error", "")
    if rank == 0:
        try:
            found = ("token", _token(directory, renew))
        except CheckpointError as e:
            found = ("error", e.message)
    kind, value = collectives.broadcast(found, "lineage")
    if kind != "token":
        raise CheckpointError(value, rank=collectives.rank if collectives.world_size > 1 else None)
    return str(value)


def _token(directory: str, renew: bool) -> str:
    with Confined(directory) as folder:
        try:
            raw = folder.read(LINEAGE, max_size=64)
            token = raw.decode("ascii", "replace").strip() if raw is not None else None
        except CheckpointCorruptError:
            token = None
        if token is not None and renew and not committed_steps(directory):
            token = None
        if token is not None and _TOKEN.fullmatch(token):
            return token
        if folder.kind(LINEAGE) is not None:
            log.info("%s/%s: a new lineage token (the previous one is missing, not a token, or this is a fresh "
                     "launch on a directory without checkpoints); in-memory copies of the old one are not used",
                     directory, LINEAGE)
        token = uuid.uuid4().hex
        folder.write(LINEAGE, token.encode("ascii"))  # replaces a file or link there; a directory is refused
        return token
