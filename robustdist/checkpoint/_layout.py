"""The on-disk layout: ``<dir>/step_<step:010d>/`` holding ``manifest.json`` and the data files.

A checkpoint is *committed* when its directory (a real directory, not a link) has its final name and holds
``manifest.json``; staging (``.tmp-step_*``) and rotated-out (``.trash-step_*``) directories never count. A
re-save of an existing step moves the committed copy aside to ``.old-step_<step>-<token>`` for the instant
between its two renames: if a crash lands there, that copy is still the committed one (readers use it, and
the next writer renames it back), so a re-save never leaves zero committed copies. Step numbers have at
least ten digits, more when they need them (``step_12345678901``). A ``.rejected-step_<step>-<token>``
directory is a step whose files a ``load()`` found corrupt, moved aside by a later save of a lower step (see
:mod:`._protocol`, step 6): it is not a step (not listed, loaded, verified or rotated) and is never deleted.

Every file is read through :mod:`._safeio` (confined to the step directory, regular files only, sizes
checked first) and every manifest is validated by :mod:`._schema` before use.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from typing import Any, BinaryIO

from robustdist.checkpoint._io import Crc32, digest_stream
from robustdist.checkpoint._safeio import lexists_dir, open_in, read_in
from robustdist.checkpoint._schema import (
    DCP_METADATA,
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_STEP,
    REPLICATED,
    SHARDED_DIR,
    check_manifest,
    rank_file,
)
from robustdist.runtime.errors import CheckpointCorruptError
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["DCP_METADATA", "FORMAT_VERSION", "MANIFEST", "REPLICATED", "SHARDED_DIR", "committed_steps",
           "files_for_rank", "identity", "rank_file", "read_manifest", "staging_dir", "step_dirname", "step_dirs",
           "verify"]

_STEP_RE = re.compile(r"^step_(\d{10,})$")
_OLD_RE = re.compile(r"^\.old-step_(\d{10,})-[0-9a-f]+$")
STALE_PREFIXES = (".tmp-step_", ".old-step_", ".trash-step_")
REJECTED_PREFIX = ".rejected-"  # a step a load found corrupt, set aside by a later save: kept, never a step


def step_dirname(step: int) -> str:
    return f"step_{step:010d}"


def _scan(directory: str) -> dict[int, str]:
    """step -> directory name: final names, and a re-save's ``.old-`` copy where the final name is missing."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found: dict[int, str] = {}
    for name in sorted(names):
        m = _STEP_RE.match(name)
        if m and step_dirname(int(m.group(1))) == name and int(m.group(1)) <= MAX_STEP:
            found[int(m.group(1))] = name
    for name in sorted(names):
        m = _OLD_RE.match(name)
        if m and int(m.group(1)) not in found and step_dirname(int(m.group(1))) == f"step_{m.group(1)}" \
                and int(m.group(1)) <= MAX_STEP:
            found[int(m.group(1))] = name
    return found


def step_dirs(directory: str) -> dict[int, str]:
    """Every step with a directory entry, oldest first, mapped to its name (committed, damaged or a link)."""
    return dict(sorted(_scan(directory).items()))


def committed_steps(directory: str) -> list[int]:
    """Steps whose directory is a real directory holding a manifest, oldest first (files not verified)."""
    out = []
    for step, name in step_dirs(directory).items():
        path = os.path.join(directory, name)
        if lexists_dir(path) and os.path.isfile(os.path.join(path, MANIFEST)) \
                and not os.path.islink(os.path.join(path, MANIFEST)):
            out.append(step)
    return out


def identity(step_dir: str) -> tuple[Any, ...] | None:
    """What tells this step directory from one put under its name later (a re-save, a copy): the directory's
    device and inode, and its manifest's inode, mtime and size (an inode number freed by a deletion can be
    reused). None when the directory is gone."""
    try:
        st = os.lstat(step_dir)
    except OSError:
        return None
    try:
        m = os.lstat(os.path.join(step_dir, MANIFEST))
        manifest: tuple[int, int, int] | None = (m.st_ino, m.st_mtime_ns, m.st_size)
    except OSError:
        manifest = None
    return st.st_dev, st.st_ino, manifest


def read_manifest(step_dir: str, step: int | None = None) -> dict[str, Any]:
    """Read and validate ``<step_dir>/manifest.json`` (bounded, confined); CheckpointCorruptError otherwise."""
    path = os.path.join(step_dir, MANIFEST)
    try:
        manifest = json_value(read_in(step_dir, MANIFEST, max_size=MAX_MANIFEST_BYTES), MAX_MANIFEST_BYTES)
    except Unreadable as e:
        raise CheckpointCorruptError(f"{path}: unreadable ({e})") from None
    return check_manifest(path, manifest, step=step)


def files_for_rank(manifest: dict[str, Any], rank: int) -> list[str]:
    """The files ``rank`` reads on load: the replicated state, its own RNG file if any, every sharded file."""
    files = manifest["files"]
    needed = [REPLICATED] if REPLICATED in files else []
    if rank_file(rank) in files:
        needed.append(rank_file(rank))
    needed += sorted(f for f in files if f.startswith(SHARDED_DIR + "/"))
    return needed


def open_verified(step_dir: str, name: str, expected: dict[str, Any]) -> BinaryIO:
    """Open one file, check its size and checksum against the manifest entry, and return it at offset 0.

    The caller deserialises from this same open file, so what was verified is what is read."""
    fh = open_in(step_dir, name, size=expected["size"])
    try:
        algorithm = "crc32" if "crc32" in expected else "sha256"
        digest = Crc32() if algorithm == "crc32" else hashlib.sha256()
        digest_stream(fh, digest)
        if digest.hexdigest() != expected[algorithm]:
            shown = "CRC-32" if algorithm == "crc32" else "SHA-256"
            raise CheckpointCorruptError(f"{os.path.join(step_dir, name)}: {shown} differs from the manifest "
                                         "(the bytes changed)")
        fh.seek(0)
        return fh
    except BaseException:
        fh.close()
        raise


def verify(step_dir: str, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Check each file's size and checksum (CRC-32, or SHA-256 in 0.1.0 manifests) against the manifest; raise
    CheckpointCorruptError naming the file."""
    for name in names:
        open_verified(step_dir, name, manifest["files"][name]).close()


def staging_dir(directory: str, step: int, token: str) -> str:
    """Where a save of ``step`` is written before its rename: ``<dir>/.tmp-step_<step>-<token>``."""
    return os.path.join(directory, f".tmp-{step_dirname(step)}-{token}")
