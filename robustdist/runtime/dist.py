"""The distributed runtime every robustdist module stands on (floor 1: it imports only torch, ``errors`` and
``log``; nothing here imports upward).

It owns the few questions every mechanism asks of ``torch.distributed``:

* :func:`is_up`, :func:`rank`, :func:`world_size`, :func:`is_multi`: is a default group up, who am I, how
  many of us (0 and 1 without a group, so single-process code needs no special case);
* :func:`error_rank`: the rank that error messages name, or None without a group;
* :func:`backend_kind` and :func:`collective_device`: "nccl"/"gloo" (a mixed ``cpu:gloo,cuda:nccl`` backend
  counts as nccl) and the device its collectives take tensors on;
* :func:`default_store`: the default group's c10d store, or None;
* :class:`Collectives`: "run this collective with a bound, and name the absent ranks": an arrival check
  through the store, then named wrappers of ``broadcast_object_list``/``all_gather_object`` that turn a
  failure into the caller's error class with what failed and after how long.

The arrival check (``Collectives.arrive(op)``): each rank sets ``robustdist/<scope>/<token>/<seq>/<op>/<rank>``
in the store and waits, at most ``arrival_timeout`` seconds, for every rank's key of the same call. A rank
that does not arrive in time is named (with the call it is in instead, if any) on every rank that did, with
the rule ("save() is collective: call it on every rank"). A rank that arrives after the others gave up sees
their ``abandoned`` mark and raises too, instead of entering a collective alone. After such an error, or a
failed collective, the ranks' call sequences may no longer match, so the object refuses further calls.
Without a c10d store (a group made from a custom store torch does not expose) the arrival check is skipped
and only the collectives' own timeout bounds the wait.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from robustdist.runtime import store_barrier
from robustdist.runtime.errors import RobustDistError, ranks_phrase

__all__ = ["Collectives", "backend_kind", "collective_device", "default_store", "destroy_group", "error_rank",
           "gather_objects", "interrupt_waits", "interrupted", "interrupted_at", "is_multi", "is_up", "rank",
           "resume_waits", "uncuttable", "world_size"]

T = TypeVar("T")
log = logging.getLogger(__name__)  # robustdist.runtime.log stands on this module: plain logging here


def is_up() -> bool:
    """Whether the default process group exists in this process."""
    return bool(dist.is_available() and dist.is_initialized())


def destroy_group(group: Any, what: str) -> None:
    """Destroy a subgroup robustdist made (a local call in torch, no collective); nothing when ``group`` is None or
    the default group is gone (torch tore every group down with it). A teardown error is logged, never raised: it
    is called while closing, where it would hide the error being handled."""
    if group is not None and is_up():
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - already destroyed, or a backend failing its shutdown
            log.debug("%s not destroyed: %s: %s", what, type(e).__name__, e)


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the default group); 0 without a group."""
    return dist.get_rank(group) if is_up() else 0


def world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the default group); 1 without a group."""
    return dist.get_world_size(group) if is_up() else 1


def is_multi(group: Any = None) -> bool:
    """A group is up and has more than one rank."""
    return is_up() and dist.get_world_size(group) > 1


def gather_objects(obj: T, group: Any = None) -> list[T]:
    """Every rank's ``obj`` in ``group``, in rank order: one ``all_gather_object``, called by every rank of the
    group. Every rank then holds the same list, so a check of it reaches the same verdict everywhere. Bounded only
    by the group's timeout: :meth:`Collectives.all_gather` adds the arrival check and names what failed. Raises
    what torch raises where the group is gone: the caller decides whether there is one (:func:`is_multi`)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def error_rank() -> int | None:
    """The rank error messages name: this process's rank, or None without a group."""
    return dist.get_rank() if is_up() else None


def backend_kind(group: Any = None) -> str | None:
    """"nccl" when the group's backend includes NCCL (also ``cpu:gloo,cuda:nccl``), "gloo" for gloo, the raw name
    otherwise, None without a group."""
    if not is_up():
        return None
    found = str(dist.get_backend(group))
    return "nccl" if "nccl" in found else "gloo" if "gloo" in found else found


def collective_device(backend: str | None) -> torch.device:
    """The device the collectives of ``backend`` (a :func:`backend_kind`) take tensors on."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_store() -> Any:
    """The default group's c10d store, or None. Private torch API, used only to name ranks that did not
    arrive, so its absence only makes those messages less specific."""
    if not is_up():
        return None
    from robustdist.runtime import _torch_compat

    return _torch_compat.default_store()


_interrupt: list[Any] = []  # (why, when) the waits below were interrupted (in-process recovery), or empty
_uncuttable: list[str] = []  # what this process waits in that no interrupt ends (ray.train.report's barrier)
_interrupt_lock = threading.Lock()


def interrupt_waits(reason: str) -> str | None:
    """Make every :meth:`Collectives.arrive` wait in this process (now, or until :func:`resume_waits`) fail at
    once with ``reason``: how a fault on another rank gets this rank out of robustdist's own store waits
    (in-process recovery; a gloo collective needs :mod:`robustdist.runtime.group_sockets` instead). Safe from
    any thread. Returns what the process is waiting in that this cannot end (:func:`uncuttable`), or None: read
    with the interrupt, so a wait is either refused at its start or named here, never neither."""
    with _interrupt_lock:
        when = _interrupt[1] if _interrupt else time.monotonic()  # the first interrupt of this generation
        _interrupt[:] = [reason, when]
        return _uncuttable[-1] if _uncuttable else None


@contextlib.contextmanager
def uncuttable(what: str, error: Callable[[str], BaseException]) -> Iterator[None]:
    """Around a wait that neither :func:`interrupt_waits` nor a group's connections shutting down can end (Ray
    Train's report, a barrier of Ray's actors): not started once waits are interrupted (raises ``error(message)``:
    a recovery is under way), and while it runs, :func:`interrupt_waits` names ``what`` to the caller, who must
    then not wait for this rank (in-process recovery lets this rank escalate)."""
    with _interrupt_lock:
        if _interrupt:
            raise error(f"{what} was not started: {_interrupt[0]}. Expected when the job recovers in place. Fix: "
                        "none; this rank joins the recovery.")
        _uncuttable.append(what)
    try:
        yield
    finally:
        with _interrupt_lock:
            _uncuttable.remove(what)


def resume_waits() -> None:
    """Let waits run again (a new generation, with new objects)."""
    with _interrupt_lock:
        _interrupt.clear()


def interrupted() -> str | None:
    """Why waits are interrupted, or None."""
    with _interrupt_lock:
        return _interrupt[0] if _interrupt else None


def interrupted_at() -> float | None:
    """When (``time.monotonic()``) the waits were first interrupted since they last resumed, or None."""
    with _interrupt_lock:
        return _interrupt[1] if _interrupt else None


class Collectives:
    """Bounded, named collectives over one group (see the module docstring).

    Args:
        group: the process group the collectives run on (None: the default group).
        rank, world_size: this rank and the group's size.
        timeout: the group's collective timeout in seconds (for messages: the group enforces it).
        arrival_timeout: seconds every rank has to reach the same call once another rank has.
        error: the error class raised (a :class:`~robustdist.runtime.errors.RobustDistError` subclass).
        scope: the store key prefix (``robustdist/<scope>/...``).
        noun: what the collectives belong to, in messages ("checkpoint").
        owner: what the caller builds these for, in the "fell out of step" message ("checkpointer").
        ops: the collective calls ranks can be in (to say "rank 1 is in load() instead").
        knob: the config field that raises ``arrival_timeout``.
        token: the store-key token, given by a caller that makes it the same on every rank (then the constructor
            runs no collective, so a call made by one rank alone fails in :meth:`arrive`, named); None: a random
            token broadcast from rank 0.
    """

    def __init__(self, group: Any, rank: int, world_size: int, *, timeout: float, arrival_timeout: float,
                 error: type[RobustDistError] = RobustDistError, scope: str = "collective", noun: str = "group",
                 owner: str = "object", ops: Sequence[str] = (), knob: str = "the arrival timeout",
                 token: str | None = None):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.timeout, self.arrival_timeout = timeout, arrival_timeout
        self.error, self.scope, self.ops, self.knob = error, scope, tuple(ops), knob
        self.noun, self.owner = noun, owner
        self.broken: str | None = None
        self._seq = 0
        self._last_op = ""
        self._store = default_store() if world_size > 1 else None
        if token is not None:  # the caller's: the same on every rank, and no collective before the first arrive()
            self.token = token
        else:
            self.token = uuid.uuid4().hex[:12]
            if world_size > 1:  # one token per object, the same on every rank (no stale keys from other runs)
                self.token = self.broadcast(self.token, "setup")

    def check_usable(self) -> None:
        if self.broken is not None:
            raise self.error(f"this {self.owner}'s ranks fell out of step earlier ({self.broken}); expected every "
                             "rank to make the same calls. Fix: restart the job (or create a new one on every "
                             "rank).", rank=self.rank)

    # ------------------------------------------------------------------ arrival
    def arrive(self, op: str) -> None:
        """Wait until every rank has reached ``op`` (the same call); raise naming those that have not."""
        self.check_usable()
        if self.world_size == 1 or self._store is None:
            return
        self._seq += 1
        self._last_op, op_before = op, self._last_op
        base = f"robustdist/{self.scope}/{self.token}/{self._seq}"
        try:
            self._wait_for_all(op, base)
        except RobustDistError:
            raise
        except Exception as e:  # the store went away: rank 0 (its host, usually) exited
            self._fail(f"the job's c10d store stopped answering while this rank waited in {op}() "
                       f"({type(e).__name__}: {str(e)[:200]}); the rank hosting it (rank 0, usually) probably exited",
                       op, [])
        if self.rank == 0 and self._seq > 1:  # every rank is past the previous call now: drop its keys
            previous = f"robustdist/{self.scope}/{self.token}/{self._seq - 1}"
            keys = [f"{previous}/{op_before}/{r}" for r in range(self.world_size)]
            for key in [*keys, f"{previous}/{op_before}/count"]:
                try:
                    self._store.delete_key(key)
                except Exception:  # a store without delete_key only keeps a few bytes more
                    break

    def _wait_for_all(self, op: str, base: str) -> None:
        def interrupt() -> None:
            if (reason := interrupted()) is not None:
                self.broken = f"{op}() was interrupted"
                raise self.error(f"{op}() was interrupted while this rank waited for the others: {reason}. Expected "
                                 "when the job recovers in place (the recovery makes new objects); anywhere else, "
                                 "robustdist.runtime.dist.resume_waits() was not called after a recovery.",
                                 rank=self.rank)

        try:
            store_barrier.barrier(self._store, f"{base}/{op}", self.rank, self.world_size,
                                  time.monotonic() + self.arrival_timeout, abandon_key=f"{base}/abandoned",
                                  interrupt=interrupt)
        except store_barrier.Absent as e:
            if e.when == "before":
                self._fail(f"the other ranks stopped waiting for {op}() before this rank arrived (each waits "
                           f"{self.arrival_timeout:g} s)", op, [])
            if e.when == "after":
                self._fail(f"another rank stopped waiting for {op}() just as this rank arrived", op, [])
            # this rank's own look: a rank that gave up in another call listed who was absent from that one
            missing = [r for r in range(self.world_size) if not self._store.check([f"{base}/{op}/{r}"])]
            elsewhere = [f"rank {r} is in {other}() instead" for r in missing for other in self.ops
                         if other != op and self._store.check([f"{base}/{other}/{r}"])]
            where = f" ({'; '.join(elsewhere)})" if elsewhere else ""
            self._fail(f"{ranks_phrase(missing)} did not reach {op}() within {self.arrival_timeout:g} s{where}; "
                       f"expected all {self.world_size} ranks", op, missing)

    def _fail(self, found: str, op: str, missing: list[int]) -> None:
        self.broken = found
        slow = f" if {ranks_phrase(missing)} {'is' if len(missing) == 1 else 'are'} only slow" if missing else ""
        raise self.error(
            f"{op}() is collective: call it on every rank. {found[0].upper()}{found[1:]}. Fix: call {op}() on every "
            f"rank, not under `if rank == 0:` (robustdist writes from the right ranks itself), or raise "
            f"{self.knob}{slow} (e.g. evaluating on one rank before saving).",
            rank=self.rank, ranks=missing)

    # ------------------------------------------------------------------ collectives
    def run(self, what: str, fn: Callable[[], T]) -> T:
        """Run a collective; turn its failure into ``self.error`` saying when and what failed. Not started while
        waits are interrupted (:func:`interrupt_waits`): a gloo collective started on connections an in-process
        recovery shut down waits out its whole timeout instead of failing."""
        if (reason := interrupted()) is not None:
            self.broken = f"the {what} collective was interrupted"
            raise self.error(f"the {self.noun}'s {what} collective was not started: {reason}. Expected when the job "
                             "recovers in place (the recovery makes new objects); anywhere else, "
                             "robustdist.runtime.dist.resume_waits() was not called after a recovery.", rank=self.rank)
        start = time.monotonic()
        try:
            return fn()
        except Exception as e:
            elapsed = time.monotonic() - start
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            self.broken = f"the {what} collective failed"
            raise self.error(
                f"the {self.noun}'s {what} collective failed after {elapsed:.1f} s (bound {self.timeout:g} s): "
                f"{type(e).__name__}: {first}. Expected every rank of the {self.noun}'s group in it; another rank "
                "probably died or left the call. Fix: see the other ranks' logs for their error.",
                rank=self.rank) from e

    def broadcast(self, obj: T, what: str) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        self.run(what, lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def problems(self, problem: str | None, what: str) -> dict[int, str]:
        """The agreement every stage ends with: this rank's ``problem`` (None or empty where its part went well)
        shared with every rank; returns every rank's by rank, empty when none had one. Every rank gets the same
        answer, so each raises the same named error (or none does)."""
        return {r: p for r, p in enumerate(self.all_gather(problem, what)) if p}

    def attempt(self, what: str, fn: Callable[[], object], *, limit: int = 400) -> dict[int, str]:
        """Run ``fn`` on this rank, then :meth:`problems` with what it raised (``Type: message``, cut at
        ``limit``), so that every rank learns every rank's outcome."""
        problem = None
        try:
            fn()
        except Exception as e:  # shared below, and raised, named, on every rank by the caller
            problem = f"{type(e).__name__}: {str(e)[:limit]}"
        return self.problems(problem, what)

    def all_gather(self, obj: T, what: str) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        return self.run(what, lambda: gather_objects(obj, self.group))
