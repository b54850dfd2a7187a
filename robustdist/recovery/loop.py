"""The in-process recovery loop (experimental): a fault on any rank, and every rank tears down and runs
the training function again from the last checkpoint, in the same process.

.. code-block:: python

    def train(h, step):                       # the loop body, from the step to start at
        while step < total_steps:
            ...
            h.save(step, optimizer=optimizer)
        return step

    h = harden(model, loader, {..., "recovery": {"in_process": True}}, optimizer=optimizer)
    h.run(train, optimizer=optimizer)         # robustdist.harden.Hardened.run -> run_hardened

    # or, building the Hardened per generation yourself:
    run_in_process(lambda: harden(model, loader, cfg, optimizer=optimizer), train, optimizer=optimizer)

Each generation: a ``Hardened`` (the first is ``h``; later ones are hardened into ``h`` again, or ``make()``:
the same bare model, loader and optimizer, a new group at a new rendezvous round, new wrappers),
``h.resume(...)`` (gradients cleared after a recovery: a fault can cut a ``backward()`` mid-way), then
``train_fn(h, step)``. When it raises on a rank, that rank declares a fault
(:mod:`robustdist.recovery.faults`); every other rank's watch gets it out of what it is in (a gloo collective:
:class:`~robustdist.runtime.group_sockets.GroupSockets`; robustdist's own store waits:
:func:`~robustdist.runtime.dist.interrupt_waits`). Every rank then says whether it recovers or escalates, and waits
(bounded) for every other rank's word: one escalating, or silent, and all escalate. Then each closes its
``Hardened`` (keeping the in-memory tier's copies), retires the old DDP modules
(:func:`~robustdist.runtime.group_teardown.retire_ddp_modules`), leaves the generation's store
(:mod:`.handover`), and starts the next generation on a fresh store. The first rank to read every decision stores
the generation's verdict, and every rank acts on it.

Escalation, never a cover-up: a fault that repeats after resuming from the same step (or inside ``resume()``)
``health.max_restarts_without_progress`` times, a fault this loop must not paper over (a configuration or version
error, the restart-loop verdict, memory exhaustion, a CUDA error, ``KeyboardInterrupt`` or ``SystemExit``), a
lost store, and a run the loop cannot unblock (any backend but gloo, FSDP, ``TORCH_GLOO_LAZY_INIT``, a group
robustdist did not create) end the run on every rank: the processes exit and the ordinary path (a restart by
the launcher, whose restart-loop guard counts launcher attempts as before) takes over. The faulting rank re-raises
its own error; a rank that did not fault raises :class:`~robustdist.RecoveryError` naming the fault (what it saw
itself, a collective the teardown cut short, is the ``__cause__``). Either is recorded for the restart-loop guard's
message, as ``with harden(...)`` records it.

The watchdog's hang verdict is a fault as well (:meth:`~robustdist.health.Watchdog.on_hang`): a rank blocked in
a collective gets out at once; a rank stuck elsewhere says nothing, and unless it comes back within the decision
bound the others escalate.

A fresh start takes an in-memory copy of step 0 (the start state), so a fault before the first checkpoint
recovers; a later generation that finds nothing to resume from raises :class:`~robustdist.RecoveryError` (a
fault like any other: a restore that raised may succeed in the next generation).

A failure while the next generation is hardened is declared by its rank once the group exists
(:mod:`.generations`); the others end at once, naming it. The closing tier hands the snapshot of its last committed
copy to the next generation's (:mod:`robustdist.checkpoint.local.held`): this rank's own state is restored from
memory, no file read. Each recovery's phases: :mod:`.timings`. In a Ray Train worker the first harden gives up
Ray's group for robustdist's own (:mod:`robustdist.ray.group`), so the same loop runs there. The error that ends
an escalating rank, and its record for the restart-loop guard: :mod:`.escalation`.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

from robustdist.recovery import declarations, escalation, handover, liveness, replacement
from robustdist.recovery.generations import Generation, building
from robustdist.recovery.faults import SCOPE, agree, clear_generation, declare_fault
from robustdist.recovery.timings import Clock, Recovery, detection
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime import group_teardown
from robustdist.runtime.errors import (ConfigError, RecoveryError, RestartLoopError, UnsupportedVersionError,
                                       drop_locals)
from robustdist.runtime.group_sockets import GroupSockets, sockets_on_port
from robustdist.runtime.job_store import connector
from robustdist.runtime.log import get_logger

__all__ = ["continue_as", "generation", "scope_of", "run_hardened", "run_in_process"]

log = get_logger(__name__)
T = TypeVar("T")

_state = {"generation": 0, "calls": 0}  # the recovery generation (0: the first group), and run_in_process calls
# made in this process: both the same on every rank (the calls are collective)
_FATAL = (ConfigError, RestartLoopError, UnsupportedVersionError, MemoryError)


def generation() -> int:
    """This process's in-process recovery generation: 0 until a recovery, then 1, 2, ... (the same on every
    rank). ``harden`` reads it: a later generation continues the run (its in-memory copies are kept)."""
    return _state["generation"]


def continue_as(calls: int, gen: int) -> None:
    """A replacement process (robustdist run, :mod:`.replacement`): its next ``h.run`` is the survivors' call
    ``calls``, from generation ``gen``."""
    _state["calls"], _state["generation"] = calls - 1, gen


def scope_of(call: int) -> str:
    """The store-key scope of this process's ``call``-th :func:`run_in_process` (or ``h.run``)."""
    return f"{SCOPE}/{call}"


def _fatal(e: BaseException) -> bool:
    if not isinstance(e, Exception) or isinstance(e, _FATAL):
        return True
    name = type(e).__name__
    return name == "OutOfMemoryError" or "CUDA error" in str(e) or "CUBLAS_STATUS" in str(e)


def run_in_process(make: Callable[[], Any], train_fn: Callable[[Any, int], T], *, optimizer: Any = None,
                   scheduler: Any = None, **extra: Any) -> T:
    """Run ``train_fn(h, step)`` with ``h = make()`` resumed, recovering from a fault on any rank in this process.

    Args:
        make: builds the ``Hardened`` (``lambda: harden(model, loader, cfg, optimizer=optimizer)``), called once
            per generation on every rank; it must reuse the same bare model, loader and optimizer.
        train_fn: the loop body; receives the ``Hardened`` and the step to start from; its return value is
            returned.
        optimizer, scheduler, extra: passed to ``h.resume``.

    Returns what ``train_fn`` returned; the last ``Hardened`` is closed. Collective: every rank calls it. In one
    process (no group) it resumes and runs ``train_fn`` once.
    """

    def build() -> tuple[Any, GroupSockets]:
        sockets = GroupSockets()
        with sockets.recording():
            h = make()
        return h, sockets

    return _calling(build, train_fn, optimizer=optimizer, scheduler=scheduler, extra=extra)


def run_hardened(h: Any, train_fn: Callable[[Any, int], T], *, optimizer: Any, scheduler: Any,
                 extra: dict[str, Any]) -> T:
    """``h.run(train_fn)`` with ``recovery.in_process``: the same loop, each generation hardened into ``h`` itself
    (the script's object; harden recorded the group's connections as it made them)."""
    hook = h.generations()
    first: list[Any] = [hook.sockets]

    def build() -> tuple[Any, GroupSockets | None]:
        if first:
            return h, first.pop()
        return h, hook.next(optimizer)

    return _calling(build, train_fn, optimizer=optimizer, scheduler=scheduler, extra=extra)


def _calling(build: Callable[[], tuple[Any, GroupSockets | None]], train_fn: Callable[[Any, int], T], *,
             optimizer: Any, scheduler: Any, extra: dict[str, Any]) -> T:
    _state["calls"] += 1  # keys of its own: a store that outlived an earlier call holds that call's keys
    try:
        return _loop(build, train_fn, optimizer=optimizer, scheduler=scheduler, extra=extra,
                     scope=scope_of(_state["calls"]))
    finally:  # a later harden() in this process is a fresh start again, and its waits run
        replacement.withdraw()  # rank 0's state in robustdist run's store: a worker dying now is not replaced
        _state["generation"] = 0
        _dist.resume_waits()


def _supported(h: Any, sockets: GroupSockets | None) -> str | None:
    """Why this generation cannot recover in place, or None."""
    if not h.init_report.created:
        return ("the process group is not robustdist's (a framework's, the script's own, or Ray Train's where it "
                "is not gloo with DDP): robustdist cannot make the next one")
    if _dist.backend_kind() != "gloo":
        return (f"the backend is {_dist.backend_kind()}: only a gloo collective can be unblocked in place (an NCCL "
                "kernel cannot be stopped by closing sockets)")
    if h.config.distributed.strategy != "ddp":
        return f"distributed.strategy is {h.config.distributed.strategy}: only DDP is rebuilt in place so far"
    if sockets is None or sockets.lazy or not len(sockets):
        return "the group's connections could not be recorded (TORCH_GLOO_LAZY_INIT?), so a collective in " \
               "progress could not be unblocked"
    return None


def _start_state(h: Any, gen: int, rank: int, extra: dict[str, Any]) -> None:
    """Nothing to resume. In generation 0 (a fresh start) the in-memory tier takes step 0 (the start state: what a
    fault before the first checkpoint recovers to). In a later generation the model and optimizer have moved since
    the start, so running again from step 0 would not be the same run: a fault (the next generation tries again, as
    a restore that raised may succeed then; repeated, it escalates like any fault that repeats)."""
    if gen == 0:
        if h.local is not None:
            h.state.save_local(h.local, 0, extra)
            h.local.wait()
        return
    raise RecoveryError(
        f"in-process recovery generation {gen} found no checkpoint to resume from (the fault came before the first "
        "complete one, and no in-memory copy of the start state is complete); the model and optimizer have changed "
        "since the start, so running the training function again from step 0 in this process would not be the same "
        "run. Expected a checkpoint of this run. The next generation tries again; if this repeats, the process "
        "exits for a restart, which starts afresh. Fix: "
        + ("the in-memory tier's copy of the start state (step 0) did not complete: see the errors before this one"
           if h.local is not None else "turn on the in-memory tier (checkpoint.local_every_n_steps): it holds the "
           "start state for in-process recovery") + ".", rank=rank)


def _still_held(port: Any, **parts: Any) -> Callable[[], list[str]]:
    """Which of a closed generation's ``parts`` are still alive (those that cannot be told count as alive), and
    whether a socket of this process is still on its store's ``port`` (the server under every wrapper, or a
    connection to it: a Python wrapper gone says nothing of them)."""
    refs: dict[str, Callable[[], Any]] = {}
    for name, part in parts.items():
        if part is not None:
            try:
                refs[name] = weakref.ref(part)
            except TypeError:
                refs[name] = lambda: True
    on_port = (lambda: sockets_on_port(port) > 0) if isinstance(port, int) and port > 0 else (lambda: False)
    return lambda: [name for name, ref in refs.items() if ref() is not None] + (
        [f"store's connections (port {port})"] if on_port() else [])


def _loop(build: Callable[[], tuple[Any, GroupSockets | None]], train_fn: Callable[[Any, int], T], *,
          optimizer: Any, scheduler: Any, extra: dict[str, Any], scope: str) -> T:
    keep: Any = None  # this generation's job store: its server, and the fault keys, outlive the group
    clock: Clock | None = None  # the recovery in progress, phase by phase (.timings)
    last_resumed: tuple[object, int] = (None, 0)  # (the step resumed from, or "resume", faults after it in a row)
    record_to: tuple[str, int] | None = None  # where the restart-loop guard's record is (the last generation's)
    bound = 60.0  # how long the ranks wait for each other's decisions after a fault (the last generation's)
    while True:
        _dist.resume_waits()
        gen = _state["generation"]
        g = Generation(scope, gen)
        g.trainer = (threading.get_ident(), threading.get_native_id())  # for .stuck, after a shutdown
        g.record_to, g.decision_bound = record_to, bound  # the last generation's, until this one is built
        try:
            with building(g if gen > 0 else None):  # generation 0 is the script's own harden call
                h, sockets = build()
            rebuilt = clock.lap() if clock is not None else 0.0
        except BaseException as e:
            g.leave()
            if gen == 0:
                g.close()
                raise
            escalation.built_badly(g, e, record_to)
        store = _dist.default_store()
        if store is None or _dist.world_size() == 1:
            try:
                result = train_fn(h, h.resume(optimizer=optimizer, scheduler=scheduler, **extra) or 0)
            except BaseException:
                h.close(keep_local=True)  # a restart resumes from the in-memory copies
                raise
            h.close()
            return result
        keep = _torch_compat.innermost_store(store)
        ports = [p for p in (getattr(keep, "port", None), h.topology.master_port) if p]
        if sockets is not None:
            sockets.exclude(*ports)  # before the watch may use them: the store's connections are never cut
        g.sockets = sockets
        g.record_to = (h.checkpointer.directory, h.attempt) if h.checkpointer is not None else record_to
        g.decision_bound = bound = min(60.0, h.config.distributed.init_timeout)
        g.hand_over = h.watchdog.hand_over if h.watchdog is not None else None  # Ray Train's, in a Train worker
        if g.fired.is_set():  # a fault came while this generation was built: out of its first collective at once
            g.on_fault(gen)
        rank, world = _dist.rank(), _dist.world_size()
        served_by_rank0 = (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
                           and not h.config.distributed.init_method.startswith("file://"))
        unsupported = _supported(h, sockets)
        if unsupported:  # the ordinary path: no watch, nothing shut down, a fault ends the process
            log.warning("rank %d: in-process recovery is off for this run: %s; a fault ends the process as usual. "
                        "Fix: recovery.in_process: false to silence this, or run DDP on gloo on a group harden "
                        "creates", rank, unsupported)
            g.close()
            with h:
                return train_fn(h, h.resume(optimizer=optimizer, scheduler=scheduler, **extra) or 0)
        if gen > 0 and rank == 0:  # every rank is past generation gen - 1 (they rendezvoused): drop its keys
            try:
                clear_generation(store, generation=gen - 1, world_size=world, scope=scope)
            except Exception as e:  # only bytes are left behind
                log.debug("could not clear generation %d's keys: %s", gen - 1, e)
        fired, on_fault = g.fired, g.on_fault
        watch = g.watch_on(store, h.config.distributed.timeout)  # started while it was built, after a fault
        if h.watchdog is not None:  # the hang verdict is a fault too, and so are a rank's heartbeats stopping
            h.watchdog.on_hang(declarations.hang_declarer(store, scope, gen, rank, world,
                                                          h.config.distributed.timeout, fired))
        live = liveness.start_for(h.watchdog, store, scope=scope, generation=gen, rank=rank, world_size=world,
                                  fired=fired)
        if rank == 0:  # under robustdist run: where this generation stands, for a replacement of a dead worker
            replacement.publish(keep, scope, gen, world, h.config.fingerprint())
        resumed: object = "resume"
        try:
            found = h.resume(optimizer=optimizer, scheduler=scheduler, **extra)
            if found is None:
                _start_state(h, gen, rank, extra)
            resumed = found or 0
            if clock is not None:
                clock.record.rebuild_s = rebuilt
                clock.restored(h, int(resumed))  # type: ignore[call-overload]
                clock = None
            if gen > 0:  # a fault mid-backward left partial gradients: the recovered step starts from none
                h.model.zero_grad(set_to_none=True)
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
            result = train_fn(h, int(resumed))  # type: ignore[call-overload]
        except BaseException as e:
            stuck = g.leave()  # out of what the fault found it in: no stuck-thread verdict now (.stuck)
            seen, caught = fired.is_set(), time.time()  # seen: another rank's fault, by this rank's watch
            try:  # the watch and the liveness thread close even if what comes first raised
                # a lost connection where another rank has declared a fault that the watch has not yet woken up
                # to: a consequence of that fault, not one of this rank's own
                earlier = None if seen or not declarations.cut_collective(e) else \
                    declarations.declared_fault(store, gen, rank, world, scope)
                own = not seen and earlier is None
                what = f"{type(e).__name__}: {str(e).strip()[:1500]}"
                if clock is not None:  # the last recovery's restore failed: its record ends here
                    clock.record.rebuild_s = rebuilt
                    clock.restored(h, None)
                clock = Clock(Recovery(gen + 1, rank, own, what[:300]))
                if own:
                    try:
                        declare_fault(store, generation=gen, rank=rank, world_size=world, what=what, scope=scope)
                    except Exception as d:  # the others then see this rank's group go (its sockets close)
                        log.warning("rank %d could not declare its fault in the store (%s)", rank, d)
                if not seen:  # This rank's own collectives end too (the in-memory tier's commit on its background
                    # thread: the peer's shutdown alone leaves a send here waiting for the group's timeout)
                    on_fault(gen)
            finally:
                watch.close()
                liveness.close(live)
            clock.record.detect_s = detection(watch if earlier is None else SimpleNamespace(fault=earlier,
                                                                                            seen_at=caught), own)
            repeats = last_resumed[1] + 1 if resumed == last_resumed[0] else 1
            last_resumed = (resumed, repeats)
            limit = h.config.health.max_restarts_without_progress
            why = (unsupported if unsupported else
                   f"this rank escalated: its training thread was judged {stuck}" if stuck else
                   "the watch lost the store" if watch.lost else
                   "it must not be recovered in place" if _fatal(e) else
                   f"{repeats} faults in a row after resuming from {'step ' if resumed != 'resume' else ''}{resumed} "
                   f"(health.max_restarts_without_progress={limit})" if repeats >= limit else None)
            store_ok = not watch.lost
            if h.checkpointer is not None:  # the next generation's build may fail: its error is recorded there
                record_to = (h.checkpointer.directory, h.attempt)
            try:  # every rank decides alike: if one escalates, or is gone, all do
                t = time.monotonic()
                decisions, verdict = agree(keep, scope, gen, rank, world, "escalate" if why else "recover", bound)
                clock.record.decide_s = time.monotonic() - t
            except Exception as d:  # the store is gone: nobody can agree on a recovery
                decisions, verdict, store_ok = ["escalate"], "escalate", False
                why = why or f"the store is gone ({type(d).__name__})"
            if why is None and verdict != "recover":
                others = [r for r, d in enumerate(decisions) if d not in ("recover", "undecided")]
                why = (f"rank(s) {others} did not recover ({', '.join(decisions[r] for r in others)})" if others
                       else "another rank gave up waiting for this generation's decisions, and escalated")
            if h.local is not None and why is None:  # the next generation restores this process's copy from memory
                h.local.carry = True
            if rank == 0:  # a death while the next generation is built is not replaced (robustdist run: .replacement)
                replacement.withdraw()
            try:
                h.close(keep_local=True)
            except Exception as c:  # a group that the fault broke: what matters is that it is gone
                log.info("rank %d: closing generation %d after the fault: %s: %s", rank, gen, type(c).__name__,
                         str(c)[:300])
            if why is not None:
                log.error("rank %d: %s: not recovering in process (%s); the process exits for a restart", rank,
                          what[:300], why)
                if own or _fatal(e) or isinstance(e, RecoveryError) or not isinstance(e, Exception):
                    escalation.record_error(h, rank, e)
                    raise
                # what this rank saw was the teardown's doing (a collective cut short): name the fault itself
                cause = escalation.cause(watch, keep if store_ok else None, scope, gen, world)
                named = RecoveryError(
                    f"in-process recovery generation {gen} ended: {cause}; not recovering in process ({why}). "
                    "Expected every rank to recover; the process exits for a restart (the launcher's, whose "
                    f"restart-loop guard counts it). This rank's own error was a consequence ({what[:300]}). Fix: "
                    "see the error and log of the rank the fault names (for a hang verdict, the rank the watchdog "
                    "names as stuck; for stopped heartbeats, that rank's node and process).", rank=rank)
                escalation.record_error(h, rank, named)
                raise named from e
            drop_locals(e)  # what the failed attempt's finished frames held goes with the generation, uncollected
            handover.leave(keep, scope, gen, rank, world)
            _state["generation"] = gen + 1
            log.warning("rank %d: %s in generation %d (%s); recovering in process as generation %d", rank,
                        "a fault" if own else "another rank's fault", gen, what[:300] if earlier is None else
                        f"{what[:300]}, after the fault of {earlier.describe()[:300]}, read from the store", gen + 1)
        else:
            g.leave()
            try:  # before the watch closes: a rank faulting now reads "done" at once, not after the bound
                keep.set(f"{scope}/{gen}/decision/{rank}", "done")
            except Exception as d:
                log.debug("could not record this rank's finish: %s", d)
            watch.close()
            liveness.close(live)
            if fired.is_set():  # another rank faulted after this one's last collective: this one is done anyway
                try:
                    h.close(keep_local=True)
                except Exception as c:
                    log.warning("rank %d finished, but closing after another rank's fault failed: %s: %s", rank,
                                type(c).__name__, str(c)[:300])
                return result
            h.close()
            return result
        # Out of the except block, so the exception and its frames are gone. A DDP module of this generation
        # still alive (h until it is renewed, or the training function's own variable) keeps its Reducer's hooks
        # on the parameters the next DDP shares, and a Reducer cut mid-backward would run them at the next
        # backward(), on the destroyed group: retire every one (its use then raises), then free what is free.
        # Nothing of this generation keeps its store: on rank 0 the server then closes (every rank has left it),
        # and the next generation serves a fresh one (no keys of this one left in it). The other ranks let go of
        # it first (their open connections would keep the closing server waiting), then wait for the new one.
        inner = _torch_compat.innermost_store(keep)
        address = (getattr(inner, "host", None), getattr(inner, "port", None))
        connect = connector(keep, handover.PROBE_S) if served_by_rank0 and address[0] and address[1] else None
        held = _still_held(store=inner, tier=h.local, checkpointer=h.checkpointer, watchdog=h.watchdog,
                           port=address[1])
        h.generations().let_go()
        del h, store, watch, live, inner, g, fired, on_fault  # g and its watch hold the store too
        keep = None
        retired = group_teardown.retire_ddp_modules(
            f"rank {rank}: this DistributedDataParallel module belongs to in-process recovery generation {gen}, "
            f"torn down after a fault; expected the current generation's. Fix: use h.model inside the training "
            f"function (the Hardened object holds generation {gen + 1}'s), not a module kept from before")
        # Gone as the last reference went, unless a reference cycle holds one: then a full collection (0.15 to
        # 0.2 s with torch imported; only then, as it is a third of a recovery otherwise)
        if held():
            gc.collect()
            if alive := held():
                log.info("rank %d: generation %d's %s outlive(s) it (held by a save left behind, or a module or group "
                         "the script keeps); its store may serve the next generation. Expected: nothing of it left "
                         "once torn down. Fix: nothing, unless this repeats (then see what keeps it: gc.get_referrers)",
                         rank, gen, ", ".join(alive))
        if connect is not None and rank == 0:
            handover.mark_kept(connect, address, scope, gen)
        elif connect is not None:
            handover.await_new_server(connect, address, scope, gen, rank)
        assert clock is not None
        clock.record.teardown_s = clock.lap()
        log.info("rank %d: generation %d torn down in %.2f s (%d DDP module(s) retired)", rank, gen,
                 clock.record.teardown_s, retired)
