"""A training thread that the teardown cannot get out of a collective (in-process recovery, :mod:`.loop`).

Shutting a gloo group's connections down ends a collective in progress, except where a transfer is under way: gloo
(torch 2.13's, and gloo's main branch of April 2026) signals a closed connection's error to the buffers of the
operations it has queued, but not to the unbound buffer of the send it is writing (``Pair::signalException`` looks
at ``op.buf`` of the queued sends, where an unbound send keeps ``op.ubuf``) nor to the one its read is filling
(``rx_``). Such a wait ends only at the group's timeout (``distributed.timeout``): a large send to a stopped peer
always, an ``all_reduce`` whose segments are flowing when both ranks shut their connections down sometimes
(benchmarks/findings.md, R1; docs/design/stuck-ranks-escalate.md). A rank caught so cannot join the recovery: the
other ranks would wait the whole decision bound and escalate, and the caught rank would go on waiting for the
group's timeout.

:func:`watch` (started by the generation's fault callback, on its own thread) samples the training thread after
the shutdown. It is *stuck* when, :data:`STUCK_AFTER_S` seconds after the shutdown, it has been asleep (state ``S``
in ``/proc``, in a futex where ``wchan`` says, no CPU time used) for the last half of that time, in a collective:
its innermost Python frame in ``torch/distributed`` (not its ``checkpoint`` package: file I/O), in
``torch/autograd`` (DDP's all-reduce is waited for in ``backward()``; only where CUDA is not initialised, as a GPU
backward sleeps on the host) or in ``torch/nn/parallel``, or on a line of the script's own (not the standard
library's, not an installed package's) that calls ``.wait(`` (``work.wait()``). Then the rank escalates for itself
(its decision, "escalate (stuck: ...)", written on a bounded connection of its own: the others escalate at once)
and, unless the thread comes out within :data:`EXIT_GRACE_S`, the process exits with
:data:`~robustdist.health.watchdog.HANG_EXIT_CODE` (the error recorded for the restart-loop guard first, every
thread's stack on stderr, the error handed to Ray Train's controller where the watchdog has a hand-over), as
``health.hang_action="abort"`` does: the thread would otherwise wait out the group's timeout, and the launcher
restarts the job from its newest checkpoint. A :class:`Judgement` keeps the training thread and the check in step:
nothing is judged or ended once the thread has left, and a thread that leaves after the escalation makes its rank
escalate. A thread elsewhere (a ``sleep``, a loader's queue, a store's wait, disk I/O, computing) is not judged: it
comes back by itself, or the decision bound ends the wait.

Not covered: a thread blocked in C++ called from a frame that names none of these (a library's own wrapper of a
collective) is left to the decision bound; without ``/proc`` nothing is judged.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from robustdist.health.restart_guard import record_error
from robustdist.health.watchdog import HANG_EXIT_CODE
from robustdist.runtime.errors import RecoveryError
from robustdist.runtime.log import get_logger

__all__ = ["EXIT_BOUND_S", "EXIT_GRACE_S", "HAND_OVER_GRACE_S", "STUCK_AFTER_S", "Judgement", "Sample", "sample",
           "waiting_in", "watch"]

log = get_logger(__name__)

STUCK_AFTER_S = 2.0
"""Seconds after the shutdown before a blocked training thread is judged: a collective the shutdown ends is out
within milliseconds; a rank's decision bound is 60 s."""
EXIT_GRACE_S = 2.0
"""After escalating, the seconds a stuck thread is given to come out by itself before the process exits."""
EXIT_BOUND_S = 10.0
"""The most the exit's last steps (the restart-loop record, the stack dump, flushing) may take."""
HAND_OVER_GRACE_S = 30.0
"""Where the error was handed to the launcher's controller (Ray Train's), the seconds it has to tear the worker
down before the process exits by itself."""
_POLL_S = 0.1
_COLLECTIVE_DIRS = tuple(os.path.join("torch", *parts) + os.sep for parts in
                         (("distributed",), ("autograd",), ("nn", "parallel")))
_NOT_COLLECTIVE_DIRS = (os.path.join("torch", "distributed", "checkpoint") + os.sep,)  # file I/O, not transfers
_STDLIB = tuple({os.path.join(p, "") for p in (sysconfig.get_paths().get("stdlib"),
                                                 sysconfig.get_paths().get("platstdlib")) if p})
_PACKAGES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


class Judgement:
    """What the checker found, shared with the training thread under one lock: never "stuck" or "exiting" once the
    thread has left, and a thread that leaves after the exit began waits for it (the process is ending)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.left = threading.Event()
        self.stuck: str | None = None  # where the thread was judged stuck (its rank escalated)
        self._exiting = False

    def judge(self, where: str) -> bool:
        """The checker: the thread is stuck at ``where``, unless it has left (False)."""
        with self._lock:
            if self.left.is_set():
                return False
            self.stuck = where
            return True

    def exit_now(self) -> bool:
        """The checker, after the grace: True if the process is to exit (the thread has not left)."""
        with self._lock:
            self._exiting = not self.left.is_set()
            return self._exiting

    def leave(self) -> str | None:
        """The training thread is out: where it was judged stuck (its rank has escalated), or None. Never returns
        once the exit has begun."""
        with self._lock:
            self.left.set()
            exiting, stuck = self._exiting, self.stuck
        while exiting:  # the checker is ending the process (bounded by EXIT_BOUND_S)
            time.sleep(3600)
        return stuck


class Sample(NamedTuple):
    state: str  # the kernel's one-letter state: R running, S sleeping, D uninterruptible, T stopped, ...
    ticks: int  # user and system CPU time, in clock ticks
    futex: bool | None  # blocked in a futex (a C++ condition variable, a lock); None where /proc does not say


def sample(native_id: int, task_dir: str = "/proc/self/task") -> Sample | None:
    """The thread's state, CPU time and whether it waits in a futex, from ``/proc``; None where the state cannot
    be read (gone, or no ``/proc``)."""
    task = os.path.join(task_dir, str(native_id))
    try:
        with open(os.path.join(task, "stat")) as f:
            fields = f.read().rpartition(")")[2].split()  # after the name, which may hold spaces and parentheses
        state, ticks = fields[0], int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None
    try:
        with open(os.path.join(task, "wchan")) as f:
            wchan = f.read().strip()
    except OSError:
        wchan = ""
    return Sample(state, ticks, ("futex" in wchan) if wchan not in ("", "0") else None)


def waiting_in(ident: int) -> str | None:
    """``all_reduce (distributed_c10d.py:2951)`` where the thread's innermost Python frame is in a collective (see
    the module's doc), else None."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    code = frame.f_code
    path = os.path.normpath(code.co_filename)
    torch = sys.modules.get("torch")
    gpu = torch is not None and getattr(getattr(torch, "cuda", None), "is_initialized", lambda: False)()
    dirs = [d for d in _COLLECTIVE_DIRS if not (gpu and "autograd" in d)]  # a GPU backward sleeps on the host
    if any(d in path for d in _NOT_COLLECTIVE_DIRS):
        return None
    library = path.startswith(_STDLIB) or any(d in path for d in _PACKAGES)  # a script's own wait() is not
    if not any(d in path for d in dirs) and (library or ".wait(" not in linecache.getline(code.co_filename,
                                                                                          frame.f_lineno)):
        return None
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"


def watch(*, ident: int, native_id: int, judgement: Judgement, rank: int, generation: int,
          escalate: Callable[[str], None], record_to: tuple[str, int] | None,
          stuck_after: float = STUCK_AFTER_S, exit_grace: float = EXIT_GRACE_S,
          hand_over: Callable[[BaseException], bool] | None = None, exit: Callable[[int], Any] = os._exit) -> None:
    """Watch the training thread (``ident``, ``native_id``) from the shutdown until it has left
    (``judgement.left``); when it is stuck, ``escalate(where)`` and end the process (``exit``; first
    ``hand_over(error)``, the watchdog's: inside Ray Train the controller then shows the error and ends the
    worker). Runs on a thread of its own."""
    left = judgement.left
    start = time.monotonic()
    still_since, ticks = start, -1
    while not left.wait(_POLL_S):
        now = time.monotonic()
        got = sample(native_id)
        if got is None:  # gone, or /proc cannot tell: nothing is judged
            return
        if got.state != "S" or got.futex is False or got.ticks != ticks:  # D: disk I/O, page faults
            still_since, ticks = now, got.ticks
            continue
        if now - start < stuck_after or now - still_since < stuck_after / 2:
            continue
        where = waiting_in(ident)
        if where is None:
            continue
        blocked = now - start
        error = RecoveryError(
            f"in-process recovery generation {generation}: this rank's training thread is still blocked in {where} "
            f"{blocked:.1f} s after its group's connections were shut down; expected every collective to end at "
            "the shutdown. The likeliest cause: gloo does not end a transfer under way there (a send it is "
            "writing, a receive it is filling), and such a wait lasts until distributed.timeout. This rank "
            f"escalates, and its process exits with code {HANG_EXIT_CODE} unless the thread comes out within "
            f"{exit_grace:g} s, so that the launcher restarts the job from its newest checkpoint. Fix: let the "
            "launcher restart the job (torchrun --max-restarts; under Ray Train FailureConfig(max_failures=1) or "
            "more); a shorter distributed.timeout bounds such a wait where nothing restarts the job.", rank=rank)
        if not judgement.judge(f"stuck: blocked in {where} {blocked:.1f} s after the shutdown"):
            return
        log.error("%s", error, all_ranks=True)
        escalate(judgement.stuck or "stuck")
        if left.wait(exit_grace) or not judgement.exit_now():  # out meanwhile: the loop escalates (judgement.stuck)
            log.warning("rank %d: the training thread came out after all; not exiting, but this rank has escalated "
                        "(expected: an exit). Fix: none; the launcher's restart takes over.", rank, all_ranks=True)
            return
        _exit(rank, error, record_to, exit, hand_over)
        return


def _exit(rank: int, error: BaseException, record_to: tuple[str, int] | None, exit: Callable[[int], Any],
          hand_over: Callable[[BaseException], bool] | None = None) -> None:
    """The error recorded for the restart-loop guard, every thread's stack on stderr, the error handed over (where
    ``hand_over`` takes it: the process then waits up to :data:`HAND_OVER_GRACE_S` to be ended), then ``exit``;
    the steps before the hand-over bounded by :data:`EXIT_BOUND_S` (a record on a stalled file system, a pipe
    nobody reads), the whole by both."""
    bound = threading.Timer(EXIT_BOUND_S + (HAND_OVER_GRACE_S if hand_over is not None else 0.0), exit,
                            (HANG_EXIT_CODE,))
    bound.daemon = True
    bound.start()
    if record_to is not None:
        try:
            record_error(record_to[0], record_to[1], rank, error)
        except Exception as e:  # the exit matters more than the record
            log.warning("rank %d: could not record the error for the restart-loop guard (%s); expected a writable "
                        "checkpoint directory. Fix: check %s.", rank, e, record_to[0], all_ranks=True)
    try:
        faulthandler.dump_traceback(sys.__stderr__ or sys.stderr, all_threads=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except Exception:  # a closed stream must not keep the process alive
        pass
    handed = False
    if hand_over is not None:
        try:
            handed = hand_over(error)
        except Exception as e:  # Ray's internals changed: exit as elsewhere
            log.warning("rank %d: could not hand the error to the launcher's controller (%s: %s); expected Ray "
                        "Train's controller to take it. Fix: none; the process exits instead.", rank, type(e).__name__,
                        e, all_ranks=True)
    if handed:
        log.error("rank %d: handed the error to the launcher's controller (Ray Train), which ends this worker; "
                  "exiting with code %d in %g s if it has not", rank, HANG_EXIT_CODE, HAND_OVER_GRACE_S,
                  all_ranks=True)
        time.sleep(HAND_OVER_GRACE_S)
    exit(HANG_EXIT_CODE)
    bound.cancel()  # reached only where ``exit`` returns (tests)
