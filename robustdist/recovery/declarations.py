"""A rank's side of a fault's declaration, on store connections of its own (:mod:`robustdist.recovery.loop`
uses these): a collective cut by another rank's fault is read as that rank's fault, not declared as this one's,
and the watchdog's hang verdict is declared as a fault of its rank.

Each store call here may outlive the generation it was made for (a store client retries its connect for its
whole timeout, and the next generation's server can start on the same port): the hang's fault is not written on
a connection made after the generation's fault was handled, and the wake keys are written only where the
generation's fault was found (in its own store)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from robustdist.recovery.generations import looks_like_transport
from robustdist.recovery.faults import Fault, declare_fault, read_fault, wake_all
from robustdist.runtime.deadline import bounded
from robustdist.runtime.job_store import connector
from robustdist.runtime.log import get_logger

__all__ = ["cut_collective", "declared_fault", "hang_declarer"]

log = get_logger(__name__)
READ_FAULT_S = 2.0  # a rank whose collective was cut reads the store for another rank's fault within this


def cut_collective(error: BaseException) -> bool:
    """A collective or store connection of the group that ended with the connection (not the script's own I/O)."""
    text = str(error)
    return looks_like_transport(error) and (isinstance(error, dist.DistError) or "gloo" in text.lower())


def declared_fault(store: Any, gen: int, rank: int, world: int, scope: str) -> Fault | None:
    """Generation ``gen``'s fault if another rank has declared one, read (within ``READ_FAULT_S``) on a store
    connection of its own; every rank's watch is woken again (the declaring rank may have died before it woke them
    all). None where none is declared, or the store does not answer in time."""
    def read() -> Fault | None:
        client = connect()
        fault = read_fault(client, generation=gen, world_size=world, scope=scope)
        if fault is not None and fault.others(rank):
            wake_all(client, generation=gen, world_size=world, scope=scope)
            return fault
        return None

    connect = connector(store, READ_FAULT_S)
    fault, error, finished = bounded(read, time.monotonic() + READ_FAULT_S, "fault-read",
                                     ends_by=time.monotonic() + 2 * READ_FAULT_S)
    if error is not None or not finished:  # the cut is then taken for this rank's own fault
        log.warning("rank %d: its collective was cut, and the store did not say within %g s whether another rank "
                    "declared generation %d's fault (%s); taking the cut for this rank's own fault", rank,
                    READ_FAULT_S, gen, error if error is not None else "no answer")
    return fault


def hang_declarer(store: Any, scope: str, gen: int, rank: int, world: int, timeout: float,
                  fired: threading.Event) -> Callable[[Any], None]:
    """The watchdog's hang callback: declare a fault (on a store connection of its own: the training thread may
    hold the group's), unless one is being handled already. Every rank's watch then unblocks its collective; a
    rank stuck elsewhere (in Python, in I/O) stays stuck, says nothing, and the others escalate."""
    connect = connector(store, min(timeout, 30.0))  # bounded: the watchdog's thread must come back

    def on_hang(report: Any) -> None:
        if fired.is_set():
            return
        what = (f"HangError: rank {rank} had no step for {report.idle_seconds:.1f} s (health.hang_timeout); last "
                f"step {report.step}" + (f"; {report.summary}" if report.summary else ""))
        client = connect()
        if not fired.is_set():  # a fault handled meanwhile: its store may be gone, and its port serve another
            declare_fault(client, generation=gen, rank=rank, world_size=world, what=what, scope=scope)

    return on_hang
