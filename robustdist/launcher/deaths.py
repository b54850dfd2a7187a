"""``robustdist run``'s agent wakes at a worker's end, not at its next look.

torchrun's agent sleeps ``--monitor-interval`` between looks at its workers (0.1 s by default, often set higher), so
it sees a death on average half an interval late, and every survivor waits that much longer for the replacement.
``robustdist run``'s agent waits on a pidfd of each running worker instead, with ``poll(2)`` and the same interval as
its timeout: with nothing ending it looks exactly as often as torchrun's, and at once when a worker ends. A worker
forked by the warm spare is watched through its own pidfd, then through the spare's pipe until the spare says how it
ended (:class:`~robustdist.launcher.forked.ForkedWorker`). Where the kernel has no pidfds (Linux before 5.3), the
agent sleeps the interval, as torchrun does.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import time
from collections.abc import Iterable
from typing import Any

from robustdist.launcher.forked import readable

__all__ = ["DeathWatch"]

log = logging.getLogger(__name__)  # the launcher is no rank: no rank prefix


class DeathWatch:
    """Waits until one of the agent's workers ends, at most a timeout. Holds a pidfd per watched process (closed when
    the process is no longer watched, and by :meth:`close`)."""

    def __init__(self) -> None:
        self._fds: dict[int, tuple[Any, int]] = {}  # pid -> (its Popen, a pidfd), of the agent's own children
        self._unsupported = False  # no pidfds here (ENOSYS, EPERM, ...): sleep, as torchrun does

    def wait(self, procs: Iterable[Any], timeout: float) -> None:
        """Return when a running process of ``procs`` (``Popen``-like) ends, or after ``timeout`` seconds; at once
        where one has already failed or every one has ended (the look after this wait acts on it). A worker that
        finished (exit 0) while others run is not waited on again."""
        fds, watched, failed, running, ended = [], set(), False, 0, 0
        for proc in procs:
            code = proc.poll()
            if code is not None:
                failed, ended = failed or code != 0, ended + 1
                continue
            running += 1
            fd = proc.end_fd() if hasattr(proc, "end_fd") else self._pidfd(proc)
            if fd is not None and not hasattr(proc, "end_fd"):
                watched.add(proc.pid)
                if readable(fd):  # ended, yet its parent cannot reap it (a debugger attached): not waited on, or
                    continue  # the wait would end at once every time
            if fd is not None:
                fds.append(fd)
        for pid in set(self._fds) - watched:
            os.close(self._fds.pop(pid)[1])
        if failed or (ended and not running):
            return
        if not fds:
            time.sleep(timeout)
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(max(0, math.ceil(timeout * 1000)))

    def _pidfd(self, proc: Any) -> int | None:
        held = self._fds.get(proc.pid)
        if held is not None and held[0] is proc:
            return held[1]
        if held is not None:  # an ended worker's pid, reused by a new one
            os.close(self._fds.pop(proc.pid)[1])
        if self._unsupported:
            return None
        try:
            self._fds[proc.pid] = (proc, os.pidfd_open(proc.pid))
        except AttributeError as e:  # a Python without pidfd_open
            return self._no_pidfds(e)
        except OSError as e:
            if e.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL):  # an old kernel, seccomp
                return self._no_pidfds(e)
            return None  # ESRCH (not a live child: torch's look sees it), EMFILE and the like: this time only
        return self._fds[proc.pid][1]

    def _no_pidfds(self, e: BaseException) -> None:
        self._unsupported = True
        log.info("robustdist run: no pidfd for the workers (%s); the agent looks at them every --monitor-interval, "
                 "as torchrun does", e)

    def close(self) -> None:
        """Close every pidfd held (the agent's end)."""
        for _, fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
