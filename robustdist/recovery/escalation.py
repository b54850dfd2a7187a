"""How an in-process recovery generation ends on a rank that escalates (:mod:`.loop`): the error that ends the
process, named after the fault that caused it, and recorded for the restart-loop guard's message."""

from __future__ import annotations

import os
from typing import Any, NoReturn

from robustdist.health import restart_guard as _restart_guard
from robustdist.recovery.generations import Generation, tell
from robustdist.recovery.faults import FaultWatch, read_fault
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import RecoveryError
from robustdist.runtime.log import get_logger

__all__ = ["built_badly", "cause", "launcher_rank", "record_error"]

log = get_logger(__name__)


def record_error(h: Any, rank: int, error: BaseException) -> None:
    """The error that ends this process goes to the restart-loop guard's record, as ``with harden(...)`` does."""
    if h.checkpointer is not None and isinstance(error, Exception):
        _restart_guard.record_error(h.checkpointer.directory, h.attempt, rank, error)


def built_badly(g: Generation, error: BaseException, record_to: tuple[str, int] | None) -> NoReturn:
    """Generation ``g``'s build raised on this rank: its own failure (declared to the others by
    :func:`.generations.tell`, or before any group existed) is re-raised; a failure caused by another rank's becomes a
    :class:`~robustdist.RecoveryError` naming that one. Either is recorded for the restart-loop guard."""
    if not g.told and _dist.is_up():  # raised after harden returned (run_in_process's make): tell the others now
        tell(g, error, None)
    g.close()
    rank = g.rank if g.rank is not None else _dist.rank() if _dist.is_up() else launcher_rank()
    what = f"{type(error).__name__}: {str(error).strip()[:300]}"
    named: BaseException = error
    if g.cause is None and g.fired.is_set() and g.watch is not None:  # seen by the watch, not read at the failure
        g.cause = g.watch.fault.describe() if g.watch.fault is not None and g.watch.fault.why else None
    if g.cause is not None and not g.own:
        named = RecoveryError(
            f"in-process recovery generation {g.generation} could not be built: another rank's build failed "
            f"({g.cause}). Expected every rank to build the next generation; the process exits for a restart (the "
            f"launcher's, whose restart-loop guard counts it). This rank's own error was a consequence ({what}). "
            "Fix: see the error and log of the rank the fault names.", rank=rank)
    else:
        log.error("rank %d: building in-process recovery generation %d failed (%s)%s; the process exits for a "
                  "restart", rank, g.generation, what,
                  ": the other ranks were told" if g.own else
                  " before its group existed: the other ranks learn of it in the rendezvous" if not g.told else
                  ": the other ranks could not be told (see the warning before)")
    if record_to is not None and isinstance(named, Exception):
        _restart_guard.record_error(record_to[0], record_to[1], rank, named)
    if named is error:
        raise error
    raise named from error


def launcher_rank() -> int:
    """This process's rank as the launcher gave it (the group is gone): torchrun's, Slurm's or Open MPI's."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def cause(watch: FaultWatch, store: Any, scope: str, gen: int, world: int) -> str:
    """What ended a generation on a rank that did not fault itself."""
    fault = watch.fault
    if store is not None and (fault is None or not fault.why):  # the watch may have closed before reading them
        try:
            fault = read_fault(store, generation=gen, world_size=world, scope=scope) or fault
        except Exception as e:  # the store is gone
            log.debug("could not read generation %d's fault: %s", gen, e)
    if fault is not None and fault.why:
        return f"a declared fault ({fault.describe()})"
    if watch.lost:
        return "the job's store was lost"
    return "a declared fault (no reason recorded)"
