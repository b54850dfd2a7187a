"""``fail_fast()``: a Ray Train callback that stops retrying a run whose worker failed with an error no retry
can fix.

Ray Train V2 retries every worker failure up to ``FailureConfig.max_failures`` times. A configuration mistake
(``harden`` given a model ``ray.train.torch.prepare_model`` already wrapped, a bad config value) fails the same
way on every attempt, so the run burns ``max_failures`` restarts before it reports it. Added to the run::

    TorchTrainer(train_fn, ..., run_config=RunConfig(callbacks=[robustdist.ray.fail_fast()],
                                                     failure_config=FailureConfig(max_failures=3)))

the controller ends the run at the first such failure. Ray then raises a ``ControllerError`` whose message
carries robustdist's: which rank, which error, and the fix. Non-retryable: :class:`ConfigError`,
:class:`UnsupportedVersionError`, :class:`MissingDependencyError` (none changes on a restart) and
:class:`RestartLoopError` (the restart-loop guard's verdict: restarting is what it stops). Any other failure is
left to ``FailureConfig``.

The callback runs in Ray Train's controller (``ray.train.UserCallback.after_exception``); it reads each
worker's error as Ray hands it over (the error Ray wraps with its traceback, through
:func:`robustdist.runtime._ray_train_compat.worker_error`), and, where that wrapper changed, robustdist's own
exception name in Ray's traceback text. Importing this module imports no Ray: the class is built on first use.
"""

from __future__ import annotations

from typing import Any

from robustdist.runtime import _ray_train_compat
from robustdist.runtime.errors import (
    ConfigError,
    MissingDependencyError,
    RestartLoopError,
    RobustDistError,
    UnsupportedVersionError,
)
from robustdist.runtime.log import get_logger

__all__ = ["NON_RETRYABLE", "fail_fast", "non_retryable"]

log = get_logger(__name__)

NON_RETRYABLE: tuple[type[RobustDistError], ...] = (ConfigError, UnsupportedVersionError, MissingDependencyError,
                                                   RestartLoopError)
_NAMES = tuple(f"robustdist.runtime.errors.{cls.__name__}: " for cls in NON_RETRYABLE)
_cls: type | None = None


def non_retryable(error: BaseException) -> str | None:
    """The message of a non-retryable robustdist error behind ``error`` (as a Ray worker failure arrives in the
    controller), or None."""
    inner = _ray_train_compat.worker_error(error)
    for candidate in (error, inner, getattr(inner, "__cause__", None)):
        if isinstance(candidate, NON_RETRYABLE):
            return f"{type(candidate).__name__}: {candidate}"
    text = str(error)
    for name in _NAMES:  # Ray's traceback text ends with "<module>.<class>: <message>"
        at = text.rfind(name)
        if at >= 0:
            return text[at + len("robustdist.runtime.errors."):].strip()[:4000]
    return None


def fail_fast() -> Any:
    """A ``ray.train.UserCallback`` for ``RunConfig(callbacks=[...])`` (see the module docstring)."""
    return _callback_class()()


def _callback_class() -> type:
    global _cls
    if _cls is None:
        import ray.train

        class FailFast(ray.train.UserCallback):  # type: ignore[misc,name-defined]
            """Ends a Ray Train run at a worker failure that no retry can fix (robustdist.ray.callbacks)."""

            def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
                found = {rank: message for rank, error in sorted(worker_exceptions.items())
                         if (message := non_retryable(error)) is not None}
                if not found:
                    return
                rank, message = next(iter(found.items()))
                others = f" (and ranks {', '.join(map(str, list(found)[1:]))})" if len(found) > 1 else ""
                log.error("Ray Train worker rank %d%s failed with %s", rank, others, message)
                raise ConfigError(
                    f"Ray Train worker rank {rank}{others} failed with {message}\nThis error fails the same way on "
                    "every attempt, so robustdist.ray.fail_fast() ends the run instead of retrying it "
                    "(FailureConfig.max_failures). Fix: the error's own fix above, then start the run again.")

        FailFast.__module__, FailFast.__qualname__ = __name__, "FailFast"
        _cls = FailFast
    return _cls


def __getattr__(name: str) -> Any:
    """``FailFast`` resolves on first use (it subclasses a Ray class), so pickles of the callback load by name."""
    if name == "FailFast":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
