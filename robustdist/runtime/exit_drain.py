"""Let torch's gloo worker threads finish the collective they just completed before the interpreter shuts down.

A gloo worker thread (torch names it ``pt_gloo_runloop``) marks a collective done, wakes the caller, and only
then drops its own reference to the work, and with it to the work's tensors. When the caller has already let go
of a tensor (``t = torch.ones(1); dist.all_reduce(t); del t``, or a script that all-reduces and returns), the
worker frees the tensor's Python object, which takes the GIL. If the main thread has by then started shutting
the interpreter down, Python (3.10 to 3.13) ends that thread with ``pthread_exit`` inside C++ frames and the
process aborts: ``terminate called without an active exception``, exit code -6, after a run that succeeded.
It happens in a fraction of the runs of a script that all-reduces a tensor and exits (torch 2.13, gloo, under
torchrun on a loaded machine); a core dump shows the worker in ``~AsyncAllreduceWork`` -> ``decref_pyobject`` ->
``take_gil`` -> ``pthread_exit``. Where torch does not name its worker threads (torch 2.8: every thread is
``python``), the drain finds no worker and returns at once.
``destroy_process_group()`` does not stop the workers (only freeing the group does; a DDP module keeps it).

:func:`install` registers :func:`drain` with :mod:`atexit` (once; it runs before the interpreter's shutdown):
it waits, without the GIL, until none of this process's gloo workers is running, sampling their state in
``/proc/self/task``, for at most :data:`MAX_WAIT_S` seconds (a worker blocked in a collective whose peer is gone
sleeps, so it does not delay the exit). It does nothing where ``/proc`` is missing, and it never raises.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

__all__ = ["MAX_WAIT_S", "busy_gloo_workers", "drain", "install"]

log = logging.getLogger(__name__)

MAX_WAIT_S = 2.0
"""The longest :func:`drain` waits: a worker finishing a completed collective needs microseconds of CPU."""
_WORKER_NAME = "pt_gloo_runloop"  # torch's name for a ProcessGroupGloo worker thread (c10::setThreadName)
_QUIET_SAMPLES = 2  # consecutive samples with no worker running before the workers count as idle
_installed = False
_lock = threading.Lock()


def busy_gloo_workers(task_dir: str = "/proc/self/task") -> int | None:
    """How many of this process's gloo worker threads are running or runnable (state ``R``); None when
    ``/proc`` cannot tell."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    busy = 0
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                if f.read().strip() != _WORKER_NAME:
                    continue
            with open(os.path.join(task_dir, tid, "stat")) as f:
                state = f.read().rpartition(")")[2].split()[:1]  # the field after the name, which may hold spaces
        except OSError:  # the thread ended between the listing and the read
            continue
        busy += state == ["R"]
    return busy


def drain(max_wait: float = MAX_WAIT_S, *, task_dir: str = "/proc/self/task") -> bool:
    """Wait until no gloo worker has run for :data:`_QUIET_SAMPLES` consecutive samples (sleeping between them,
    so a worker waiting for the GIL gets it), at most ``max_wait`` s. True when they went quiet (or there are
    none, or ``/proc`` cannot tell); False when the wait ran out. Never raises."""
    deadline = time.monotonic() + max_wait
    # A worker waiting for the GIL sleeps (state S) until the holder's switch interval ends: quiet must last
    # at least two intervals (at most 0.1 s) before the workers count as idle.
    settle = min(2 * sys.getswitchinterval(), 0.1)
    quiet, pause, quiet_since = 0, 0.0005, 0.0
    try:
        while True:
            busy = busy_gloo_workers(task_dir)
            if busy is None:
                return True
            now = time.monotonic()
            if busy:
                quiet = 0
            else:
                quiet_since = quiet_since if quiet else now
                quiet += 1
            if quiet >= _QUIET_SAMPLES and now - quiet_since >= settle:
                return True
            if time.monotonic() >= deadline:
                log.debug("exit: %d gloo worker thread(s) still running after %.1f s", busy, max_wait)
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    except Exception as e:  # an exit hook must not turn a clean exit into a traceback
        log.debug("exit: could not check the gloo worker threads: %s", e)
        return True


def install() -> None:
    """Register :func:`drain` to run at exit (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(drain)
            _installed = True
