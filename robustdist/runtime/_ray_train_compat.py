"""The fence around Ray Train's private names: V2's controller (its ``abort``, its actors' class names), a worker's
internal context (the run's config, the training thread's exception queue, the wrapper of a training function's
error) and the wait for reported checkpoints. Listed in :data:`PRIVATE_APIS`; each accessor degrades as the other
Ray fences' do (:func:`robustdist.runtime._ray_compat.degrade`). Ray is imported inside the functions only.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from robustdist.runtime._ray_compat import ALL_VERIFIED, degrade
from robustdist.runtime.private_api import PrivateAPI

__all__ = ["PG_CLEANER_CLASS", "PRIVATE_APIS", "TRAIN_CONTROLLER_CLASS", "can_wait_reported_checkpoints",
           "controller_abort_supported", "exception_queue", "train_context", "train_loop_config", "user_exception",
           "wait_reported_checkpoints", "worker_error"]

TRAIN_CONTROLLER_CLASS = "TrainController"  # Ray Train V2's controller actor class
PG_CLEANER_CLASS = "PlacementGroupCleaner"  # Ray Train V2's detached placement-group watchdog actor class


# --- Ray Train V2's controller -------------------------------------------------------------------------------


def _controller_abort() -> Callable[..., Any] | None:
    from ray.train.v2._internal.execution.controller import TrainController

    abort = getattr(TrainController, "abort", None)
    return abort if callable(abort) else None


def controller_abort_supported() -> bool:
    """Whether this Ray's Train V2 controller has the ``abort`` remote method (what Ray's own Ctrl-C handler
    calls). Without it fit_async's cancel() skips the graceful abort, saying so once."""
    try:
        if _controller_abort() is not None:
            return True
        found = "no abort method"
    except Exception as e:  # ImportError: no Train V2 in this Ray
        found = f"{type(e).__name__}: {e}"
    degrade("controller_abort", f"Ray Train's controller cannot be asked to abort ({found}); expected "
             f"{TRAIN_CONTROLLER_CLASS}.abort. fit_async's cancel() kills the run and sweeps its placement groups "
             "instead. Fix: none needed; Ray 2.52.1 to 2.60.0 abort gracefully")
    return False


# --- Ray Train V2's worker internals -------------------------------------------------------------------------


def _get_train_context() -> Callable[[], Any]:
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context


def train_context() -> Any | None:
    """Ray Train V2's internal context of this worker, or None (not a Train V2 worker, or no such internal)."""
    try:
        get = _get_train_context()
    except ImportError:
        return None
    try:
        return get()
    except Exception:  # not initialised: not a Train V2 worker
        return None


def train_loop_config(context: Any) -> Any | None:
    """The run's ``train_loop_config`` (``TrainRunContext.train_loop_config``), or None where Ray does not say."""
    return getattr(getattr(context, "train_run_context", None), "train_loop_config", None)


def exception_queue(context: Any) -> Any | None:
    """The training thread runner's exception queue (``execution_context.training_thread_runner
    .get_exception_queue()``): what the controller reads a worker's error from. None, said once, without it."""
    runner = getattr(getattr(context, "execution_context", None), "training_thread_runner", None)
    get = getattr(runner, "get_exception_queue", None)
    if callable(get):
        try:
            return get()
        except Exception as e:  # a runner whose queue is gone
            found = f"get_exception_queue() raised {type(e).__name__}: {e}"
    else:
        found = "no training_thread_runner.get_exception_queue"
    degrade("exception_queue", f"Ray Train's worker context has {found}; expected the training thread runner's "
             "exception queue. A hang is reported by exiting the worker instead (Ray then names a SYSTEM_ERROR, "
             "not the HangError). Fix: use a Ray robustdist was tested on (2.52.1 to 2.60.0; robustdist doctor)")
    return None


def user_exception(error: BaseException) -> Any | None:
    """``error`` (raised, so it has a traceback) wrapped as Ray Train reports a training function's error
    (``construct_user_exception_with_traceback``), or None, said once, where this Ray has no such helper."""
    try:
        from ray.train.v2._internal.util import construct_user_exception_with_traceback as wrap
    except ImportError as e:
        degrade("user_exception", f"Ray Train has no construct_user_exception_with_traceback ({e}); expected it "
                 "in ray.train.v2._internal.util. A hang is reported by exiting the worker instead. Fix: use a Ray "
                 "robustdist was tested on (2.52.1 to 2.60.0; robustdist doctor)")
        return None
    return wrap(error)


def worker_error(error: BaseException) -> BaseException:
    """The training function's own exception inside ``error``, a worker failure as Ray Train's controller holds
    it (``UserExceptionWithTraceback._base_exc``), or ``error`` itself where Ray wraps nothing (or wraps it
    otherwise: the caller then reads Ray's traceback text)."""
    inner = getattr(error, "_base_exc", None)
    return inner if isinstance(inner, BaseException) else error


def _probe_worker_error() -> object | None:
    import inspect as _inspect

    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    source = _inspect.getsource(UserExceptionWithTraceback.__init__)
    return UserExceptionWithTraceback if "self._base_exc = exc" in source else None


def _reported_checkpoints_waiter() -> Callable[[float], Any] | None:
    """``ray.train.get_all_reported_checkpoints`` bound to COMMITTED consistency and a timeout, or None where
    this Ray lacks it, ``CheckpointConsistencyMode.COMMITTED`` or its ``timeout_s`` (never called unbounded)."""
    train = importlib.import_module("ray.train")
    get = getattr(train, "get_all_reported_checkpoints", None)
    mode = getattr(getattr(train, "CheckpointConsistencyMode", None), "COMMITTED", None)
    if get is None or mode is None:
        return None
    try:
        params = inspect.signature(get).parameters
    except (TypeError, ValueError):
        return None
    if "timeout_s" not in params or "consistency_mode" not in params:
        return None
    return lambda timeout: get(consistency_mode=mode, timeout_s=timeout)


def can_wait_reported_checkpoints() -> bool:
    """Whether :func:`wait_reported_checkpoints` can wait on this Ray (says nothing either way)."""
    try:
        return _reported_checkpoints_waiter() is not None
    except ImportError:
        return False


def wait_reported_checkpoints(timeout: float) -> bool:
    """Wait, at most ``timeout`` s, until Ray Train's controller has registered this run's reports
    (``ray.train.get_all_reported_checkpoints``, alpha). False, said once, where this Ray cannot wait with a bound;
    raises what Ray raises on a timeout (the caller logs it)."""
    try:
        wait = _reported_checkpoints_waiter()
    except ImportError:
        wait = None
    if wait is None:
        degrade("reported_checkpoints", "Ray Train has no get_all_reported_checkpoints(consistency_mode=COMMITTED, "
                 "timeout_s=...); robustdist reports without waiting for the controller to register each checkpoint, "
                 "so a worker that dies within a poll interval of a report resumes from Ray's previous checkpoint "
                 "(robustdist's own newer copy is still taken). Fix: none needed; Ray 2.60 waits and closes the gap")
        return False
    wait(timeout)
    return True


# --- the record -------------------------------------------------------------------------------------------------


def _probe_cleaner() -> object | None:
    from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner

    return PlacementGroupCleaner if PlacementGroupCleaner.__name__ == PG_CLEANER_CLASS else None


def _probe_exception_queue() -> object | None:
    import dataclasses

    from ray.train.v2._internal.execution.context import ExecutionContext, TrainContext
    from ray.train.v2._internal.execution.worker_group.thread_runner import ThreadRunner

    ok = "execution_context" in {f.name for f in dataclasses.fields(TrainContext)} and \
        "training_thread_runner" in {f.name for f in dataclasses.fields(ExecutionContext)}
    return getattr(ThreadRunner, "get_exception_queue", None) if ok else None


def _probe_train_loop_config() -> object | None:
    import dataclasses

    from ray.train.v2._internal.execution.context import TrainContext, TrainRunContext

    ok = "train_run_context" in {f.name for f in dataclasses.fields(TrainContext)} and \
        "train_loop_config" in {f.name for f in dataclasses.fields(TrainRunContext)}
    return True if ok else None


def _probe_user_exception() -> object | None:
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    return construct_user_exception_with_traceback


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI(
        dependency="ray", name="ray.train.v2._internal.execution.controller.TrainController.abort",
        used_for="fit_async's cancel() asks the controller to abort as Ray's Ctrl-C handler does (stops its cleaner, "
                 "kills the workers, removes their placement group); without it cancel() kills and sweeps",
        verified=ALL_VERIFIED, probe=_controller_abort),
    PrivateAPI(
        dependency="ray",
        name="ray.train.v2._internal.execution.controller.placement_group_cleaner.PlacementGroupCleaner",
        used_for="fit_async names a detached cleaner that outlived a cancelled run (only its class name is used)",
        verified="Ray 2.55.1, 2.60.0 (absent in 2.52.1: Ray Train starts no cleaner there, so there is none to name)",
        probe=_probe_cleaner, since="2.55.1"),
    PrivateAPI(
        dependency="ray", name="ray.train.v2._internal.execution.context.get_train_context",
        used_for="telling a Train V2 worker apart, and reaching the two internals below; without it robustdist."
                 "ray.train.current() is None (no run identity) and a hang exits the worker",
        verified=ALL_VERIFIED, probe=_get_train_context),
    PrivateAPI(
        dependency="ray", name="TrainContext.train_run_context.train_loop_config",
        used_for="the run identity's config fingerprint (Tune trials differ there); None without it",
        verified=ALL_VERIFIED, probe=_probe_train_loop_config),
    PrivateAPI(
        dependency="ray", name="TrainContext.execution_context.training_thread_runner.get_exception_queue",
        used_for="a hang reaches the controller as the training thread's HangError; without it the worker exits "
                 "(Ray reports a SYSTEM_ERROR)",
        verified=ALL_VERIFIED, probe=_probe_exception_queue),
    PrivateAPI(
        dependency="ray", name="ray.train.v2._internal.util.construct_user_exception_with_traceback",
        used_for="wrapping the HangError as Ray wraps a training function's error; as above",
        verified=ALL_VERIFIED, probe=_probe_user_exception),
    PrivateAPI(
        dependency="ray", name="ray.train.v2._internal.exceptions.UserExceptionWithTraceback._base_exc",
        used_for="robustdist.ray.fail_fast() reads a worker's own exception in Ray Train's controller; without it "
                 "it reads robustdist's exception name in Ray's traceback text",
        verified=ALL_VERIFIED, probe=_probe_worker_error),
    PrivateAPI(
        dependency="ray",
        name="ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED, "
             "timeout_s=...) (public, alpha)",
        used_for="report() waits until the controller registered a checkpoint; without it the wait is skipped "
                 "(one log line) and resume takes robustdist's own copy",
        verified="Ray 2.60.0 (absent in 2.52.1: takes no arguments; absent in 2.55.1: has no timeout_s; both "
                 "degrade: not called, since it could wait forever)",
        probe=_reported_checkpoints_waiter, since="2.60.0",
        public="this is the public (alpha) API; listed because its signature is not yet stable"),
)
