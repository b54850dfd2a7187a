"""In-process recovery (issue #34, in progress): a fault on one rank becomes a job-wide generation change, and
every rank gets out of the collective it is in, without a process restart.

What exists: :mod:`.faults` (the generation protocol: :func:`declare_fault`, :class:`FaultWatch`) and, in the
runtime, :mod:`robustdist.runtime.group_sockets` (a gloo collective in progress unblocked by shutting its
group's connections down). Not yet: the re-entrant loop, rebuilding the group and the wrappers, restoring from
the in-memory tier, escalation (docs/status.md). Imports :mod:`robustdist.runtime` only, so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.recovery.faults import Fault, FaultWatch, declare_fault, read_fault

__getattr__, __dir__, __all__ = _attach(__name__, dict.fromkeys(
    ["Fault", "FaultWatch", "declare_fault", "read_fault"], "robustdist.recovery.faults"))
