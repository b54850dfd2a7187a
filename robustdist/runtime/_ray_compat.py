"""The fence around every private Ray name robustdist touches; nothing else in the package reaches past Ray's
public API (``tests/test_private_api.py`` enforces it).

Each access is listed in :data:`PRIVATE_APIS` as a :class:`~robustdist.runtime.private_api.PrivateAPI`: what it is
used for, what happens without it, the Ray versions the matrix verified it on, and a probe that resolves it on the
installed Ray (:func:`robustdist.runtime.private_api.canary`). The rest of robustdist calls the small accessors
below, each of which is also a capability check: where the installed Ray lacks the name (an older or a newer
Ray), the accessor returns None or False and logs ONE line for the process naming what is missing, what
robustdist does instead, and the fix; it never raises Ray's own error and never waits without a bound.

Ray is imported inside the functions only: importing this module imports neither ray nor torch and changes
nothing. Layer 0: it imports from ``robustdist.runtime`` only.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

from robustdist.runtime.log import get_logger
from robustdist.runtime.private_api import PrivateAPI, installed
from robustdist.runtime.ray_rows import ActorRow, GroupRow

__all__ = ["PG_CLEANER_CLASS", "PRIVATE_APIS", "TRAIN_CONTROLLER_CLASS", "ActorRow", "GroupRow", "actor_id",
           "can_wait_reported_checkpoints", "cluster_tables", "controller_abort_supported", "exception_queue",
           "train_context", "train_loop_config", "tune_trial", "user_exception", "wait_reported_checkpoints",
           "worker_error"]

log = get_logger(__name__)

TRAIN_CONTROLLER_CLASS = "TrainController"  # Ray Train V2's controller actor class
PG_CLEANER_CLASS = "PlacementGroupCleaner"  # Ray Train V2's detached placement-group watchdog actor class
_ALL_VERIFIED = "Ray 2.52.1, 2.55.1, 2.60.0"
_lock = threading.Lock()
_said: set[str] = set()


def _degrade(key: str, message: str) -> None:
    """Log ``message`` once per process for ``key``: a missing capability is said once, not on every call."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.warning("%s (Ray %s)", message, installed("ray"), all_ranks=True)


# --- actor handles ------------------------------------------------------------------------------------------


def actor_id(handle: Any) -> bytes | None:
    """The binary id of an actor handle (``ActorHandle._actor_id``, what ``ray.kill`` uses), or None where the
    handle has none. Ray's public API names an actor's id only inside the actor
    (``ray.get_runtime_context().get_actor_id()``)."""
    try:
        return bytes(handle._actor_id.binary())
    except Exception as e:  # a Ray whose handles changed
        _degrade("actor_id", f"robustdist could not read an actor handle's id ({type(e).__name__}: {e}); expected "
                 "ActorHandle._actor_id. fit_async's abort and sweep are skipped (cancel() still kills the run). "
                 "Fix: use a Ray robustdist was tested on (2.52.1 to 2.60.0; robustdist doctor)")
        return None


# --- the GCS actor and placement-group tables ----------------------------------------------------------------


def _gcs_accessor() -> Any:
    """The connected ``GlobalStateAccessor`` of this process's Ray session."""
    from ray._private.state import state

    return state._connect_and_get_accessor()


def cluster_tables(job_hex: str | None) -> tuple[list[ActorRow], list[GroupRow]]:
    """(the actors of job ``job_hex``, or of every job for None; every placement group), read from Ray's GCS
    without the dashboard. Raises (any type) where Ray's internals differ: the caller degrades."""
    import ray
    from ray.core.generated import gcs_pb2 as pb

    accessor = _gcs_accessor()
    job = ray.JobID.from_hex(job_hex) if job_hex is not None else None
    actor_state = pb.ActorTableData.ActorState.Name
    group_state = pb.PlacementGroupTableData.PlacementGroupState.Name
    actors = []
    for raw in accessor.get_actor_table(job, None):
        a = pb.ActorTableData.FromString(raw)
        actors.append(ActorRow(actor_id=a.actor_id, class_name=a.class_name, state=actor_state(a.state),
                               worker_id=a.address.worker_id, owner_worker_id=a.owner_address.worker_id,
                               pid=a.pid, is_detached=a.is_detached))
    groups = []
    for raw in accessor.get_placement_group_table():
        g = pb.PlacementGroupTableData.FromString(raw)
        groups.append(GroupRow(group_id=g.placement_group_id, creator_actor_id=g.creator_actor_id,
                               state=group_state(g.state), is_detached=g.is_detached,
                               bundles=tuple(dict(b.unit_resources) for b in g.bundles)))
    return actors, groups


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
    _degrade("controller_abort", f"Ray Train's controller cannot be asked to abort ({found}); expected "
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
    _degrade("exception_queue", f"Ray Train's worker context has {found}; expected the training thread runner's "
             "exception queue. A hang is reported by exiting the worker instead (Ray then names a SYSTEM_ERROR, "
             "not the HangError). Fix: use a Ray robustdist was tested on (2.52.1 to 2.60.0; robustdist doctor)")
    return None


def user_exception(error: BaseException) -> Any | None:
    """``error`` (raised, so it has a traceback) wrapped as Ray Train reports a training function's error
    (``construct_user_exception_with_traceback``), or None, said once, where this Ray has no such helper."""
    try:
        from ray.train.v2._internal.util import construct_user_exception_with_traceback as wrap
    except ImportError as e:
        _degrade("user_exception", f"Ray Train has no construct_user_exception_with_traceback ({e}); expected it "
                 "in ray.train.v2._internal.util. A hang is reported by exiting the worker instead. Fix: use a Ray "
                 "robustdist was tested on (2.52.1 to 2.60.0; robustdist doctor)")
        return None
    return wrap(error)


# --- Ray Tune's function-trainable session ------------------------------------------------------------------


def _get_session() -> Callable[[], Any]:
    from ray.train._internal.session import get_session

    return get_session


def tune_trial() -> tuple[str, str, bool] | None:
    """``(experiment name, trial id, function)`` of the Ray Tune trial this process runs (a function trainable;
    Ray Train V1 workers too, with ``function`` False: their session has a world rank), or None outside one. Read
    from the trial's session (``ray.train._internal.session``), which says "no trial" without a warning; where this
    Ray has no such internal, from ``ray.tune.get_context()`` (public; outside a trial it warns once and says
    None; ``function`` True)."""
    try:
        get = _get_session()
    except ImportError as e:
        _degrade("tune_session", f"Ray has no ray.train._internal.session.get_session ({e}); expected it to tell a "
                 "Tune trial apart. robustdist asks ray.tune.get_context() instead, which warns once outside a "
                 "trial. Fix: none needed")
        return _public_tune_trial()
    session = get()
    if session is None:
        return None
    experiment, trial = getattr(session, "experiment_name", None), getattr(session, "trial_id", None)
    function = getattr(session, "world_rank", None) is None
    return (str(experiment or "unnamed"), str(trial), function) if trial else None


def _public_tune_trial() -> tuple[str, str, bool] | None:
    try:
        import ray.tune

        ctx = ray.tune.get_context()
        trial, experiment = ctx.get_trial_id(), ctx.get_experiment_name()
    except Exception:  # no Tune, or a context that cannot answer: not a trial
        return None
    return (str(experiment or "unnamed"), str(trial), True) if trial else None


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
        _degrade("reported_checkpoints", "Ray Train has no get_all_reported_checkpoints(consistency_mode=COMMITTED, "
                 "timeout_s=...); robustdist reports without waiting for the controller to register each checkpoint, "
                 "so a worker that dies within a poll interval of a report resumes from Ray's previous checkpoint "
                 "(robustdist's own newer copy is still taken). Fix: none needed; Ray 2.60 waits and closes the gap")
        return False
    wait(timeout)
    return True


# --- the record: every private name above, and its probe ---------------------------------------------------


def _probe_gcs_accessor() -> object | None:
    from ray._private.state import GlobalState, state

    return getattr(GlobalState, "_connect_and_get_accessor", None) if isinstance(state, GlobalState) else None


def _probe_accessor_tables() -> object | None:
    from ray._raylet import GlobalStateAccessor

    return getattr(GlobalStateAccessor, "get_actor_table", None) and getattr(
        GlobalStateAccessor, "get_placement_group_table", None)


def _probe_gcs_pb2() -> object | None:
    from ray.core.generated import gcs_pb2 as pb

    fields = {f.name for f in pb.ActorTableData.DESCRIPTOR.fields} | {
        f.name for f in pb.PlacementGroupTableData.DESCRIPTOR.fields}
    wanted = {"actor_id", "class_name", "state", "address", "owner_address", "pid", "is_detached",
              "placement_group_id", "creator_actor_id", "bundles"}
    return pb if wanted <= fields else None


def _probe_actor_id() -> object | None:
    from ray.actor import ActorHandle

    return getattr(ActorHandle, "_actor_id", None)


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


def _probe_tune_session() -> object | None:
    import dataclasses

    from ray.train._internal.session import TrialInfo, _TrainSession, get_session

    fields = {f.name for f in dataclasses.fields(TrialInfo)}
    ok = {"experiment_name", "id"} <= fields and isinstance(getattr(_TrainSession, "trial_id", None), property) \
        and isinstance(getattr(_TrainSession, "experiment_name", None), property)
    return get_session if ok else None


def _probe_user_exception() -> object | None:
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    return construct_user_exception_with_traceback


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI(
        dependency="ray", name="ray._private.state.state._connect_and_get_accessor()",
        used_for="fit_async reads the GCS actor and placement-group tables to find the Train controller and sweep "
                 "the placement groups a cancelled run leaves; without it the abort and sweep are skipped with one "
                 "warning and cancel() still kills the run",
        verified=_ALL_VERIFIED, probe=_probe_gcs_accessor,
        public="ray.util.state.list_actors / list_placement_groups (need the dashboard; no owner or creator)"),
    PrivateAPI(
        dependency="ray", name="ray._raylet.GlobalStateAccessor.get_actor_table / get_placement_group_table",
        used_for="the raw GCS rows behind cluster_tables(); as above", verified=_ALL_VERIFIED,
        probe=_probe_accessor_tables, public="ray.util.placement_group_table() (no creator actor)"),
    PrivateAPI(
        dependency="ray", name="ray.core.generated.gcs_pb2 (ActorTableData, PlacementGroupTableData)",
        used_for="parsing the GCS rows (owner and creator ids); as above", verified=_ALL_VERIFIED,
        probe=_probe_gcs_pb2),
    PrivateAPI(
        dependency="ray", name="ray.actor.ActorHandle._actor_id",
        used_for="naming fit_async's runner and matching the Train controller's handle; without it the abort and "
                 "sweep are skipped (ray.kill(handle) still works)",
        verified=_ALL_VERIFIED, probe=_probe_actor_id,
        public="ray.get_runtime_context().get_actor_id() (inside the actor only)"),
    PrivateAPI(
        dependency="ray", name="ray.train.v2._internal.execution.controller.TrainController.abort",
        used_for="fit_async's cancel() asks the controller to abort as Ray's Ctrl-C handler does (stops its cleaner, "
                 "kills the workers, removes their placement group); without it cancel() kills and sweeps",
        verified=_ALL_VERIFIED, probe=_controller_abort),
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
        verified=_ALL_VERIFIED, probe=_get_train_context),
    PrivateAPI(
        dependency="ray", name="TrainContext.train_run_context.train_loop_config",
        used_for="the run identity's config fingerprint (Tune trials differ there); None without it",
        verified=_ALL_VERIFIED, probe=_probe_train_loop_config),
    PrivateAPI(
        dependency="ray", name="TrainContext.execution_context.training_thread_runner.get_exception_queue",
        used_for="a hang reaches the controller as the training thread's HangError; without it the worker exits "
                 "(Ray reports a SYSTEM_ERROR)",
        verified=_ALL_VERIFIED, probe=_probe_exception_queue),
    PrivateAPI(
        dependency="ray", name="ray.train.v2._internal.util.construct_user_exception_with_traceback",
        used_for="wrapping the HangError as Ray wraps a training function's error; as above",
        verified=_ALL_VERIFIED, probe=_probe_user_exception),
    PrivateAPI(
        dependency="ray", name="ray.train._internal.session.get_session() (.experiment_name, .trial_id)",
        used_for="a Tune function trainable's trial gets its own checkpoint namespace; without it robustdist asks "
                 "ray.tune.get_context() (public), which warns once outside a trial",
        verified=_ALL_VERIFIED, probe=_probe_tune_session,
        public="ray.tune.get_context().get_trial_id() (warns outside a trial)"),
    PrivateAPI(
        dependency="ray", name="ray.train.v2._internal.exceptions.UserExceptionWithTraceback._base_exc",
        used_for="robustdist.ray.fail_fast() reads a worker's own exception in Ray Train's controller; without it "
                 "it reads robustdist's exception name in Ray's traceback text",
        verified=_ALL_VERIFIED, probe=_probe_worker_error),
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
