"""Runtime health guards, each usable alone: the :class:`Watchdog` (hangs) and the :class:`StepGuard` (non-finite
losses and gradients, cross-rank divergence).

:mod:`.watchdog` with :mod:`.watchdog_store` (the heartbeats and the hang report through the store),
:mod:`.step_guard` with :mod:`.grad_check` (the non-finite checks), :mod:`.restart_guard` (a crash loop is
stopped, not restarted forever). Imports :mod:`robustdist.runtime`, :mod:`robustdist.config`,
:mod:`robustdist.parallel` and :mod:`robustdist.checkpoint`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.health.step_guard import HANG_EXIT_CODE, HangReport, StepDecision, StepGuard, Watchdog

__getattr__, __dir__, __all__ = _attach(__name__, dict.fromkeys(
    ["HANG_EXIT_CODE", "HangReport", "StepDecision", "StepGuard", "Watchdog"], "robustdist.health.step_guard"))
