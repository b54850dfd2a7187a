"""robustdist run's agent waits for a worker's end on pidfds (launcher.deaths): it wakes at the death, not at its
next look, and with nothing ending it waits its whole interval (no busy loop on a worker already seen ended)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from robustdist.launcher.deaths import DeathWatch

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120),
              pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds need Linux 5.3 and Python 3.9")]


def _sleeper(seconds: float = 60) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], start_new_session=True)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_wait_ends_at_a_death_not_at_its_timeout():
    watch, procs = DeathWatch(), [_sleeper(), _sleeper()]
    try:
        killer = threading.Timer(0.5, procs[1].send_signal, (signal.SIGKILL,))
        killer.start()
        start = time.monotonic()
        watch.wait(procs, 60.0)
        took = time.monotonic() - start
        killer.join()
        assert took < 30, f"the wait lasted {took:.1f} s; expected it to end at the death (0.5 s in)"
        assert procs[1].wait(10) == -signal.SIGKILL and procs[0].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()
        watch.close()


def test_an_ended_worker_is_not_waited_on_again_and_its_pidfd_is_closed():
    watch = DeathWatch()
    before = _fds()
    done, live = _sleeper(0), _sleeper()
    try:
        watch.wait([done, live], 0.05)  # opens a pidfd for each running one
        done.wait(30)
        assert done.poll() == 0
        start = time.monotonic()
        watch.wait([done, live], 0.5)  # done's pidfd stays readable for ever: it must not end this wait
        assert time.monotonic() - start >= 0.4
        assert len(_fds() - before) == 1  # live's only
        live.kill()
        live.wait()
        watch.wait([done, live], 0.05)
        assert _fds() == before
        start = time.monotonic()
        watch.wait([], 0.3)  # nothing to watch: the interval is slept, as torchrun sleeps it
        assert time.monotonic() - start >= 0.25
    finally:
        live.kill()
        live.wait()
        watch.close()


def test_a_failed_worker_or_the_end_of_every_worker_ends_the_wait_at_once():
    """A death the last look did not act on (it happened after it) is acted on at the next look without a wait, and
    so is the end of the last worker; a worker that finished while others run is not (the test above)."""
    watch, done, failed, live = DeathWatch(), _sleeper(0), _sleeper(), _sleeper()
    try:
        failed.kill()
        assert failed.wait(30) == -signal.SIGKILL and done.wait(30) == 0
        for procs in ([done, failed, live], [done]):
            start = time.monotonic()
            watch.wait(procs, 30.0)
            took = time.monotonic() - start
            assert took < 10, f"the wait lasted {took:.1f} s; expected it to return at once"
    finally:
        live.kill()
        live.wait()
        watch.close()


def test_a_dead_worker_its_parent_cannot_reap_yet_is_not_waited_on():
    """A worker that died while a debugger is attached: its pidfd is readable, but Popen.poll() says it runs until the
    debugger lets go. The wait must not end at once on it each time (the agent's loop would spin)."""

    class Traced:
        def __init__(self, proc: subprocess.Popen[bytes]) -> None:
            self.pid, self._proc = proc.pid, proc

        def poll(self) -> None:
            return None

    watch, proc = DeathWatch(), _sleeper()
    try:
        traced = Traced(proc)
        watch.wait([traced], 0.01)
        proc.kill()
        deadline = time.monotonic() + 30
        while not os.path.exists(f"/proc/{proc.pid}/stat") or _state(proc.pid) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        watch.wait([traced], 0.3)
        assert time.monotonic() - start >= 0.25
    finally:
        proc.kill()
        proc.wait()
        watch.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_new_process_with_an_ended_ones_pid_gets_a_pidfd_of_its_own():
    """The pidfd is held per process object: a later worker given a reused pid never waits on the old one's pidfd
    (readable for ever), which would turn the agent's loop into a busy one."""

    class Reused:  # a new Popen that got the pid of `first` (forced: the kernel reuses pids only after wrapping)
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def poll(self) -> None:
            return None

    before = _fds()
    watch, first = DeathWatch(), _sleeper()
    try:
        watch.wait([first], 0.01)
        assert watch._fds[first.pid][0] is first
        again = Reused(first.pid)
        watch.wait([again], 0.01)
        assert watch._fds[first.pid][0] is again and len(_fds() - before) == 1  # the old pidfd closed, a new one
    finally:
        first.kill()
        first.wait()
        watch.close()
    assert _fds() == before


def test_without_pidfds_the_wait_sleeps_its_interval(monkeypatch, caplog):
    def no_pidfd(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    watch, proc = DeathWatch(), _sleeper()
    try:
        with caplog.at_level("INFO", logger="robustdist.launcher.deaths"):
            start = time.monotonic()
            watch.wait([proc], 0.3)
        assert time.monotonic() - start >= 0.25
        assert "no pidfd for the workers" in caplog.text and "every --monitor-interval" in caplog.text
    finally:
        proc.kill()
        proc.wait()
        watch.close()


def test_a_death_between_the_agents_look_and_torchs_is_left_for_its_next_look():
    """The agent's hook looks at the workers, then torch's own look (which stops every worker at the first death it
    sees) judges that view: a worker killed between the two is running to torch, and dead at the hook's next look,
    where it is started again alone; the wait before that look does not wait for it."""
    from types import SimpleNamespace

    from robustdist.launcher.agent import Replacer

    procs = [_sleeper(), _sleeper()]
    agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers={
        lr: SimpleNamespace(proc=p) for lr, p in enumerate(procs)}))
    group = SimpleNamespace(workers=[SimpleNamespace(id=p.pid) for p in procs])
    seen: list[list[int | None]] = []

    def torchs_look(_group: object) -> str:  # as LocalElasticAgent._monitor_workers: each handler's proc.poll()
        procs[1].send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, procs[1].pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        seen.append([h.proc.poll() for h in agent._pcontext.subprocess_handlers.values()])
        return "healthy"

    replacer = Replacer(spares=0)
    try:
        assert replacer(agent, group, torchs_look) == "healthy"
        assert seen == [[None, None]], f"torch's look saw {seen}; expected both running, as the hook's look saw them"
        assert "poll" not in vars(procs[0]) and "poll" not in vars(procs[1])
        start = time.monotonic()
        replacer.wait(agent, 30.0)  # the wait before the next look: at once, not after --monitor-interval
        took = time.monotonic() - start
        assert took < 10, f"the wait before the next look lasted {took:.1f} s; expected it to return at the death"
        assert procs[1].poll() == -signal.SIGKILL and procs[0].poll() is None  # the hook's, at its next look
    finally:
        replacer.close()
        for p in procs:
            p.kill()
            p.wait()


def test_the_view_torch_judges_is_put_back_even_when_its_look_fails_and_a_stray_shadow_is_inert():
    from robustdist.runtime import _elastic_compat

    proc = _sleeper()
    try:
        with pytest.raises(RuntimeError, match="torch's look failed"):
            with _elastic_compat.workers_seen_as([proc]):
                stray = proc.poll  # what a signal between the shadow's lines could leave installed
                proc.kill()
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                assert proc.poll() is None  # inside: running, as the caller saw it
                raise RuntimeError("torch's look failed")
        assert "poll" not in vars(proc) and proc.poll() == -signal.SIGKILL
        assert stray() == -signal.SIGKILL  # out of the view, a leftover shadow answers as the process's own poll
    finally:
        proc.kill()
        proc.wait()


def test_an_error_tending_the_spare_is_named_and_the_look_goes_on(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from robustdist.launcher.agent import Replacer

    proc = _sleeper()
    agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers={0: SimpleNamespace(proc=proc)}))
    replacer = Replacer()

    def no_descriptors(*_: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(replacer.spare, "tend", no_descriptors)
    try:
        with caplog.at_level(logging.WARNING, "robustdist.launcher.agent"):
            assert replacer(agent, SimpleNamespace(workers=[SimpleNamespace(id=proc.pid)]), lambda g: "healthy") \
                == "healthy"
        assert "could not tend the warm spare (OSError: [Errno 24] Too many open files); expected to start or check " \
               "it. A replacement meanwhile starts cold" in caplog.text and "Fix:" in caplog.text
        assert "cannot read the workers' processes" not in caplog.text
    finally:
        replacer.close()
        proc.kill()
        proc.wait()
