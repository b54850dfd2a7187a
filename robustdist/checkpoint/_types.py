"""The checkpoint package's types, at its bottom: what ``save``/``load`` return, one save in flight, and the
context the commit protocol (:mod:`._protocol`) and the loader (:mod:`._loading`) work in.

Nothing here does I/O or talks to other ranks; every other checkpoint module may import it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from robustdist.checkpoint._background import Leaving
from robustdist.runtime.dist import Collectives

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CheckpointInfo", "Context", "FileEntry", "LoadedCheckpoint", "SaveJob"]

FileEntry = dict[str, Any]
"""One file's manifest entry: ``{"size": int, "crc32": hex}`` (``"sha256"`` in robustdist 0.1.0 manifests)."""


@dataclass
class CheckpointInfo:
    """What a save did. For an async save, ``total_seconds``, ``files`` and ``bytes`` fill in when it commits."""

    step: int
    path: str
    blocking_seconds: float = 0.0
    total_seconds: float | None = None
    files: int | None = None
    bytes: int | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)


@dataclass
class LoadedCheckpoint:
    """What ``load`` found: the saved entries (``state``), this rank's ``per_rank`` entries, the manifest."""

    step: int
    path: str
    state: dict[str, Any]
    """The saved entries. Those restored into live objects (modules, optimizers) may share their tensors with them:
    an optimizer keeps the tensors it is given, and the in-memory tier copies a tensor straight into the live one it
    restores. Clone them to keep the values as loaded."""
    per_rank: dict[str, Any]
    metadata: dict[str, Any]
    manifest: dict[str, Any]
    source: str = "durable"
    """Where this rank's state came from: ``"durable"`` (the checkpoint directory), ``"memory"`` (the in-memory
    tier on this node), ``"replica"`` (the copy a peer node held for this rank) or ``"peer"`` (another rank's
    in-memory copy on another node)."""
    source_detail: str = ""
    """The copy used, in words (in-memory tier only)."""
    from_process: bool = False
    """In-memory tier: this rank's own state came from this process's memory (the snapshot it took, kept for an
    in-process recovery), without reading or deserialising its file."""


@dataclass(frozen=True)
class Context:
    """Where a checkpointer works and with whom: all the commit protocol and the loader know of it."""

    directory: str
    """The checkpoint directory (absolute)."""
    group: ProcessGroup | None
    """The process group of the protocol's collectives (None without one)."""
    rank: int
    """This rank in ``group`` (0 without one)."""
    world_size: int
    """The size of ``group`` (1 without one)."""
    distributed: bool
    """Whether a multi-rank default group was up when the checkpointer was made."""
    timeout: float
    """Seconds bounding every wait."""
    collectives: Collectives
    """The bounded, named collectives over ``group`` (:mod:`._collective`)."""
    max_file_bytes: int | None = None
    """The largest payload file a load reads; None: derived from the live state (:func:`._live.file_cap`)."""

    @property
    def err_rank(self) -> int | None:
        """The rank to name in errors: only in a distributed job (a single process has no rank to name)."""
        return self.rank if self.distributed else None


@dataclass
class SaveJob:
    """One save between its snapshot (step 2 of :mod:`._protocol`) and its commit (steps 3 to 6)."""

    step: int
    token: str
    """Rank 0's random token for this save (names the staging directory and the report's store keys)."""
    staging: str
    """The staging directory, ``<dir>/.tmp-step_<step>-<token>``."""
    info: CheckpointInfo
    """Returned by ``save()``; filled in when the save commits."""
    start: float
    """``time.perf_counter()`` when ``save()`` was called."""
    replicated: dict[str, Any] = field(default_factory=dict)
    """Rank 0: the snapshot of the replicated entries (``replicated.pt``); empty on the other ranks."""
    mine: dict[str, Any] = field(default_factory=dict)
    """This rank's RNG state and ``per_rank`` entries (``rank_<r>.pt``)."""
    sharded_files: dict[str, FileEntry] = field(default_factory=dict)
    """Files DCP wrote under ``sharded/`` for this rank, by name relative to the step directory."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The caller's JSON metadata, for the manifest."""
    kinds: dict[str, str] = field(default_factory=dict)
    """Entry name -> ``"module"``/``"stateful"``/``"data"``/``"sharded"``, for the manifest."""
    leaving: Leaving = field(default_factory=Leaving)
    """Whether the background part is in its report or commit collective, and whether an in-process recovery left
    it behind (it then starts no further step: :mod:`._background`)."""
    reported: bool = False
    """Every rank's report arrived (the commit collective is next)."""
    committed: bool = False
    """Rank 0: the step was renamed into place."""
