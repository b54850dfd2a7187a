"""The warm spare of ``robustdist run``'s agent: one process per node that has done a worker's slow start
(:mod:`.spare`), kept while the run can take a replacement, and turned into the next worker killed on the node.

Where it can, the spare forks the replacement (its environment, command and output become the worker's) and stays
warm for the next one (:mod:`.forked`: the agent watches the forked worker through the spare); otherwise it becomes
the replacement itself, and another is started :data:`SPARE_PAUSE_S` later. Without one (``--spares 0``, a spare
that died, a worker command a spare cannot run, NUMA binding) the replacement starts cold, as torchrun starts a
worker. :class:`~robustdist.launcher.agent.Replacer` holds one :class:`WarmSpare`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from robustdist.launcher import spare as _spare
from robustdist.launcher.forked import Channel, ForkedWorker, NoAnswer, readable
from robustdist.runtime import _elastic_compat

__all__ = ["FORK_REPLY_S", "SPARE_LOOK_S", "SPARE_PAUSE_S", "SPARE_TRIES", "SPARE_WAIT_S", "WarmSpare", "describe_exit"]

log = logging.getLogger(__name__)  # the launcher is no rank: no rank prefix

SPARE_LOOK_S = 2.0  # without a spare: how often the agent asks whether the run can take a replacement
# after a spare became a worker: no new one before this (its imports would slow the new worker; even at idle priority
# they share the caches and the memory bandwidth with it)
SPARE_PAUSE_S = 10.0
SPARE_TRIES = 3  # spares in a row that end before they are warm: then no more (replacements start cold)
FORK_REPLY_S = 5.0  # a forking spare's answer to an order (its pid) within this, or the replacement starts cold
# a death while the spare warms: the agent waits this long for it to say it is warm before starting the worker cold
# (a spare half warm beats a cold start, which would also compete with it for the CPU)
SPARE_WAIT_S = 2.0


def describe_exit(code: int) -> str:
    """``signal 9 (SIGKILL)`` for a negative ``Popen.returncode``, ``exit code 1`` otherwise."""
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class WarmSpare:
    """The agent's warm spare (``spares``: 0 keeps none): :meth:`start_with_workers` at each attempt's start,
    :meth:`tend` at each look, :meth:`take` for a dead worker, :meth:`close` at the launcher's end."""

    def __init__(self, spares: int = 1) -> None:
        self.spares = spares
        self.proc: subprocess.Popen[bytes] | None = None
        self.warm = False  # the spare has said it is warm
        self.channel: Channel | None = None  # what a spare that forks its workers says (its pipe, once warm)
        self.workers_started = 0.0  # time.monotonic() when this attempt's workers were started
        self._after = 0.0  # time.monotonic() before which no spare is started (a look, or a pause)
        self._ready: int | None = None  # the read end of the spare's "warm" pipe, until it has said so
        self._orders = 0  # orders sent to forking spares (their ids)
        self._started = 0.0
        self._waited_look = -1  # the look in which a death last waited for a warming spare
        self._failures = 0  # spares in a row that ended before they were warm

    def start_with_workers(self, agent: Any) -> None:
        """At an attempt's start: a spare started with the workers (:data:`.spare.WITH_WORKERS`) where none is
        alive (and a restart is left)."""
        self.workers_started = time.monotonic()
        if self.spares and (self.proc is None or self.proc.poll() is not None):
            self._drop()  # one that ended: counted first (SPARE_TRIES)
            if self._failures < SPARE_TRIES and _elastic_compat.restarts_left(agent) > 0:
                self._start(with_workers=True)

    def taken_from(self) -> str:
        """How the last :meth:`take` started its worker, for the agent's log line."""
        return (", from the warm spare" if self.channel is None else
                f", forked by the warm spare (pid {self.proc.pid if self.proc is not None else '?'})")

    def close(self) -> None:
        """End the spare, if one is waiting (the launcher's end; the spare also ends when its input closes)."""
        spare, self.proc = self.proc, None
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None
        if spare is not None and spare.poll() is None:
            try:  # its session only: the workers it forked lead sessions of their own (torchrun stopped them)
                os.killpg(spare.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                spare.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel: the launcher ends anyway
                log.warning("robustdist run: the warm spare (pid %d) did not end within 10 s of SIGKILL", spare.pid)
        self._drop_channel()

    def tend(self, agent: Any, in_process: Callable[[], bool]) -> None:
        """Keep one warm spare while the run can take a replacement (looking at most every :data:`SPARE_LOOK_S`)."""
        spare = self.proc
        self.look_ready()
        if not self.spares or (spare is not None and spare.poll() is None) or time.monotonic() < self._after:
            return
        if spare is not None:
            self._drop()
        self._after = time.monotonic() + SPARE_LOOK_S
        if self._failures >= SPARE_TRIES or _elastic_compat.restarts_left(agent) <= 0 or not in_process():
            return
        self._start(with_workers=False)

    def _drop(self) -> None:
        """Forget a spare that ended (counted as a failure if it ended before it was warm)."""
        spare = self.proc
        if spare is None:
            return
        self._failures += 0 if self.warm else 1
        log.warning("robustdist run: the warm spare (pid %d) ended with %s%s", spare.pid,
                    describe_exit(spare.returncode), "; starting another" if self._failures < SPARE_TRIES else
                    f"; {SPARE_TRIES} in a row ended before they were warm (see the launcher's stderr above), so "
                    "no more: replacements start cold. Fix: run `python -m robustdist.launcher.spare` by hand")
        self.proc, self.warm = None, False
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None
        self._drop_channel()

    def _start(self, *, with_workers: bool) -> None:
        """Start a spare (``with_workers``: as the workers start, :data:`.spare.WITH_WORKERS`)."""
        ready_r, ready_w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-u", "-m", "robustdist.launcher.spare",
                                            *([_spare.WITH_WORKERS] if with_workers else [])], cwd="/",
                                           stdin=subprocess.PIPE, start_new_session=True, pass_fds=(ready_w,),
                                           env={**os.environ, _spare.READY_FD_ENV: str(ready_w)})
        except (OSError, subprocess.SubprocessError) as e:  # no process now (memory, limits): the next look tries again
            os.close(ready_r)
            self._failures += 1
            log.warning("robustdist run: could not start a warm spare (%s: %s); expected a new Python process. "
                        "Replacements start cold meanwhile.", type(e).__name__, str(e)[:200])
            return
        finally:
            os.close(ready_w)
        self._ready, self._started = ready_r, time.monotonic()
        log.info("robustdist run: started a warm spare (pid %d): it starts the next worker killed on this node",
                 self.proc.pid)

    def look_ready(self) -> None:
        """Say when the spare is warm (a byte on its pipe; nothing to wait for: an order waits in its input)."""
        if self._ready is None or not readable(self._ready):
            return
        said = os.read(self._ready, 2)  # the readiness byte, then FORKS from a spare that forks its workers
        forks = said[1:] == _spare.FORKS and self.proc is not None
        if forks:
            assert self.proc is not None
            self.channel = Channel(self._ready, self.proc.pid)  # the pipe goes on: the forked workers' news
        else:
            os.close(self._ready)
        self._ready, said = None, said[:1]
        how = {_spare.READY_WITH_WORKERS: f"started with the workers: warmed at idle priority for up to "
                                          f"{_spare.WITH_WORKERS_PATIENCE_S:g} s, then at theirs",
               _spare.READY_IDLE: "warmed at idle priority",
               _spare.READY_LATE: f"warmed at idle priority, then at the workers' priority after "
                                  f"{_spare.IDLE_PATIENCE_S:g} s: the host had little idle CPU time",
               _spare.READY: "warmed at the workers' priority: it could not return from SCHED_IDLE (without "
                             "CAP_SYS_NICE, RLIMIT_NICE must be at least 20 - nice)"}
        self.warm = said in how
        if self.warm and self.proc is not None:
            self._failures = 0
            now = time.monotonic()
            log.info("robustdist run: the warm spare (pid %d) is ready after %.1f s, %.1f s after this attempt's "
                     "workers started (%s%s)", self.proc.pid, now - self._started, now - self.workers_started,
                     how[said],
                     "; it forks each replacement and stays warm" if forks else
                     "; it becomes the next replacement itself: it cannot fork here (Linux's pidfd_open missing, or "
                     "a CUDA driver loaded in it)")
        elif said and self.proc is not None:
            log.warning("robustdist run: the warm spare (pid %d) said %r on its pipe; expected one of %s. It is not "
                        "used: replacements start cold until it ends. Fix: run the launcher with the same Python and "
                        "robustdist as the workers (a bug if they are the same: report it)", self.proc.pid, said,
                        ", ".join(repr(k) for k in sorted(how)))

    def take(self, agent: Any, worker: Any, extra: dict[str, str], look: int) -> int | None:
        """Turn the warm spare into ``worker`` (None where there is none, or it cannot run the worker's command)."""
        spare = self.proc
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        launch = _elastic_compat.worker_launch(agent, worker)
        if launch["entrypoint"] != sys.executable or launch["numa"] is not None or not _spare.usable(
                list(launch["args"])):
            return None
        if not self.warm and self._ready is not None and self._waited_look != look:
            # still warming: once per look (not per dead rank), a moment more is cheaper than a cold start, which
            # would compete with it for the CPU
            self._waited_look = look
            readable(self._ready, SPARE_WAIT_S)
            self.look_ready()
        if not self.warm or spare.poll() is not None:
            return None  # still warming after the wait: a cold start now
        order = {"env": {**os.environ, **launch["env"], **extra}, "args": list(launch["args"]), "cwd": os.getcwd(),
                 "stdout": launch["stdout"], "stderr": launch["stderr"]}
        if self.channel is not None:
            return self._fork(agent, worker, spare, order)
        try:
            spare.stdin.write(json.dumps(order).encode() + b"\n")
            spare.stdin.close()
        except OSError as e:  # it died meanwhile
            log.info("robustdist run: the warm spare could not take the order (%s); starting the worker cold", e)
            return None
        self.proc, self.warm, self._after = None, False, time.monotonic() + SPARE_PAUSE_S
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None
        return _elastic_compat.adopt_worker(agent, worker, spare)

    def _fork(self, agent: Any, worker: Any, spare: subprocess.Popen[bytes], order: dict[str, Any]) -> int | None:
        """The forking spare's child becomes ``worker``; the spare stays warm (None: start the worker cold). The child
        runs only once the agent has its pid and lets it go; a spare that does not answer in time is ended (with any
        child it forked late: a child not let go ends when its spare does)."""
        assert self.channel is not None
        self._orders += 1
        oid = str(self._orders)
        got: int | str = NoAnswer("its input did not take the order")
        if self._send(spare, {**order, "id": oid}):
            got = self.channel.forked(oid, FORK_REPLY_S)
        if isinstance(got, int) and not self._send(spare, {"go": oid}):
            got = NoAnswer("its input did not take the word to go")
        if isinstance(got, str):
            silent = isinstance(got, NoAnswer)  # ended, so that a child it forks late never runs
            log.warning("robustdist run: the warm spare (pid %d) did not fork rank %d (%s); expected the forked "
                        "worker's pid within %g s. Rank %d starts cold%s. Fix: none needed; if this repeats, see the "
                        "launcher's stderr for the spare's own error, or run with --spares 0", spare.pid,
                        worker.global_rank, got[:300], FORK_REPLY_S, worker.global_rank,
                        "; the spare is ended (another follows)" if silent else "")
            if silent:
                self._end(spare)
            return None
        forked = ForkedWorker(got, self.channel)
        try:
            return _elastic_compat.adopt_worker(agent, worker, forked)
        except BaseException:
            forked.kill()  # never a rank running unwatched beside the one torchrun then starts
            raise

    def _send(self, spare: subprocess.Popen[bytes], message: dict[str, Any]) -> bool:
        """One line to the spare within :data:`FORK_REPLY_S` (its input never blocks the agent's monitor)."""
        if spare.stdin is None:
            return False
        data, fd = json.dumps(message).encode() + b"\n", spare.stdin.fileno()
        deadline = time.monotonic() + FORK_REPLY_S
        try:
            os.set_blocking(fd, False)
            while data:
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(int(left * 1000)):
                    return False
                try:
                    data = data[os.write(fd, data):]
                except BlockingIOError:
                    continue
        except OSError:  # it died meanwhile
            return False
        return True

    def _end(self, spare: subprocess.Popen[bytes]) -> None:
        """Stop using (and end) a spare that did not answer: the agent starts another later."""
        try:
            os.killpg(spare.pid, signal.SIGKILL)
        except OSError:
            pass
        self._after = time.monotonic() + SPARE_PAUSE_S

    def _drop_channel(self) -> None:
        """The spare is gone: read what it said last (its forked workers' ends), for the workers that still ask."""
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.pump()
            if not channel.closed and (self.proc is None or self.proc.poll() is not None):
                channel.pump(1.0)
