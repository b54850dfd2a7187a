"""A training thread the teardown cannot get out of a collective (:mod:`robustdist.recovery.stuck`): judged stuck
only when it is blocked, using no CPU, in a collective; then the rank escalates and its process exits."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from robustdist.health.watchdog import HANG_EXIT_CODE
from robustdist.recovery import stuck

pytestmark = pytest.mark.timeout(120)


class _Thread:
    """A thread running ``body(stop)`` until ``stop`` is set; its ident and native id once it runs."""

    def __init__(self, body) -> None:
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(body,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self, body) -> None:
        self.native_id = threading.get_native_id()
        self.ready.set()
        body(self.stop)


def _watch(t: _Thread, judgement: stuck.Judgement, **kw) -> tuple[list[str], list[int]]:
    escalated: list[str] = []
    exits: list[int] = []
    stuck.watch(ident=t.thread.ident, native_id=t.native_id, judgement=judgement, rank=3, generation=5,
                escalate=escalated.append, exit=exits.append, **kw)
    return escalated, exits


def _c_level_wait(stop: threading.Event) -> None:
    """A wait in C (a futex), called from a script's own line as ``work.wait()`` is: torch's ``Work.wait``."""
    lock = threading.Lock()
    lock.acquire()
    work = SimpleNamespace(wait=lock.acquire)
    work.wait()


def test_a_thread_blocked_in_a_c_level_wait_escalates_and_the_process_exits(tmp_path, caplog):
    """Blocked in a futex, no CPU, on a line that calls ``.wait(``: after ``stuck_after`` the rank escalates naming
    where the thread is, the error is recorded for the restart-loop guard, and the process exits with the hang
    code."""
    from robustdist.health.restart_guard import _last_errors

    t = _Thread(_c_level_wait)
    judgement = stuck.Judgement()
    start = time.monotonic()
    with caplog.at_level("ERROR"):
        escalated, exits = _watch(t, judgement, record_to=(str(tmp_path), 2), stuck_after=0.6, exit_grace=0.2)
    took = time.monotonic() - start
    assert exits == [HANG_EXIT_CODE], exits
    assert len(escalated) == 1 and escalated[0].startswith("stuck: blocked in _c_level_wait (test_stuck.py:"), \
        escalated
    assert judgement.stuck == escalated[0]
    assert 0.6 <= took < 10, took
    assert "rank 3] in-process recovery generation 5: this rank's training thread is still blocked in " \
        "_c_level_wait (test_stuck.py:" in caplog.text and "expected every collective to end at the shutdown" \
        in caplog.text and f"exits with code {HANG_EXIT_CODE}" in caplog.text and "Fix: let the launcher" \
        in caplog.text
    assert "still blocked in _c_level_wait" in _last_errors(str(tmp_path), [2])


def test_a_stuck_thread_that_comes_out_within_the_grace_escalates_but_the_process_stays(caplog):
    """The loop learns that this rank escalated (``leave`` returns where it was stuck), and nothing exits."""
    t = _Thread(_c_level_wait)
    judgement = stuck.Judgement()
    came_out: list[str | None] = []

    def escalate_then_leave(where: str) -> None:
        escalated.append(where)
        threading.Timer(0.1, lambda: came_out.append(judgement.leave())).start()

    escalated: list[str] = []
    exits: list[int] = []
    with caplog.at_level("WARNING"):
        stuck.watch(ident=t.thread.ident, native_id=t.native_id, judgement=judgement, rank=0, generation=1,
                    escalate=escalate_then_leave, record_to=None, exit=exits.append, stuck_after=0.6, exit_grace=5)
    assert len(escalated) == 1 and exits == [] and came_out == escalated
    assert "rank 0: the training thread came out after all; not exiting, but this rank has escalated" in caplog.text


def test_a_thread_that_left_is_never_judged_nor_ended():
    judgement = stuck.Judgement()
    assert judgement.leave() is None
    assert not judgement.judge("stuck: x") and judgement.stuck is None and not judgement.exit_now()


def test_the_exit_is_bounded_when_its_last_steps_hang(tmp_path, monkeypatch):
    """A restart-loop record on a file system that stopped answering does not keep the process alive."""
    monkeypatch.setattr(stuck, "EXIT_BOUND_S", 0.5)
    monkeypatch.setattr(stuck, "record_error", lambda *a: time.sleep(30))
    exits: list[int] = []
    done = threading.Thread(target=stuck._exit, args=(0, RuntimeError("x"), (str(tmp_path), 0), exits.append),
                            daemon=True)
    start = time.monotonic()
    done.start()
    while not exits and time.monotonic() - start < 20:
        time.sleep(0.05)
    assert exits == [HANG_EXIT_CODE] and time.monotonic() - start < 10


def test_a_record_that_fails_is_said_and_the_process_still_exits(tmp_path, monkeypatch, caplog):
    def refuse(*args):
        raise OSError("read-only file system")

    monkeypatch.setattr(stuck, "record_error", refuse)
    exits: list[int] = []
    with caplog.at_level("WARNING"):
        stuck._exit(2, RuntimeError("stuck"), (str(tmp_path), 0), exits.append)
    assert exits == [HANG_EXIT_CODE]
    assert f"rank 2: could not record the error for the restart-loop guard (read-only file system); expected a " \
        f"writable checkpoint directory. Fix: check {tmp_path}." in caplog.text, caplog.text


@pytest.mark.parametrize("takes", [True, False, "raises"])
def test_the_error_is_handed_to_the_controller_before_the_exit(monkeypatch, caplog, takes):
    """Inside Ray Train the watchdog's hand-over gives the controller the named error; the process then waits (up
    to the grace) for the controller to end it, and exits by itself after. Where nothing takes it, it exits."""
    monkeypatch.setattr(stuck, "HAND_OVER_GRACE_S", 0.3)
    handed: list[BaseException] = []

    def hand_over(error: BaseException) -> bool:
        handed.append(error)
        if takes == "raises":
            raise RuntimeError("Ray's internals changed")
        return bool(takes)

    exits: list[int] = []
    error = RuntimeError("stuck")
    start = time.monotonic()
    with caplog.at_level("WARNING"):
        stuck._exit(1, error, None, exits.append, hand_over)
    assert handed == [error] and exits == [HANG_EXIT_CODE]
    assert (time.monotonic() - start >= 0.3) == (takes is True)
    assert ("rank 1: handed the error to the launcher's controller (Ray Train)" in caplog.text) == (takes is True)
    assert ("could not hand the error to the launcher's controller (RuntimeError: Ray's internals changed)"
            in caplog.text) == (takes == "raises")


@pytest.mark.parametrize("what", ["sleep", "compute", "queue", "store-poll"])
def test_a_thread_sleeping_computing_or_waiting_elsewhere_is_not_judged(what):
    """Only a collective's wait is judged: a ``sleep`` in the script, a step computing, a loader's queue and a
    store's wait (a poll, not a futex) come back by themselves, or the decision bound ends the wait."""
    import queue

    def body(stop: threading.Event) -> None:
        if what == "sleep":
            time.sleep(4)
        elif what == "queue":
            with contextlib.suppress(queue.Empty):
                queue.Queue().get(timeout=4)
        elif what == "store-poll":
            store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
            with contextlib.suppress(Exception):
                store.wait(["never-set"], timedelta(seconds=4))
        else:
            x = 0
            while not stop.is_set():
                x += 1

    t = _Thread(body)
    judgement = stuck.Judgement()
    threading.Timer(3.0, judgement.left.set).start()  # 5 times stuck_after
    escalated, exits = _watch(t, judgement, record_to=None, stuck_after=0.6, exit_grace=0.2)
    t.stop.set()
    assert escalated == [] and exits == []


def test_the_thread_s_state_cpu_time_and_wait_are_read_from_proc(tmp_path):
    own = stuck.sample(threading.get_native_id())
    assert own is not None and own.state == "R" and own.ticks >= 0 and own.futex is not True
    assert stuck.sample(2 ** 22 + 12345) is None  # no such thread
    task = tmp_path / "7"
    task.mkdir()
    (task / "stat").write_text("7 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14\n")  # a name with ')' and spaces
    assert stuck.sample(7, task_dir=str(tmp_path)) == stuck.Sample("S", 11 + 12, None)  # no wchan: unknown
    (task / "wchan").write_text("futex_wait_queue")
    assert stuck.sample(7, task_dir=str(tmp_path)) == stuck.Sample("S", 23, True)
    (task / "wchan").write_text("do_poll")
    assert stuck.sample(7, task_dir=str(tmp_path)).futex is False
    (task / "stat").write_text("7 (x) S 1 2\n")  # truncated
    assert stuck.sample(7, task_dir=str(tmp_path)) is None


_SCRIPT = r'''
import os, signal, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from robustdist.recovery.generations import Generation
from robustdist.recovery.faults import declare_fault
from robustdist.runtime.group_sockets import GroupSockets

rank, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
sockets = GroupSockets(exclude_ports=[port])
with sockets.recording():
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dist.barrier()
g = Generation("t", 0)
g.sockets, g.trainer, g.record_to = sockets, (threading.get_ident(), threading.get_native_id()), (root, 0)
g.decision_bound = 5.0  # rank 0 waits this long for rank 1's decision (never given: it stays stopped)
g.watch_on(store, 30)
dist.barrier()
big = torch.ones(200 << 20, dtype=torch.uint8)
if rank == 1:  # posts its receive, then stops: the send is under way when rank 0 shuts its connections down
    time.sleep(0.5)
    dist.irecv(torch.empty_like(big), 0)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(300)
fault = dict(generation=0, rank=1, world_size=2, what="stopped", scope="t")
threading.Timer(1.5, declare_fault, (store,), fault).start()
store.set("sending", str(time.time()))
dist.send(big, 1)
print("OUT OF THE SEND", flush=True)
'''


@pytest.mark.processes
def test_a_send_to_a_stopped_peer_that_the_shutdown_does_not_end_escalates_in_seconds(tmp_path):
    """Real gloo: rank 0 sends 200 MB to a rank that stopped after posting its receive; a fault is declared and
    rank 0's fault callback shuts the group's connections down. Gloo does not end the send (the group's timeout is
    60 s); rank 0 records its decision "escalate (stuck: ...)" and exits with the hang code within seconds."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    server = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2])] + sys.path)}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(server.port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=50)
        sent = float(server.get("sending"))
        assert procs[0].returncode == HANG_EXIT_CODE, (procs[0].returncode, out, err[-3000:])
        assert "OUT OF THE SEND" not in out
        decision = server.get("t/0/decision/0").decode()
        assert decision.startswith("escalate (stuck: blocked in send (distributed_c10d.py:"), decision
        assert time.time() - sent < 30, "not within seconds of the fault (the group's timeout is 60 s)"
        assert "training thread is still blocked in send (distributed_c10d.py:" in err and "Fix:" in err, err[-3000:]
        assert "Current thread" in err or "Thread 0x" in err  # every thread's stack, for the post-mortem
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
