"""``fit_async(trainer)``: a Ray Train fit that does not block the caller, and can really be cancelled.

``TorchTrainer.fit()`` blocks until the run ends and Ray has no ``trainer.run_async()``. ``fit_async`` returns
at once with a :class:`FitFuture` (a :class:`concurrent.futures.Future`):

* ``future.result(timeout)`` is the ``ray.train.Result`` that ``trainer.fit()`` returns; when the fit raises
  (e.g. ``ray.train.TrainingFailedError`` once ``FailureConfig(max_failures)`` is used up) the future holds that
  exception, unwrapped from Ray's ``RayTaskError`` (the remote traceback is attached as a note);
* ``future.running()`` is True until the fit ends; the caller keeps working meanwhile (``add_done_callback``,
  ``concurrent.futures.wait`` and ``as_completed`` work as usual);
* ``future.cancel()`` stops a *running* fit, unlike a standard ``Future`` (whose running calls cannot be
  cancelled): it tears down the Train controller and the worker actors, returns the resources the run held
  (CPUs, GPUs, its placement groups), then marks the future cancelled and returns True. It returns False only
  when the fit had already finished; calling it again returns True. It blocks until the resources are back or
  ``release_timeout`` passes (then a warning names what is still held).

How it works. ``trainer.fit()`` runs inside a small runner actor (``num_cpus=0``, pinned to the caller's node,
as Ray Train pins its controller to the driver's node), created and so *owned* by the caller; a daemon thread
in the caller waits for its result. The runner creates the Train controller actor, which creates the worker
actors, a detached ``PlacementGroupCleaner`` actor and the workers' placement group. ``cancel()`` then:

1. asks the controller to abort, as Ray Train's own Ctrl-C handler does: it stops its cleaner, kills the
   workers, removes their placement group and exits (bounded: 10 s; skipped for a controller still waiting for
   its placement group to be scheduled, e.g. a fit queued behind another: it cannot answer);
2. kills the runner (``ray.kill``): Ray's ownership fate-sharing kills the controller and, with it, the workers;
3. sweeps: fate-sharing does *not* free the placement group (on Ray 2.60 a placement group made by an actor
   lives until that actor *and its job* are gone, and the job is the caller's, still running), and Ray Train's
   cleaner, meant for that case, watches the controller through the State API, which needs the dashboard
   (``include_dashboard=False`` leaves it polling forever and the CPUs held). So ``fit_async`` reads the GCS
   actor and placement-group tables, follows ownership down from the runner (runner -> controller -> workers),
   removes every non-detached placement group those actors created once its creator is dead, and waits until
   every non-detached actor of the run is dead and those placement groups are removed. Detached actors or
   placement groups made on purpose (by the user's code, or Ray's shared services) are left alone; a cleaner
   the abort could not stop is named in a warning (it holds no CPUs or GPUs).

The runner is killed and the sweep runs after a fit that finished or failed too, so no thread or actor of the
run outlives the future.

Internals used, since Ray has no public API that names an actor's owner or a placement group's creator, nor a handle to
an actor this process did not create: the GCS tables, an actor handle's id and the controller's ``abort`` method, all
through :mod:`robustdist.runtime._ray_compat` and :mod:`~robustdist.runtime._ray_train_compat` (which list the versions
each was verified on), and, in the runner, the controller's handle found among the process's objects (``gc``). Where the
installed Ray lacks one, the abort or the sweep is skipped with one warning and ``cancel()`` still kills the runner,
controller and workers.

What it asks of the trainer: it is serialized (Ray's cloudpickle) to the runner, so everything it references
must be picklable, and the train function must be defined in ``__main__`` (pickled by value) or importable by
the Ray workers (an installed package, the job's ``working_dir``, or a module registered with
``ray.cloudpickle.register_pickle_by_value``). ``RAY_TRAIN_*`` and ``TUNE_*`` environment variables set in the
caller are passed on to the runner, where Ray Train reads them. Any object with a ``fit()`` method works
(a ``ray.tune.Tuner`` too). ``ray.init()`` must have run first.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
from typing import Any, Protocol

from robustdist.runtime import _ray_compat, _ray_train_compat
from robustdist.runtime._ray_compat import ActorRow
from robustdist.runtime.errors import ConfigError, RobustDistError
from robustdist.runtime.log import get_logger

__all__ = ["FitFuture", "fit_async"]

log = get_logger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_RELEASE_TIMEOUT_S = 30.0
_ENV_PREFIXES = ("RAY_TRAIN_", "TUNE_")
_ENV_NAMES = ("RAY_CHDIR_TO_TRIAL_DIR",)
_ABORT_TIMEOUT_S = 10.0


class Fittable(Protocol):
    def fit(self) -> Any: ...


class _FitRunner:
    """The Ray actor that calls ``trainer.fit()``; threaded (``max_concurrency=2``) so ``abort`` runs beside it."""

    def fit(self, trainer: Fittable) -> Any:
        return trainer.fit()

    def abort(self, controller_ids: list[bytes], timeout: float) -> int:
        """Ask the Train controllers this runner started to abort, as Ray Train's own Ctrl-C handler does:
        the controller stops its placement-group cleaner, kills its workers, removes their placement group and
        exits. Their handles are local variables of the running ``fit()``, found among this process's objects.
        Returns how many controllers finished aborting within ``timeout``."""
        import gc

        import ray
        from ray.actor import ActorHandle

        wanted = set(controller_ids)
        handles: dict[bytes, Any] = {}
        for o in gc.get_objects():
            if isinstance(o, ActorHandle) and (found := _ray_compat.actor_id(o)) in wanted:
                handles[found] = o
        refs = [h.abort.remote() for h in handles.values()]
        if not refs:
            return 0
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in done:  # read, so that Ray does not print the controller's exit as an unhandled error
            try:
                ray.get(ref)
            except Exception:  # the controller exits by design: its abort call ends in ActorDiedError
                pass
        return len(done)


@functools.cache
def _runner_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=2)(_FitRunner)


def _propagated_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


def _unwrap(error: BaseException) -> BaseException:
    """The exception ``trainer.fit()`` raised, not Ray's ``RayTaskError`` wrapper around it."""
    from ray.exceptions import RayTaskError

    cause = getattr(error, "cause", None)
    if isinstance(error, RayTaskError) and isinstance(cause, BaseException):
        remote = getattr(error, "traceback_str", "")
        if remote and hasattr(cause, "add_note"):  # Python >= 3.11
            cause.add_note(f"raised in the robustdist fit_async runner actor:\n{remote}")
        return cause
    return error


# --- the sweep: what the run still holds, from the GCS tables (Ray internals, see the module docstring) ------


def _run_actors(actors: list[ActorRow], runner_id: bytes) -> list[ActorRow]:
    """The runner and every actor below it in the ownership tree (owner's worker id -> actor's worker id)."""
    owned: dict[bytes, list[ActorRow]] = {}
    for actor in actors:
        owned.setdefault(actor.owner_worker_id, []).append(actor)
    tree = [a for a in actors if a.actor_id == runner_id]
    seen = {runner_id}
    i = 0
    while i < len(tree):
        worker_id = tree[i].worker_id
        i += 1
        for child in owned.get(worker_id, []) if worker_id else []:
            if child.actor_id not in seen:
                seen.add(child.actor_id)
                tree.append(child)
    return tree


def _controllers(runner_id: bytes, job_hex: str) -> list[bytes]:
    """Ids of the live Train controllers the runner created (its direct children) that can answer an abort:
    not those blocked waiting for their workers' placement group to be scheduled."""
    actors, pgs = _ray_compat.cluster_tables(job_hex)
    runner = next((a for a in actors if a.actor_id == runner_id), None)
    if runner is None or not runner.worker_id:
        return []
    waiting = {pg.creator_actor_id for pg in pgs if pg.state in ("PENDING", "RESCHEDULING")}
    return [a.actor_id for a in actors if a.owner_worker_id == runner.worker_id
            and a.class_name == _ray_train_compat.TRAIN_CONTROLLER_CLASS and a.state == "ALIVE"
            and a.actor_id not in waiting]


def _sweep(runner_id: bytes, job_hex: str) -> tuple[list[str], list[str]]:
    """Remove the placement groups the dead run left behind; returns (what the run still holds, Ray Train
    placement-group cleaners of the run still running), each described for a log message."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    actors, pgs = _ray_compat.cluster_tables(job_hex)
    tree = {a.actor_id: a for a in _run_actors(actors, runner_id)}
    held: list[str] = []
    cleaners: list[str] = []
    for actor in tree.values():
        if actor.state == "DEAD":
            continue
        described = f"actor {actor.class_name} {actor.actor_id.hex()} (pid {actor.pid}, {actor.state})"
        if not actor.is_detached:
            held.append(described)
        elif actor.class_name == _ray_train_compat.PG_CLEANER_CLASS:
            cleaners.append(described)
        # any other detached actor was made detached on purpose (by the user's code or Ray's shared services)
    for pg in pgs:
        creator = tree.get(pg.creator_actor_id)
        if creator is None or pg.is_detached or pg.state == "REMOVED":
            continue
        if creator.state == "DEAD":  # nobody will use or remove it now
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.group_id)))
        held.append(f"placement group {pg.group_id.hex()} {list(pg.bundles)} (created by {creator.class_name}, "
                    f"{pg.state})")
    return held, cleaners


def _release(runner_id: bytes, job_hex: str, timeout: float, *,
             cleaner_grace: float = 0.0) -> tuple[list[str], list[str]]:
    """Sweep until nothing of the run is held or ``timeout`` passes; returns what :func:`_sweep` last saw.
    ``cleaner_grace``: how long to also wait for a stopped placement-group cleaner to exit."""
    deadline = time.monotonic() + timeout
    grace = time.monotonic() + min(timeout, cleaner_grace)
    while True:
        try:
            held, cleaners = _sweep(runner_id, job_hex)
        except Exception as e:  # a Ray version whose internals differ: the kill has still happened
            log.warning(f"fit_async could not read Ray's actor and placement-group tables ({type(e).__name__}: "
                        f"{e}); the fit's runner, controller and workers were killed, but its placement group may "
                        "still hold resources. Check ray.util.placement_group_table() and remove it.")
            return [], []
        now = time.monotonic()
        if now >= deadline or not (held or cleaners and now < grace):
            return held, cleaners
        time.sleep(0.2)


# --- the future ---------------------------------------------------------------------------------------------


class FitFuture(concurrent.futures.Future[Any]):
    """The pending outcome of :func:`fit_async`; unlike a standard ``Future``, ``cancel()`` stops a running fit.

    ``result()`` is the ``ray.train.Result``; ``exception()`` what ``fit()`` raised; ``running()`` is True
    until the fit ends (the underlying state stays "pending" so that ``cancel()`` can act on it).
    """

    def __init__(self, runner: Any, ref: Any, *, job_hex: str, poll_interval: float, release_timeout: float,
                 label: str):
        super().__init__()
        self._runner = runner
        self._ref = ref
        self._runner_id = _ray_compat.actor_id(runner)  # None: this Ray's handles changed, no abort or sweep
        self._job_hex = job_hex
        self._poll_interval = poll_interval
        self._release_timeout = release_timeout
        self._label = label
        self._stop = threading.Event()
        self._state_lock = threading.Lock()  # hands the outcome over: the watcher finishes, or cancel() does
        self._cancel_lock = threading.Lock()  # one cancel() at a time
        self._cancelling = False
        self._finishing = False
        self._watcher = threading.Thread(target=self._watch, name=f"robustdist-fit-{label}", daemon=True)

    def _start(self) -> None:
        self._watcher.start()

    def running(self) -> bool:
        return not self.done()

    def cancel(self) -> bool:
        """Stop the fit (kill the runner, controller and workers; free the placement group) and cancel the future.

        Blocks until the run's resources are released or ``release_timeout`` passes. True when the future ends
        cancelled (also on a second call), False when the fit had already finished.
        """
        with self._cancel_lock:
            with self._state_lock:
                if not self._finishing and not self.done():
                    self._cancelling = True
            if not self._cancelling:
                self._join()  # the watcher is delivering the outcome
                return self.cancelled()
            if not self.cancelled():
                self._stop.set()
                log.info(f"fit_async {self._label}: cancelling; stopping the runner, controller and workers")
                try:
                    self._teardown(abort=True)
                    self._discard_outcome()
                finally:
                    super().cancel()  # pending -> cancelled, callbacks run
                    self.set_running_or_notify_cancel()  # wakes concurrent.futures.wait() and as_completed()
            self._join()
            return True

    def _discard_outcome(self) -> None:
        """Read the killed fit's error, so that Ray does not print it as an unhandled error later."""
        import ray

        try:
            if ray.is_initialized():
                ray.get(self._ref, timeout=2.0)
        except Exception:  # the ActorDiedError expected here, or a timeout: either way nothing to report
            pass

    def _join(self) -> None:
        if self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self._release_timeout + _ABORT_TIMEOUT_S + self._poll_interval + 5.0)

    def _teardown(self, *, abort: bool) -> None:
        """Stop the run (``abort``: first through Ray Train's own abort) and wait, bounded, for its resources."""
        import ray

        if not ray.is_initialized():  # ray.shutdown() ended the session, and everything of the run with it
            return
        start = time.monotonic()
        aborted = 0
        if abort and self._runner_id is not None and _ray_train_compat.controller_abort_supported():
            try:  # graceful: the controller stops its cleaner, kills its workers, removes their placement group
                ids = _controllers(self._runner_id, self._job_hex)
                if ids:
                    limit = min(_ABORT_TIMEOUT_S, self._release_timeout)
                    aborted = ray.get(self._runner.abort.remote(ids, limit), timeout=limit + 5.0)
            except Exception as e:  # the hard path below still stops everything
                log.warning(f"fit_async {self._label}: asking the Train controller to abort failed ({e!r}); "
                            "killing the run instead")
        try:
            ray.kill(self._runner, no_restart=True)  # fate-sharing: the controller and its workers die with it
        except Exception as e:  # already gone, or Ray is shutting down
            log.debug(f"fit_async {self._label}: killing the runner: {e!r}")
        if self._runner_id is None:  # said once by _ray_compat.actor_id: nothing to follow the run's actors from
            return
        held, cleaners = _release(self._runner_id, self._job_hex,
                                  max(0.0, start + self._release_timeout - time.monotonic()),
                                  cleaner_grace=5.0 if aborted else 0.0)  # a stopped cleaner takes a moment to exit
        if held:
            log.warning(f"fit_async {self._label}: after {self._release_timeout:.0f} s the run still holds "
                        f"{'; '.join(held)}; expected everything released. Ray may still be freeing them; if they "
                        "stay, kill the actors and remove the placement groups (ray.util.remove_placement_group).")
        if cleaners:
            log.warning(f"fit_async {self._label}: Ray Train's detached {'; '.join(cleaners)} outlived the run "
                        "(its controller could not abort, so nothing stopped it); it holds no CPUs or GPUs and "
                        "exits once Ray's State API (the dashboard) is reachable, or when the cluster stops.")
        if not held:
            log.debug(f"fit_async {self._label}: resources released in {time.monotonic() - start:.1f} s")

    def _watch(self) -> None:
        import ray

        try:
            while not self._stop.is_set():
                if not ray.is_initialized():  # checked first: ray.wait() would start a new local cluster
                    raise SystemExit
                ready, _ = ray.wait([self._ref], timeout=self._poll_interval)
                if ready:
                    break
            if self._stop.is_set():
                return
            try:
                outcome: tuple[bool, BaseException | Any] = (True, ray.get(self._ref))
            except Exception as e:
                outcome = (False, _unwrap(e))
        except SystemExit:  # what ray.wait raises once ray.shutdown() ran
            outcome = (False, RobustDistError(
                f"fit_async {self._label}: Ray was shut down (ray.shutdown() or the cluster stopped) while the fit "
                "ran; expected the Ray session to outlive the fit. Fix: wait for the future, or cancel() it, before "
                "ray.shutdown()."))
        except Exception as e:  # ray.wait itself failed
            outcome = (False, e)
        with self._state_lock:
            if self._cancelling:
                return
            self._finishing = True
        try:
            self._teardown(abort=False)
        except Exception as e:  # never leave the future unresolved
            log.warning(f"fit_async {self._label}: cleaning up after the fit failed: {e!r}")
        ok, value = outcome
        if ok:
            log.info(f"fit_async {self._label}: the fit finished")
            self.set_result(value)
        else:
            log.info(f"fit_async {self._label}: the fit failed: {type(value).__name__}: {value}")
            self.set_exception(value)


def fit_async(trainer: Fittable, *, poll_interval: float = DEFAULT_POLL_INTERVAL_S,
              release_timeout: float = DEFAULT_RELEASE_TIMEOUT_S) -> FitFuture:
    """Start ``trainer.fit()`` without blocking; returns a :class:`FitFuture` at once.

    Args:
        trainer: a Ray Train trainer (e.g. ``ray.train.torch.TorchTrainer``) or anything with ``fit()``
            (a ``ray.tune.Tuner``). It is cloudpickled to a runner actor: its train function must be defined
            in ``__main__`` or importable by the Ray workers (see the module docstring).
        poll_interval: seconds between the caller-side thread's checks for the fit's outcome or a cancel.
        release_timeout: how long ``cancel()`` (and the end of a fit) waits for the run's actors and placement
            groups to be released before logging a warning naming what is still held.

    Raises:
        ConfigError: Ray is not initialized in this process, an argument is invalid, or the trainer cannot be
            serialized to the runner actor.
    """
    if not callable(getattr(trainer, "fit", None)):
        raise ConfigError(f"fit_async() got a {type(trainer).__name__}, which has no fit() method; expected a Ray "
                          "Train trainer (e.g. ray.train.torch.TorchTrainer) or a ray.tune.Tuner. Fix: pass the "
                          "trainer itself, not its result or its config.")
    for name, value, default in (("poll_interval", poll_interval, DEFAULT_POLL_INTERVAL_S),
                                 ("release_timeout", release_timeout, DEFAULT_RELEASE_TIMEOUT_S)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"fit_async({name}={value!r}); expected a number of seconds > 0. Fix: pass e.g. "
                              f"{name}={default}.")
    import ray

    if not ray.is_initialized():
        raise ConfigError("fit_async() found Ray not initialized in this process (ray.is_initialized() is False); "
                          "expected a connected Ray session, since the fit runs in a Ray actor owned by the caller. "
                          "Fix: call ray.init() (or ray.init(address=...) to join a cluster) before fit_async().")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}
    env = _propagated_env()
    if env:
        options["runtime_env"] = {"env_vars": env}
    runner = _runner_class().options(**options).remote()
    label = (_ray_compat.actor_id(runner) or os.urandom(4)).hex()[:8]
    try:
        ref = runner.fit.remote(trainer)
    except Exception as e:
        ray.kill(runner, no_restart=True)
        raise ConfigError(f"fit_async() could not serialize the {type(trainer).__name__} for its runner actor "
                          f"({type(e).__name__}: {e}); expected a trainer Ray's cloudpickle can send. Fix: define "
                          "the train function at module level in __main__ or in a module the Ray workers can import "
                          "(or ray.cloudpickle.register_pickle_by_value(module)), and keep unpicklable objects (locks, "
                          "open files, sockets) out of it and its config.") from e
    future = FitFuture(runner, ref, job_hex=ray.get_runtime_context().get_job_id(), label=label,
                       poll_interval=float(poll_interval), release_timeout=float(release_timeout))
    future._start()
    log.info(f"fit_async {label}: started {type(trainer).__name__}.fit() in a runner actor")
    return future
