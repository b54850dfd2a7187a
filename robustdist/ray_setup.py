"""Deprecated: the Ray worker hook moved to :mod:`robustdist.ray.hook`.

``runtime_env={"worker_process_setup_hook": "robustdist.ray_setup.worker_setup"}`` lives in users' code and
cluster configs, so the old string keeps working: it runs the same hook and warns
(:class:`~robustdist.RobustDistDeprecationWarning`), naming the new string,
``"robustdist.ray.hook.worker_setup"``. Like the hook itself, this module imports neither torch nor ray.
"""

from __future__ import annotations

import logging
import warnings

from robustdist.ray import hook as _hook
from robustdist.runtime.errors import RobustDistDeprecationWarning

# The stdlib logger, not robustdist's rank-aware one: finding the rank imports torch, which this hook must not.
_logger = logging.getLogger(__name__)

__all__ = ["cancel_worker_setup", "worker_setup"]

_MOVED = ("robustdist.ray_setup.{name} moved to robustdist.ray.hook.{name}; the old path still works but will be "
          "removed. Fix: use runtime_env={{\"worker_process_setup_hook\": \"robustdist.ray.hook.worker_setup\"}} "
          "(or import robustdist.ray.hook).")


def _deprecated(name: str) -> None:
    """Warn that ``name`` moved. A worker that turns warnings into errors still gets its hook: the hook has
    already run, and the warning is logged instead of failing the worker's start."""
    try:
        warnings.warn(_MOVED.format(name=name), RobustDistDeprecationWarning, stacklevel=3)
    except RobustDistDeprecationWarning as e:
        _logger.warning("%s", e)


def worker_setup() -> None:
    """Deprecated alias of :func:`robustdist.ray.hook.worker_setup`: runs it, then warns."""
    _hook.worker_setup()
    _deprecated("worker_setup")


def cancel_worker_setup() -> bool:
    """Deprecated alias of :func:`robustdist.ray.hook.cancel_worker_setup`: runs it, then warns."""
    cancelled = _hook.cancel_worker_setup()
    _deprecated("cancel_worker_setup")
    return cancelled
