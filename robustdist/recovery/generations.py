"""One in-process recovery generation's fault watch, from the moment its group exists (:mod:`.loop`).

A generation after the first is built by ``harden`` again: a rendezvous, a new group, then the parts that talk over
it (DDP's constructor, the checkpointer's and the in-memory tier's groups and arrival checks). A rank whose build
raises there must not leave the others waiting for it until a timeout, or exiting with a broken collective that
names nothing. So ``harden`` tells this module when the generation's group exists (:func:`group_made`: the
generation's :class:`~robustdist.recovery.faults.FaultWatch` starts then, not after the build), and when its build
failed (:func:`failed`, before it destroys the group): the rank declares the fault in the generation's store, says
it escalates, and shuts its group's connections down, so every other rank gets out of what it is in (a gloo
collective with this rank ends with the connections; robustdist's own store waits through the watch), and names
the failure (:class:`~robustdist.RecoveryError`). A rank whose build failed because another rank's did reads that
fault instead of declaring its own (:func:`tell` does the telling, bounded; the loop calls it too when the
script's own ``make()`` raises after ``harden`` returned).

Not covered (docs/status.md): the generation being built is process-global (a ``harden`` on another thread during
a build would act on it); a rank that fails before the generation's store exists (the others learn of it in the
rendezvous, after ``distributed.init_timeout``, or when its process exits); and a rank inside torch's own store
waits (a new group's creation), which end with the group's timeout.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from robustdist.recovery import stuck as stuck_mod
from robustdist.recovery.faults import FaultWatch, declare_fault, decide, read_fault
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.deadline import bounded
from robustdist.runtime.group_sockets import GroupSockets
from robustdist.runtime.job_store import connector
from robustdist.runtime.log import get_logger
from robustdist.runtime.store_barrier import wait_for

__all__ = ["AWAIT_DECISIONS_S", "Generation", "await_decisions", "building", "decide_escalate", "failed",
           "group_made", "looks_like_transport", "tell"]

log = get_logger(__name__)


class Generation:
    """One generation's fault watch and what its fault callback gets this rank out of."""

    def __init__(self, scope: str, generation: int) -> None:
        self.scope, self.generation = scope, generation
        self.fired = threading.Event()  # a fault of this generation was seen (or declared) on this rank
        self.sockets: GroupSockets | None = None  # the group's connections, once recorded
        self.watch: FaultWatch | None = None
        self.cause: str | None = None  # another rank's fault, read when this rank's build failed because of it
        self.own = False  # this rank's build failed, and it declared the fault
        self.told = False  # tell() ran (once per generation)
        self.rank: int | None = None  # this rank in the generation's group, once the group exists
        self._store: Any = None  # the generation's store, once the watch runs
        self.trainer: tuple[int, int] | None = None  # the training thread's (ident, native id), once it trains
        self.judgement = stuck_mod.Judgement()  # whether the training thread got out of what the fault found
        self.record_to: tuple[str, int] | None = None  # the restart-loop guard's record (directory, attempt)
        self._checker: threading.Thread | None = None  # :func:`.stuck.watch`, after a shutdown
        self._lock = threading.Lock()
        self.decision_bound = 60.0  # how long the ranks wait for each other's decisions (the loop sets it)
        self.hand_over: Any = None  # the watchdog's hand-over of an error to Ray Train's controller, if any

    def on_fault(self, generation: int) -> None:
        """The watch's callback (any thread): get this rank out of the collective or store wait it is in. A wait
        nothing here can end (Ray Train's report barrier) cannot join the recovery: this rank's decision is then
        "escalate", written for it, so the other ranks escalate at once instead of waiting for its decision."""
        self.fired.set()
        if self.sockets is not None:
            self.sockets.unblock()
        stuck = _dist.interrupt_waits(f"a rank faulted in recovery generation {generation}")
        if self._store is None or self.rank is None:
            return
        if stuck is not None:
            self._escalate_stuck(generation, stuck, self._store, self.rank)
        elif self.trainer is not None and threading.get_ident() != self.trainer[0]:
            store, rank, scope = self._store, self.rank, self.scope  # the thread holds these, not the generation
            world, bound = _dist.world_size(), self.decision_bound

            left = self.judgement.left

            def escalate(why: str) -> None:
                decide_escalate(scope, generation, why, store, rank)
                if rank == 0:  # its exit takes the store down, usually: the live ranks decide first (bounded)
                    await_decisions(connector(store, bound), f"{scope}/{generation}/decision", world,
                                    time.monotonic() + min(bound, AWAIT_DECISIONS_S), stop=left)

            with self._lock:  # one check, never started after the training thread has left
                if left.is_set() or self._checker is not None:
                    return
                self._checker = threading.Thread(
                    target=stuck_mod.watch, name=f"robustdist-recovery-stuck-{generation}", daemon=True,
                    kwargs=dict(ident=self.trainer[0], native_id=self.trainer[1], judgement=self.judgement,
                                rank=rank, generation=generation, record_to=self.record_to, escalate=escalate,
                                hand_over=self.hand_over))
                self._checker.start()

    def leave(self) -> str | None:
        """The training thread is out of what the fault found it in: the stuck-thread check ends. Returns where
        the thread was judged stuck (this rank has escalated), or None; never returns once the process exits."""
        with self._lock:  # after this, no check starts
            self.judgement.left.set()
            checker = self._checker
        stuck = self.judgement.leave()
        if checker is not None and checker is not threading.current_thread():
            checker.join(15.0 if stuck else 1.0)  # an escalation's store calls are bounded (10 s each)
        return stuck

    def _escalate_stuck(self, generation: int, stuck: str, store: Any, rank: int) -> None:
        """This rank waits in ``stuck``, which nothing here ends: its decision is "escalate"."""
        log.error("rank %d: a rank faulted in in-process recovery generation %d while this rank waits in %s, which "
                  "robustdist cannot interrupt; expected every rank in a wait it can end. This rank cannot join the "
                  "recovery, so it escalates for itself, and the launcher's restart takes over. Fix: let the "
                  "launcher restart the job (torchrun --max-restarts; under Ray Train FailureConfig(max_failures=1) "
                  "or more: Ray's default, 0, ends the run); the restart resumes from the newest checkpoint.", rank,
                  generation, stuck)
        decide_escalate(self.scope, generation, f"waiting in {stuck}", store, rank)

    def watch_on(self, store: Any, timeout: float) -> FaultWatch:
        """Start the watch on ``store`` (once; a later call returns the running one)."""
        if self.watch is None:
            self._store = store
            self.rank = _dist.rank() if self.rank is None else self.rank
            self.watch = FaultWatch(connector(store, timeout), store, generation=self.generation,
                                    world_size=_dist.world_size(), rank=self.rank, on_fault=self.on_fault,
                                    scope=self.scope).start()
        return self.watch

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def decide_escalate(scope: str, generation: int, why: str, store: Any, rank: int, bound: float = 10.0) -> None:
    """Record this rank's decision "escalate (``why``)" for it, on a connection of its own, abandoned after ``bound``
    seconds (a store that stopped answering must not hold the caller)."""
    connect = connector(store, bound)
    end = time.monotonic() + bound
    _, problem, finished = bounded(
        lambda: decide(connect(), scope=scope, generation=generation, rank=rank, decision=f"escalate ({why})"), end,
        "recovery-decide", ends_by=end + 15)
    if problem is not None or not finished:  # the others give up on this rank's decision after their bound
        log.warning("rank %d: could not record its escalation in the store (%s); expected the job's store to answer "
                    "within %g s. The other ranks escalate once their decision bound has passed. Fix: check the "
                    "store's host (rank 0's node) and this node's link to it.", rank,
                    f"{type(problem).__name__}: {str(problem)[:200]}" if problem else "no answer", bound)


AWAIT_DECISIONS_S = 10.0
"""The most a stuck rank 0 waits for the other ranks' decisions before its process exits (a stopped or cut-off
rank gives none; a live one, in its own teardown, within a second or two)."""


def await_decisions(connect: Any, base: str, world: int, end: float, stop: threading.Event | None = None) -> None:
    """Wait until every rank's decision is under ``base``, ``end`` (monotonic) has passed, or ``stop`` is set: rank
    0, about to exit, usually serves the store, and its exit would take the store from the ranks still deciding."""

    def decided() -> None:
        wait_for(connect(), [f"{base}/{r}" for r in range(world)], end, poll=0.05,
                 stop=None if stop is None else stop.is_set)

    bounded(decided, end, "recovery-decided", ends_by=end + 15)


_current: list[Generation] = []  # the generation being built in this process, while the loop builds one


class building:  # noqa: N801 - used as a context manager, like contextlib's
    """``with building(g):`` around a generation's build: :func:`group_made` and :func:`failed` act on ``g``."""

    def __init__(self, generation: Generation | None) -> None:
        self._g = generation

    def __enter__(self) -> Generation | None:
        _current[:] = [self._g] if self._g is not None else []
        return self._g

    def __exit__(self, *exc: object) -> None:
        _current.clear()


def group_made(timeout: float) -> None:
    """``harden``, right after it made the group: the generation being built starts its watch (no-op otherwise)."""
    if not _current or (store := _dist.default_store()) is None or _dist.world_size() < 2:
        return
    g = _current[0]
    g.rank = _dist.rank()  # the group is destroyed before a failed build's error is named: keep the rank now
    try:
        g.watch_on(store, timeout)
    except Exception as e:  # no watch: a failure of this build is then learnt from the connections' end only
        log.warning("rank %d: could not start the fault watch of in-process recovery generation %d (%s: %s); "
                    "expected one for every generation. A failed build on another rank now reaches this rank only "
                    "when its connections end. Fix: check that the job's c10d store is reachable from this node.",
                    g.rank, g.generation, type(e).__name__, str(e)[:300])


def failed(error: BaseException, sockets: GroupSockets | None) -> None:
    """``harden``, when its build raised, before it destroys the group: tell the other ranks (no-op when no
    generation is being built, or no group was made). Never raises; bounded."""
    if _current:
        tell(_current[0], error, sockets)


_TRANSPORT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "was interrupted while this "
              "rank waited", "stopped answering", "Socket Timeout", "timed out")


def looks_like_transport(error: BaseException) -> bool:
    """A lost connection or an interrupted wait: more likely another rank's failure seen from here than a cause."""
    text = str(error)
    return any(marker in text for marker in _TRANSPORT)


def tell(g: Generation, error: BaseException, sockets: GroupSockets | None, *, bound: float = 10.0) -> None:
    """Generation ``g``'s build failed on this rank (the group still up): unless another rank's fault explains it,
    declare it; say this rank escalates; shut the group's connections, so the others' collectives with this rank end
    now. The store calls run on connections of their own, abandoned ``bound`` seconds after the start (a store host
    that stopped answering must not keep a failing rank from exiting). Rank 0, whose process usually serves the
    store, then waits (within the same bound) for every rank's decision before going on to exit. Never raises."""
    if (store := _dist.default_store()) is None or _dist.world_size() < 2 or g.told:
        return
    g.told = True
    rank, world = _dist.rank(), _dist.world_size()
    g.rank = rank
    connect = connector(store, bound)
    what = f"building in-process recovery generation {g.generation} failed: {type(error).__name__}: " \
           f"{str(error).strip()[:1500]}"
    transport = looks_like_transport(error)

    def declare() -> None:
        client = connect()
        fault = read_fault(client, generation=g.generation, world_size=world, scope=g.scope)
        deadline = time.monotonic() + (1.0 if transport else 0.0)  # a lost connection: give the cause a moment
        while (fault is None or not fault.others(rank)) and not g.fired.is_set() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            fault = read_fault(client, generation=g.generation, world_size=world, scope=g.scope)
        if g.fired.is_set() or (fault is not None and fault.others(rank)):
            g.cause = fault.describe() if fault is not None and fault.why else (
                "the job's store was lost" if g.watch is not None and g.watch.lost
                else f"generation {g.generation}: no reason recorded")
        else:
            declare_fault(client, generation=g.generation, rank=rank, world_size=world, scope=g.scope,
                          what=what + (" (a lost connection or an interrupted wait: perhaps not the cause, but no "
                                       "other rank declared one)" if transport else ""))
            g.own = True
        client.set(f"{base}/{rank}", "escalate")  # the others need not wait for this rank's decision

    base = f"{g.scope}/{g.generation}/decision"
    end = time.monotonic() + bound
    _, problem, finished = bounded(declare, end, "recovery-tell", ends_by=end + 15)
    if problem is not None or not finished:
        log.warning("rank %d: could not tell the other ranks that building in-process recovery generation %d "
                    "failed (%s); expected the job's store to answer within %g s. They learn of it when this rank's "
                    "connections end. Fix: check the store's host (rank 0's node) and this node's link to it.",
                    rank, g.generation, f"{type(problem).__name__}: {str(problem)[:200]}" if problem else
                    "no answer", bound)
    g.fired.set()
    if sockets is not None:  # the others' collectives with this rank end now, not at the group's timeout
        sockets.exclude(*_store_ports(store))
        sockets.unblock()  # the group's connections only: the store's stay, the others read the fault in it
    if rank == 0 and finished and problem is None:  # its exit may take the store down: the others decide first
        await_decisions(connect, base, world, end)
    g.close()


def _store_ports(store: Any) -> list[int]:
    """The job store's port and the launcher's master port: connections to them are the store's, never cut."""
    port = getattr(_torch_compat.innermost_store(store), "port", None)
    return [int(p) for p in (port, os.environ.get("MASTER_PORT")) if p and str(p).isdigit()]
