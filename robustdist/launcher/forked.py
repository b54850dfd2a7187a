"""The agent's side of a spare that forks its workers (:func:`robustdist.launcher.spare.serve`).

A worker forked by the warm spare is the spare's child, not the agent's: only the spare can wait for it and learn how
it ended. :class:`Channel` reads what the spare says on its pipe (``P <id> <pid>`` for the child it forked for order
``id``, ``X <id> <reason>`` for an order it did not run, ``E <pid> <code>`` when a worker ended; replies are matched to
orders by id, so a late one is never taken for the next order's); :class:`ForkedWorker` is the ``Popen`` that
torchrun's process context watches and stops in that worker's place (``poll``, ``wait``, ``send_signal``; torch's
handler stops it with ``killpg``: the child made its session before the spare said its pid). Descriptors are
waited on with ``poll(2)``, never ``select(2)``, whose 1024 limit a node-0 agent holding every rank's store
connection can pass.

A worker's end is seen through a pidfd the agent opened on it, whatever the spare does. Its exit code is what the
spare says; where the spare has not said it (stopped, say: SIGSTOP, or starved), the ended worker is the spare's
unreaped child, and its code is read from ``/proc/<pid>/stat`` (the ``exit_code`` field, Linux 3.5+), which holds it
until its parent reaps it. Only where neither is there (the spare died first and its child was reaped by another) is
it reported as exit code 1 (torchrun's path then restarts the workers, never a replacement), with a warning saying
why.
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import subprocess
import time

__all__ = ["Channel", "ForkedWorker", "NoAnswer", "readable"]

log = logging.getLogger(__name__)  # the launcher is no rank: no rank prefix
UNKNOWN_EXIT = 1
_LINE = re.compile(rb"(P) ([A-Za-z0-9-]{1,40}) (\d{1,10})|(X) ([A-Za-z0-9-]{1,40}) (.{0,400})"
                   rb"|(E) (\d{1,10}) (-?\d{1,4})")
_MAX_BUFFER = 8192  # a line is short (a reason is cut at 400 bytes): more without a line end is no spare of ours


class NoAnswer(str):
    """Why there is no worker for an order when the spare gave no answer of its own (it ended, or said nothing)."""


def readable(fd: int, timeout: float = 0.0) -> bool:
    """Whether ``fd`` has something to read (or its writer is gone) within ``timeout`` seconds."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000))))


class Channel:
    """What one forking spare says on its pipe (``fd``, owned: closed by :meth:`close`)."""

    def __init__(self, fd: int, spare_pid: int) -> None:
        self.fd: int | None = fd
        self.spare_pid = spare_pid
        self.ended: dict[int, int] = {}  # pid -> exit code (Popen's form), until its ForkedWorker takes it
        self._replies: dict[str, int | str] = {}  # order id -> the pid forked for it, or why none was
        self._pending = b""

    @property
    def closed(self) -> bool:
        return self.fd is None

    def pump(self, timeout: float = 0.0) -> None:
        """Read what the spare has said (waiting at most ``timeout`` for the first bytes); its pipe's end (the spare
        gone) closes the channel, once everything it said before is read."""
        while self.fd is not None and readable(self.fd, timeout):
            timeout = 0.0
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                break
            self._pending += chunk
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                self._take(line)
            if len(self._pending) > _MAX_BUFFER:  # not the spare's protocol: stop listening to it
                log.warning("robustdist run: the warm spare (pid %d) wrote %d bytes without a line end on its pipe; "
                            "expected short lines. It is no longer read. Fix: run the launcher with the same Python "
                            "and robustdist as the workers", self.spare_pid, len(self._pending))
                self.close()

    def _take(self, line: bytes) -> None:
        m = _LINE.fullmatch(line.strip())
        if m is None:
            log.warning("robustdist run: the warm spare (pid %d) said %r; expected P <id> <pid>, X <id> <reason> or "
                        "E <pid> <code>. Ignored. Fix: run the launcher with the same Python and robustdist as the "
                        "workers", self.spare_pid, line[:80])
        elif m.group(1):
            self._replies[m.group(2).decode()] = int(m.group(3))
        elif m.group(4):
            self._replies[m.group(5).decode()] = m.group(6).decode("utf-8", "replace")
        else:
            self.ended[int(m.group(8))] = int(m.group(9))

    def forked(self, oid: str, timeout: float) -> int | str:
        """The pid of the child the spare forked for order ``oid``, or why there is none (its reason; it said nothing
        within ``timeout`` s; it ended). Replies to other orders are left (and dropped with the spare)."""
        deadline = time.monotonic() + timeout
        while oid not in self._replies:
            left = deadline - time.monotonic()
            if self.closed:
                return NoAnswer("the spare ended")
            if left <= 0:
                return NoAnswer(f"the spare said nothing within {timeout:g} s")
            self.pump(left)
        return self._replies.pop(oid)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ForkedWorker:
    """A worker the spare forked, as torchrun's process context uses a ``Popen``."""

    def __init__(self, pid: int, channel: Channel) -> None:
        self.pid = pid
        self.args = [f"<forked by the warm spare {channel.spare_pid}>"]
        self.returncode: int | None = None
        self._channel = channel
        try:  # the worker's end, where the spare cannot report it any more (it died first)
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # already gone (and reaped): the spare reports it
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._channel.pump()
        if self.pid in self._channel.ended:
            self._set(self._channel.ended.pop(self.pid))
        elif self._gone() and (code := _zombie_exit(self.pid)) is not None:  # ended; the spare has not said it
            self._set(code)
        elif self._channel.closed and self._gone():
            log.warning("robustdist run: worker pid %d ended after the warm spare that forked it (pid %d); its exit "
                        "code is unknown (only its parent could read it), taken as exit code %d: every worker is "
                        "restarted rather than this one replaced. Fix: none needed; see the worker's log",
                        self.pid, self._channel.spare_pid, UNKNOWN_EXIT)
            self._set(UNKNOWN_EXIT)
        return self.returncode

    def end_fd(self) -> int | None:
        """What to wait on for this worker's end (:class:`~robustdist.launcher.deaths.DeathWatch`), once :meth:`poll`
        said it runs: its pidfd while it runs, then the spare's pipe, until the spare says how it ended."""
        if self._pidfd is not None and not readable(self._pidfd):
            return self._pidfd
        return self._channel.fd

    def _gone(self) -> bool:
        if self._pidfd is None:
            return True
        return readable(self._pidfd)

    def _set(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:  # through the pidfd where there is one: never a later process that reuses the pid
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, sig)
                else:
                    os.kill(self.pid, sig)
            except ProcessLookupError:  # ended meanwhile
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _zombie_exit(pid: int) -> int | None:
    """How ``pid`` ended, as ``Popen.returncode`` says it (``-signal`` or the exit code), while it is a zombie its
    parent has not reaped (the pid cannot be reused before that); None where it is not one (running, or reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read(4096).rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 50 or fields[0] != b"Z" or not fields[49].isdigit():
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF
