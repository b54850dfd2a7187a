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
fault instead of declaring its own.

Not covered: a rank that fails before the generation's store exists (the others learn of it in the rendezvous,
after ``distributed.init_timeout``, or when its process exits), and a rank inside torch's own store waits (a new
group's creation), which end with the group's timeout.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from robustdist.health.watchdog_store import connector
from robustdist.recovery.faults import FaultWatch, declare_fault, read_fault
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.group_sockets import GroupSockets
from robustdist.runtime.log import get_logger

__all__ = ["Generation", "building", "failed", "group_made"]

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

    def on_fault(self, generation: int) -> None:
        """The watch's callback (any thread): get this rank out of the collective or store wait it is in."""
        self.fired.set()
        if self.sockets is not None:
            self.sockets.unblock()
        _dist.interrupt_waits(f"a rank faulted in recovery generation {generation}")

    def watch_on(self, store: Any, timeout: float) -> FaultWatch:
        """Start the watch on ``store`` (once; a later call returns the running one)."""
        if self.watch is None:
            self.watch = FaultWatch(connector(store, timeout), store, generation=self.generation,
                                    world_size=_dist.world_size(), rank=_dist.rank(), on_fault=self.on_fault,
                                    scope=self.scope).start()
        return self.watch

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


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
    try:
        _current[0].watch_on(store, timeout)
    except Exception as e:  # no watch: a failure of this build is then learnt from the connections' end only
        log.warning("rank %d: could not start the fault watch of recovery generation %d: %s: %s", _dist.rank(),
                    _current[0].generation, type(e).__name__, str(e)[:300])


def failed(error: BaseException, sockets: GroupSockets | None) -> None:
    """``harden``, when its build raised, before it destroys the group: tell the other ranks (no-op when no
    generation is being built, or no group was made). Never raises."""
    if not _current or (store := _dist.default_store()) is None or _dist.world_size() < 2:
        return
    g, rank, world = _current[0], _dist.rank(), _dist.world_size()
    try:
        fault = read_fault(store, generation=g.generation, world_size=world, scope=g.scope)
        if g.fired.is_set() or (fault is not None and set(fault.why) - {rank}):
            g.cause = fault.describe() if fault is not None else f"generation {g.generation}: no reason recorded"
        else:
            declare_fault(store, generation=g.generation, rank=rank, world_size=world, scope=g.scope,
                          what=f"building in-process recovery generation {g.generation} failed: "
                               f"{type(error).__name__}: {str(error).strip()[:1500]}")
            g.own = True
        # the others need not wait for its decision (the loop's keys are the job store's, under every prefix)
        _torch_compat.innermost_store(store).set(f"{g.scope}/{g.generation}/decision/{rank}", "escalate")
    except Exception as e:  # the store is gone: the others learn of it from the connections' end
        log.debug("rank %d: could not declare generation %d's failed build: %s", rank, g.generation, e)
    g.fired.set()
    if sockets is not None:  # the others' collectives with this rank end now, not at the group's timeout
        port = getattr(_torch_compat.innermost_store(store), "port", None)
        sockets.exclude(*[int(p) for p in (port, os.environ.get("MASTER_PORT")) if p and str(p).isdigit()])
        sockets.unblock()  # the group's connections only: the store's stay, the others read the fault in it
    g.close()
