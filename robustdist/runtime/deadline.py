"""Blocking calls with a deadline: the one helper every part uses to wait for a call that may never return.

A store constructor, a store read on a frozen server, a name lookup, a gloo point-to-point wait: each blocks in
C++ (the GIL released) and honours no bound of its own in some case. :func:`bounded` runs such a call on a daemon
thread and gives the caller its result, its exception, or "not finished" by a deadline (a ``time.monotonic()``);
a call still running then is left on its thread, never waited for. ``stop`` ends the wait early (an in-process
recovery interrupting the waits). A thread expected to end by ``ends_by`` is joined at interpreter exit, for at
most :data:`EXIT_WAIT_S` seconds: one that returned from C++ while the interpreter shuts down would otherwise be
ended with ``pthread_exit`` inside C++ frames, and the process would abort ("terminate called without an active
exception").
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_WAIT_S", "bounded"]

EXIT_WAIT_S = 3.0  # at most this long at exit for calls left running past their deadline
_POLL_S = 0.05  # how often ``stop`` is asked
_left_behind: list[tuple[threading.Thread, float]] = []  # calls still running after their deadline
_left_lock = threading.Lock()


def bounded(make: Callable[[], Any], deadline: float, name: str, *, ends_by: float | None = None,
            stop: Callable[[], object] | None = None) -> tuple[Any, BaseException | None, bool]:
    """Run ``make`` on a daemon thread named ``robustdist-<name>`` until ``deadline``: ``(value, error,
    finished)``. ``error`` is what ``make`` raised (any ``BaseException``, handed over for the caller to name).
    ``stop``, asked every :data:`_POLL_S` seconds, ends the wait early when it returns a true value (the call is
    then left running, ``finished`` False). ``ends_by``: when the call is expected to end on its own (its own
    timeout), so a call left running is joined at exit until then."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = make()
        except BaseException as e:  # handed to the caller, which names it
            box["error"] = e

    thread = threading.Thread(target=run, name=f"robustdist-{name}", daemon=True)
    thread.start()
    while (left := deadline - time.monotonic()) > 0:
        thread.join(left if stop is None else min(left, _POLL_S))
        if not thread.is_alive() or (stop is not None and stop()):
            break
    if thread.is_alive():
        if ends_by is not None:
            _join_at_exit(thread, ends_by)
        return None, None, False
    return box.get("value"), box.get("error"), True


def _join_at_exit(thread: threading.Thread, ends_by: float) -> None:
    with _left_lock:
        if not _left_behind:
            atexit.register(_join_left_behind)
        _left_behind.append((thread, ends_by))


def _join_left_behind() -> None:
    stop = time.monotonic() + EXIT_WAIT_S
    with _left_lock:
        left = list(_left_behind)
        _left_behind.clear()
    for thread, ends_by in left:
        thread.join(max(0.0, min(ends_by, stop) - time.monotonic()))
