"""Waiting for a save's background part: shared by the durable checkpointer and the in-memory tier.

A save's background part writes files, then takes part in collectives (the durable tier's report and commit, the
in-memory tier's replication and commit). While an in-process recovery has interrupted the waits
(:func:`robustdist.runtime.dist.interrupt_waits`), a background part stuck in one of those collectives is waited
for only :data:`ABANDON_S` seconds, then left to fail on its own: a gloo send waiting for its peer's receive is not
ended by shutting the group's connections down (it waits out the group's whole timeout), and after a collective
fails the background part writes nothing more. A background part still writing its files is waited for (up to the
bound): the files are this rank's, and a write is not a hang.

The wait runs in slices, so a recovery that begins while a wait is already under way is seen too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import CheckpointError, drop_locals

__all__ = ["ABANDON_S", "Leaving", "join", "start", "taken_error"]

ABANDON_S = 2.0
"""How long a background part stuck in a collective is waited for once a recovery has interrupted the waits,
counted from the interrupt (so the in-memory tier's wait and the durable tier's, one after the other, share it)."""
_SLICE_S = 0.05


class Leaving:
    """Whether a background part is in its collectives, and whether a wait left it behind: both under one lock, so
    the part never starts a commit step after a wait decided to leave it, and a wait never leaves a part that has
    just gone past its collectives (to rename, say)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_collective = False
        self.left = False

    def enter(self) -> bool:
        """The part goes (back) into a collective; False when it was left behind (it must start nothing more).
        While waits are interrupted the collective will not start (it raises "not started"), so the part is not
        marked as in one: a wait then sees it end instead of leaving it behind as stuck."""
        with self._lock:
            if _dist.interrupted() is None:
                self.in_collective = True
            return not self.left

    def leave_collective(self) -> bool:
        """The part is past its collective (storage work follows, waited for); False when it was left behind."""
        with self._lock:
            self.in_collective = False
            return not self.left

    def try_leave(self) -> bool:
        """A wait: leave the part behind if it is in a collective; True when it did."""
        with self._lock:
            if self.in_collective:
                self.left = True
            return self.left


def start(owner: Any, part: Callable[..., None], args: tuple[Any, ...], *, leaving: Leaving,
          done: threading.Event, what: str, name: str, logger: Any) -> threading.Thread:
    """Run ``part(*args)`` on a daemon thread named ``name`` and return it. Its error is kept in ``owner._error``
    (the owner's next call raises it, :func:`taken_error`), or only logged when a recovery left the part behind:
    it failed as expected, and nothing waits for its error. ``done`` is set when the part ends, however it ends.
    The thread holds everything as its frames' locals, in no closure: :func:`taken_error` drops those during a
    recovery, so a kept error keeps neither the owner nor the snapshot alive."""
    thread = threading.Thread(target=_run, args=(owner, part, args, leaving, done, what, logger), name=name,
                              daemon=True)
    thread.start()
    return thread


def _run(owner: Any, part: Callable[..., None], args: tuple[Any, ...], leaving: Leaving, done: threading.Event,
         what: str, logger: Any) -> None:
    try:
        part(*args)
    except BaseException as e:  # surfaces at the owner's next call
        if leaving.left:
            logger.info("%s, left behind by an in-process recovery, ended: %s", what, str(e))
        else:
            owner._error = e
            logger.error("%s failed: %s", what, str(e))  # the message only: a log record keeps no live error
    finally:
        done.set()


def join(thread: threading.Thread, bound: float, leaving: Leaving) -> Literal["done", "left", "timeout"]:
    """Wait for ``thread`` at most ``bound`` seconds: ``"done"`` when it ended, ``"timeout"`` when it still runs,
    ``"left"`` when a recovery interrupted the waits :data:`ABANDON_S` seconds ago or more and the part was still in
    a collective (``leaving.left`` is then set: the part starts no further step)."""
    deadline = time.monotonic() + bound
    while thread.is_alive() and time.monotonic() < deadline:
        since = _dist.interrupted_at()
        if since is not None and time.monotonic() >= since + ABANDON_S and leaving.try_leave():
            return "left"
        thread.join(_SLICE_S)
    return "timeout" if thread.is_alive() else "done"


def taken_error(owner: Any, what: str, rank: int | None) -> CheckpointError:
    """``owner._error`` (a background part's), cleared and returned as the :class:`CheckpointError` to raise
    (``what: <error>`` wrapping any other, its cause). Returned, not raised here, so no frame holds it: an error
    that a frame on its own traceback holds forms a cycle, which keeps the owner (its group, its store, its
    buffers) alive until the next garbage collection. While an in-process recovery has interrupted the waits,
    the background part's finished frames' locals are dropped too (:func:`~robustdist.runtime.errors.drop_locals`:
    the generation goes as the recovery lets go of it); otherwise they stay, for a debugger."""
    error, owner._error = owner._error, None
    if _dist.interrupted() is not None:
        drop_locals(error)
    if isinstance(error, CheckpointError):
        return error
    wrapped = CheckpointError(f"{what}: {error}", rank=rank)
    wrapped.__cause__ = error
    return wrapped
