"""Start-up work at the lowest CPU priority, then the process back as it was (the warm spare's warm-up).

:func:`possible` says whether this process can lower a thread to ``SCHED_IDLE`` and bring it back: coming back needs
``CAP_SYS_NICE``, or ``RLIMIT_NICE`` of at least ``20 - nice``, which a root container often lacks. :func:`run` runs a
function in a thread of its own at ``SCHED_IDLE``, the calling thread (which goes on to be a worker) never lowered,
and then puts every thread the function left (pools its imports started) back at the calling thread's policy.

Where the scheduler's autogroups are in effect (tasks in the root CPU cgroup, ``kernel.sched_autogroup_enabled``: a
plain Linux host or VM; not a container in a CPU cgroup), each session is a group that competes at full weight
whatever its threads' policies, and the spare is a session of its own: :func:`run` also sets the session's
autogroup to nice 19 meanwhile (``/proc/self/autogroup``; raising it needs no privilege) and back after.

What this does not remove: a thread at ``SCHED_IDLE`` still gets a sliver of a busy CPU, runs on the idle hardware
thread of a busy core, and shares the caches and the memory bandwidth; its reads get the idle I/O class. Child
processes it starts inherit ``SCHED_IDLE``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable

__all__ = ["possible", "run"]

AUTOGROUP = "/proc/self/autogroup"
_PASSES = 10  # rounds of putting threads back (a thread still idle may start another meanwhile)
_AUTOGROUP_BACK_S = 5.0  # the kernel takes one autogroup change per 100 ms from all unprivileged processes


def possible() -> bool:
    """Whether a thread of this process can go to ``SCHED_IDLE`` and come back to the policy the calling thread has
    (a throwaway thread tries both). False off Linux, without ``/proc``, and where the calling thread already
    idles."""
    try:
        idle, back, param = os.SCHED_IDLE, os.sched_getscheduler(0), os.sched_getparam(0)
    except (AttributeError, OSError):  # not Linux; musl's stubs; a sandbox refusing the call
        return False
    if back == idle or not os.path.isdir("/proc/self/task"):
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, idle, os.sched_param(0))
            os.sched_setscheduler(0, back, param)
        except OSError:
            ok.append(False)
        else:
            ok.append(True)

    thread = threading.Thread(target=probe, name="robustdist-idle-probe", daemon=True)
    thread.start()
    thread.join()
    return ok == [True]


def run(fn: Callable[[], object], patience_s: float | None = None) -> bool:
    """``fn()`` in a thread at ``SCHED_IDLE`` (the session's autogroup at nice 19 meanwhile), then every thread of the
    process back at the calling thread's policy and the autogroup back; ``fn``'s exception is raised here after that.
    ``patience_s``: where ``fn`` has not returned by then (a host with little idle CPU time starves it), everything is
    put back at once and ``fn`` finishes at the calling thread's priority. Returns whether ``fn`` ran idle to its end.
    Raises ``RuntimeError`` when a thread or the autogroup cannot be put back. Call only where :func:`possible`."""
    idle, back, param = os.SCHED_IDLE, os.sched_getscheduler(0), os.sched_getparam(0)
    group = _autogroup_nice()  # lowered only from 0 up: coming back below 0 would need CAP_SYS_NICE
    lowered = group is not None and 0 <= group < 19 and _autogroup_to(19, 1.0) is None
    failed: list[BaseException] = []

    def body() -> None:
        try:
            os.sched_setscheduler(0, idle, os.sched_param(0))
            fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the calling thread
            failed.append(e)

    thread = threading.Thread(target=body, name="robustdist-idle", daemon=True)
    thread.start()
    thread.join(patience_s)
    idle_to_the_end = not thread.is_alive()
    problems: list[str] = []
    if lowered:  # first, so that threads put back find their group's weight back too
        assert group is not None
        problem = _autogroup_to(group, _AUTOGROUP_BACK_S)
        if problem:
            problems.append(f"the session's autogroup could not be set back to nice {group} ({problem})")
    problems += _threads_back(idle, back, param)
    if not idle_to_the_end:
        thread.join()
        problems += _threads_back(idle, back, param)  # a thread it started while the first round ran
    if failed:
        raise failed[0]
    if problems:
        raise RuntimeError(f"pid {os.getpid()}: after the work at idle priority, {'; '.join(problems)}; expected every "
                           "thread back at the calling thread's policy and the autogroup back at its nice value. Fix: "
                           "none needed where a fallback exists (a spare that fails so is replaced, then replacements "
                           "start cold); a bug if seen: report it")
    return idle_to_the_end


def _threads_back(idle: int, back: int, param: os.sched_param) -> list[str]:
    """Every thread still at ``idle`` set to ``back``; what could not be (a thread read or set failing)."""
    for _ in range(_PASSES):
        found, problems = 0, []
        for tid in sorted(int(t) for t in os.listdir("/proc/self/task") if t.isdigit()):
            try:
                if os.sched_getscheduler(tid) == idle:
                    found += 1
                    os.sched_setscheduler(tid, back, param)
            except ProcessLookupError:  # the thread has ended
                continue
            except OSError as e:
                problems.append(f"thread {tid} could not be read or set ({e.strerror})")
        if problems or not found:
            return problems
    return [f"threads still started at SCHED_IDLE after {_PASSES} rounds"]


def _autogroup_nice() -> int | None:
    """The session's autogroup nice value (``/autogroup-N nice V``); None without autogroups."""
    try:
        with open(AUTOGROUP, encoding="ascii") as f:
            words = f.read(256).split()
        value = int(words[-1])
    except (OSError, ValueError, IndexError):
        return None
    return value if -20 <= value <= 19 else None


def _set_autogroup(nice: int) -> OSError | None:
    try:
        fd = os.open(AUTOGROUP, os.O_WRONLY)
    except OSError as e:
        return e
    try:
        os.write(fd, str(nice).encode())
    except OSError as e:
        return e
    finally:
        os.close(fd)
    return None


def _autogroup_to(nice: int, within: float) -> str | None:
    """Set the session's autogroup nice value, trying again for ``within`` seconds while the kernel's rate limit
    refuses (EAGAIN); the error's text if it could not."""
    deadline = time.monotonic() + within
    while True:
        error = _set_autogroup(nice)
        if error is None:
            return None
        if error.errno != errno.EAGAIN or time.monotonic() > deadline:
            return error.strerror or str(error)
        time.sleep(0.05)
