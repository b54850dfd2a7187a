"""The on-disk layout: ``<dir>/step_<step:010d>/`` holding ``manifest.json`` and the data files.

A checkpoint is *committed* when its directory has its final name and holds ``manifest.json``; staging
(``.tmp-step_*``), replaced (``.old-step_*``) and rotated-out (``.trash-step_*``) directories never count.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

from robustdist.checkpoint._io import crc32_file, sha256_file
from robustdist.errors import CheckpointCorruptError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPLICATED = "replicated.pt"
SHARDED_DIR = "sharded"
_STEP_RE = re.compile(r"^step_(\d{10})$")
STALE_PREFIXES = (".tmp-step_", ".old-step_", ".trash-step_")


def step_dirname(step: int) -> str:
    return f"step_{step:010d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def step_dirs(directory: str) -> list[int]:
    """Steps whose directory has its final name, oldest first (committed or damaged)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := _STEP_RE.match(name)))


def committed_steps(directory: str) -> list[int]:
    """Steps whose directory has its final name and a manifest, oldest first."""
    return [s for s in step_dirs(directory) if os.path.isfile(os.path.join(directory, step_dirname(s), MANIFEST))]


def read_manifest(step_dir: str) -> dict[str, Any]:
    path = os.path.join(step_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: unreadable ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or "files" not in manifest:
        raise CheckpointCorruptError(f"{path}: not a robustdist manifest of format {FORMAT_VERSION}")
    return manifest


def files_for_rank(manifest: dict[str, Any], rank: int) -> list[str]:
    """The files ``rank`` reads on load: the replicated state, its own RNG file if any, every sharded file."""
    files = manifest["files"]
    needed = [REPLICATED] if REPLICATED in files else []
    if rank_file(rank) in files:
        needed.append(rank_file(rank))
    needed += sorted(f for f in files if f.startswith(SHARDED_DIR + "/"))
    return needed


def verify(step_dir: str, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Check each file's size and checksum (CRC-32, or SHA-256 in 0.1.0 manifests) against the manifest; raise
    CheckpointCorruptError naming the file."""
    for name in names:
        expected = manifest["files"][name]
        path = os.path.join(step_dir, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path}: missing") from None
        if size != expected["size"]:
            raise CheckpointCorruptError(f"{path}: {size} bytes, expected {expected['size']} (truncated or extended)")
        if "crc32" in expected:
            algorithm, actual, wanted = "CRC-32", crc32_file(path)[1], expected["crc32"]
        elif "sha256" in expected:
            algorithm, actual, wanted = "SHA-256", sha256_file(path)[1], expected["sha256"]
        else:
            raise CheckpointCorruptError(f"{path}: the manifest records no checksum for it")
        if actual != wanted:
            raise CheckpointCorruptError(f"{path}: {algorithm} differs from the manifest (the bytes changed)")


def verify_all(directory: str) -> list[dict[str, Any]]:
    """One row per committed checkpoint: step, files, bytes, status ("ok"/"corrupt") and reason."""
    rows = []
    for step in step_dirs(directory):
        step_dir = os.path.join(directory, step_dirname(step))
        try:
            manifest = read_manifest(step_dir)
            verify(step_dir, manifest, manifest["files"])
            files = manifest["files"]
            rows.append({"step": step, "files": len(files), "bytes": sum(f["size"] for f in files.values()),
                         "status": "ok", "reason": ""})
        except CheckpointCorruptError as e:
            rows.append({"step": step, "files": None, "bytes": None, "status": "corrupt", "reason": str(e)})
    return rows
