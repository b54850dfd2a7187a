"""In-process recovery (experimental, off by default): a fault on one rank becomes a job-wide generation change, and
every rank gets out of the collective it is in, without a process restart.

What exists: :mod:`.loop` (:func:`run_in_process`: the re-entrant loop, experimental), :mod:`.faults` (the
generation protocol: :func:`declare_fault`, :class:`FaultWatch`), :mod:`.generations` (a generation's watch from the
moment its group exists; a failed build declared), :mod:`.handover` (the store from one generation to the next),
:mod:`.timings` (each recovery's phases on this rank: :func:`history`) and, in the runtime,
:mod:`robustdist.runtime.group_sockets` (a gloo collective in progress unblocked by shutting its group's
connections down) and :func:`robustdist.runtime.dist.interrupt_waits`. A process that replaces a killed rank joins
the survivors through :mod:`.replacement` and :mod:`.joining`; ``robustdist run``, which starts it, is
:mod:`robustdist.launcher`. What is missing: docs/status.md. Imports :mod:`robustdist.runtime` and
:mod:`robustdist.health`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.recovery.faults import Fault, FaultWatch, clear_generation, declare_fault, read_fault
    from robustdist.recovery.loop import generation, run_in_process
    from robustdist.recovery.timings import Recovery, history

__getattr__, __dir__, __all__ = _attach(__name__, {
    **dict.fromkeys(["Fault", "FaultWatch", "clear_generation", "declare_fault", "read_fault"],
                    "robustdist.recovery.faults"),
    **dict.fromkeys(["generation", "run_in_process"], "robustdist.recovery.loop"),
    **dict.fromkeys(["Recovery", "history"], "robustdist.recovery.timings")})
