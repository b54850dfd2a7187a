"""Test-only fault injection for the checkpoint protocol.

``HOOK`` is None in production and nothing in robustdist sets it: only code that deliberately assigns
``robustdist.checkpoint._faults.HOOK = fn`` (the fault-injection tests, in a child process) can reach it. No
environment variable or config enables it. The protocol calls ``phase(name)`` at: ``"writing"`` (a file is
partly written), ``"files_written"`` (this rank's files are done, before the cross-rank report),
``"manifest_written"`` (before the staging dir is renamed), ``"moved_aside"`` (a re-save moved the committed copy aside, before the staging dir takes its name), ``"committed"``, and ``"rotating"`` (an old
checkpoint was moved to the trash, before it is deleted). The in-memory tier calls ``"local_writing"`` (a copy's
files are written, before its meta and rename), ``"local_own_committed"`` (this rank's own copy is in place,
before replication) and ``"local_replicated"`` (the replicas are in place, before the agreement).
"""

from __future__ import annotations

from collections.abc import Callable

HOOK: Callable[[str], None] | None = None


def phase(name: str) -> None:
    if HOOK is not None:
        HOOK(name)
