"""The warm spare that forks its workers (robustdist.launcher.spare.serve) and the agent's side of it
(robustdist.launcher.forked): a real spare process, real forked workers; what the spare says on its pipe, read as
the agent reads it; orders matched to replies by id, a child that runs only once let go, hostile lines and orders."""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from robustdist.launcher import spare
from robustdist.launcher.deaths import DeathWatch
from robustdist.launcher.forked import UNKNOWN_EXIT, Channel, ForkedWorker, NoAnswer

pytestmark = pytest.mark.skipif(not spare.forks(), reason="forking spares need Linux's pidfd_open")

WORKER = """
import json, os, sys, time
import numpy, torch
json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "env": dict(os.environ),
           "argv": sys.argv, "cwd": os.getcwd(), "numpy": numpy.random.rand(), "torch": torch.rand(1).item()},
          open(sys.argv[1] + ".tmp", "w"))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(float(sys.argv[2]))
print("worker out", flush=True)
raise SystemExit(int(sys.argv[3]))
"""


def _start() -> tuple[subprocess.Popen[bytes], Channel]:
    """A spare as the agent starts it, once it has said it is warm and forks."""
    return _ready(*_launch())


def _launch() -> tuple[subprocess.Popen[bytes], int]:
    """A spare as the agent starts it, warming (it has said nothing yet); the read end of its ready pipe."""
    ready_r, ready_w = os.pipe()
    env = {**os.environ, spare.READY_FD_ENV: str(ready_w), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "robustdist.launcher.spare"], stdin=subprocess.PIPE,
                            pass_fds=(ready_w,), env=env, cwd="/", start_new_session=True)
    os.close(ready_w)
    return proc, ready_r


def _ready(proc: subprocess.Popen[bytes], ready_r: int) -> tuple[subprocess.Popen[bytes], Channel]:
    """A spare from :func:`_launch`, once it has said it is warm and forks."""
    try:
        assert select.select([ready_r], [], [], 120)[0], "the spare was not warm within 120 s"
        said = os.read(ready_r, 2)
    except BaseException:
        proc.kill()
        proc.wait()
        os.close(ready_r)
        raise
    assert said[:1] in (spare.READY, spare.READY_IDLE, spare.READY_LATE) and said[1:] == spare.FORKS, said
    return proc, Channel(ready_r, proc.pid)


def _send(proc: subprocess.Popen[bytes], message: object) -> None:
    assert proc.stdin is not None
    proc.stdin.write((message if isinstance(message, bytes) else json.dumps(message).encode()) + b"\n")
    proc.stdin.flush()


def _order(proc: subprocess.Popen[bytes], tmp_path: Path, oid: str, sleep: float, code: int) -> None:
    script = tmp_path / "worker.py"
    if not script.exists():  # written once: a worker reading it while the next order is sent never sees it truncated
        script.write_text(WORKER)
    _send(proc, {"id": oid, "env": {"PATH": os.environ.get("PATH", ""), "ORDER": oid, "OMP_NUM_THREADS": "1"},
                 "args": ["-u", str(script), str(tmp_path / f"{oid}.json"), str(sleep), str(code)],
                 "cwd": str(tmp_path), "stdout": str(tmp_path / f"{oid}.out"), "stderr": str(tmp_path / f"{oid}.err")})


def _worker(proc: subprocess.Popen[bytes], channel: Channel, tmp_path: Path, oid: str, sleep: float,
            code: int) -> ForkedWorker:
    """Order a worker, take its pid, let it go."""
    _order(proc, tmp_path, oid, sleep, code)
    pid = channel.forked(oid, 30)
    assert isinstance(pid, int), pid
    _send(proc, {"go": oid})
    return ForkedWorker(pid, channel)


def _seen(path: Path) -> dict:
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() >= deadline:
            said = {p.name: p.read_text()[-2000:] for p in (path.with_suffix(".out"), path.with_suffix(".err"))
                    if p.exists()}
            pytest.fail(f"{path.name}: the worker did not start within 60 s; its output: {said}")
        time.sleep(0.02)
    return json.loads(path.read_text())


def _stop(proc: subprocess.Popen[bytes], channel: Channel, *workers: ForkedWorker) -> None:
    for w in workers:
        w.kill()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    channel.close()


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_the_spare_forks_each_order_reports_each_end_and_refuses_what_is_no_order(tmp_path):
    proc, channel = _start()
    workers: list[ForkedWorker] = []
    try:
        workers.append(first := _worker(proc, channel, tmp_path, "1", 0.2, 3))
        assert first.wait(60) == 3 and first.poll() == 3
        seen = _seen(tmp_path / "1.json")
        # the worker: the spare's child, leading a session of its own, with exactly the order's environment
        assert (seen["pid"], seen["ppid"], seen["sid"]) == (first.pid, proc.pid, first.pid)
        assert seen["env"]["ORDER"] == "1" and spare.READY_FD_ENV not in seen["env"] and "HOME" not in seen["env"]
        assert seen["cwd"] == str(tmp_path) and seen["argv"][1:] == [str(tmp_path / "1.json"), "0.2", "3"]
        assert (tmp_path / "1.out").read_text() == "worker out\n"
        probe = "import torch; print(torch.initial_seed(), torch.rand(1).item())"
        fresh = subprocess.run([sys.executable, "-c", probe], text=True, capture_output=True, check=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        fixed = int(fresh.stdout.split()[0]) == spare.TORCH_FIXED_SEED
        if fixed:  # torch's default generator as in a fresh process (the warm-up's layer drew from it; put back)
            assert seen["torch"] == float(fresh.stdout.split()[1])
        # hostile orders: each refused with its reason, under its id where it has one; the spare forks the next one
        for bad, oid in ((b"not json", "-"), (b'{"id": "7", "env": 1, "args": ["x.py"]}', "7"),
                         (b'{"id": "8", "env": {}, "args": "x.py"}', "8"),
                         (b'{"id": "9", "env": {}, "args": ["--version"]}', "9"), (b"[" * 100000, "-"),
                         (b'"\xff\xfe"', "-"), (b'{"id": "../x", "env": {}, "args": ["x.py"]}', "-")):
            _send(proc, bad)
            got = channel.forked(oid, 30)
            assert isinstance(got, str) and not isinstance(got, NoAnswer), got
            assert got.split(":")[0] in ("ValueError", "RecursionError", "JSONDecodeError", "UnicodeDecodeError"), got
        workers.append(killed := _worker(proc, channel, tmp_path, "2", 60, 0))
        other = _seen(tmp_path / "2.json")
        assert other["numpy"] != seen["numpy"]  # NumPy reseeded in each child, as a fresh process would draw it
        assert (other["torch"] == seen["torch"]) is fixed  # torch's too, where a fresh process draws its seed
        assert killed.poll() is None
        killed.send_signal(signal.SIGKILL)  # as the OOM killer would: the spare reads the signal, as a parent can
        assert killed.wait(30) == -signal.SIGKILL
        workers.append(slow := _worker(proc, channel, tmp_path, "3", 60, 0))
        with pytest.raises(subprocess.TimeoutExpired):
            slow.wait(0.2)
        slow.terminate()
        assert slow.wait(30) == -signal.SIGTERM and proc.poll() is None
    finally:
        _stop(proc, channel, *workers)


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_child_runs_only_once_let_go_and_a_late_reply_is_never_the_next_orders(tmp_path):
    proc, channel = _start()
    workers: list[ForkedWorker] = []
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # a spare stalled past the agent's patience
        _order(proc, tmp_path, "1", 60, 0)
        assert channel.forked("1", 0.5) == NoAnswer("the spare said nothing within 0.5 s")
        os.kill(proc.pid, signal.SIGCONT)
        workers.append(second := _worker(proc, channel, tmp_path, "2", 60, 0))
        assert _seen(tmp_path / "2.json")["pid"] == second.pid  # order 2's child, not order 1's late one
        late = channel.forked("1", 30)
        assert isinstance(late, int) and late != second.pid
        time.sleep(0.5)
        assert not (tmp_path / "1.json").exists()  # forked, never let go: it has not run
        _send(proc, {"drop": "1"})
        held = ForkedWorker(late, channel)
        assert held.wait(30) == spare.HELD_EXIT and not (tmp_path / "1.json").exists()
        second.kill()
        assert second.wait(30) == -signal.SIGKILL
        # a held child whose spare dies never runs either: its go pipe ends with the spare
        _order(proc, tmp_path, "3", 60, 0)
        pid = channel.forked("3", 30)
        assert isinstance(pid, int)
        orphan = ForkedWorker(pid, channel)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert orphan.wait(30) == UNKNOWN_EXIT and not (tmp_path / "3.json").exists()
    finally:
        _stop(proc, channel, *workers)


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_the_end_of_its_input_waits_for_its_workers_and_a_dead_spares_worker_ends_with_its_code_or_unknown(tmp_path, caplog):
    proc, channel = _start()
    following = _launch()  # the second part's spare warms while the first part waits for its workers
    workers: list[ForkedWorker] = []
    try:
        workers.append(last := _worker(proc, channel, tmp_path, "1", 20.0, 0))
        workers.append(killed := _worker(proc, channel, tmp_path, "2", 60, 0))
        _order(proc, tmp_path, "3", 60, 0)  # held when the input ends: it never runs
        held = channel.forked("3", 30)
        assert isinstance(held, int)
        assert proc.stdin is not None
        proc.stdin.close()  # the agent's end: the spare waits for the workers it forked (no zombie), then ends
        _seen(tmp_path / "2.json")
        killed.kill()  # still reported at once while the spare waits for the others
        t = time.monotonic()
        assert killed.wait(15) == -signal.SIGKILL and time.monotonic() - t < 12  # not once worker 1 ends (20 s)
        assert ForkedWorker(held, channel).wait(10) == spare.HELD_EXIT and not (tmp_path / "3.json").exists()
        assert proc.wait(60) == 0 and last.wait(10) == 0
    except BaseException:
        os.killpg(following[0].pid, signal.SIGKILL)
        following[0].wait()
        os.close(following[1])
        raise
    finally:
        _stop(proc, channel, *workers)
    proc, channel = _ready(*following)
    try:
        orphan = _worker(proc, channel, tmp_path, "4", 1.5, 7)
        _seen(tmp_path / "4.json")
        os.killpg(proc.pid, signal.SIGKILL)  # the spare dies first: only a pidfd still sees the worker end
        proc.wait()
        with caplog.at_level(logging.WARNING, "robustdist.launcher.forked"):
            code = orphan.wait(60)
        assert channel.closed
        # its code, read while whoever adopted it has not reaped it yet; else unknown, and said so
        unknown = f"worker pid {orphan.pid} ended after the warm spare that forked it (pid {proc.pid}); its exit " \
                  "code is unknown"
        assert (code == 7 and unknown not in caplog.text) or (
            code == UNKNOWN_EXIT and unknown in caplog.text and "Fix:" in caplog.text), (code, caplog.text)
    finally:
        _stop(proc, channel)


@pytest.mark.timeout(60)
def test_the_channel_reads_split_lines_by_id_and_names_what_it_cannot(caplog):
    read, write = os.pipe()
    channel = Channel(read, 4242)
    try:
        os.write(write, b"P 2 12\nX 1 ValueError: not an ord")
        assert channel.forked("2", 1) == 12
        os.write(write, b"er\nE 12 -9\nE 13 0\nhello\n")
        with caplog.at_level(logging.WARNING, "robustdist.launcher.forked"):
            assert channel.forked("1", 1) == "ValueError: not an order"
        assert channel.ended == {12: -9, 13: 0}
        assert "the warm spare (pid 4242) said b'hello'; expected P <id> <pid>, X <id> <reason> or E <pid> <code>" \
            in caplog.text
        assert channel.forked("3", 0.1) == NoAnswer("the spare said nothing within 0.1 s")
        os.write(write, b"E 14 " + b"7" * 9000)  # no line end: not the spare's protocol (within the pipe's buffer)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "robustdist.launcher.forked"):
            channel.pump()
        assert channel.closed and "without a line end" in caplog.text
        assert channel.forked("3", 1) == NoAnswer("the spare ended") and 14 not in channel.ended
    finally:
        channel.close()
        os.close(write)
    read, write = os.pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > 1600:  # a descriptor past select()'s 1024, as a busy agent holds
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
        os.dup2(read, 1500)
        os.close(read)
        read = 1500
    channel = Channel(read, 4242)
    try:
        os.write(write, b"E 20 3\n")
        os.close(write)  # the spare's end: what it said before is still read
        channel.pump()
        assert channel.closed and channel.ended == {20: 3}
    finally:
        channel.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(60)
def test_a_spare_that_does_not_answer_is_ended_and_the_rank_starts_cold(monkeypatch, caplog):
    from types import SimpleNamespace

    from robustdist.launcher import warm_spare

    kept = warm_spare.WarmSpare()
    order_r, order_w = os.pipe()
    said_r, said_w = os.pipe()
    ended: list[int] = []
    monkeypatch.setattr(warm_spare, "FORK_REPLY_S", 0.2)
    monkeypatch.setattr(kept, "_end", lambda s: ended.append(s.pid))
    kept.channel = Channel(said_r, 4242)
    stalled = SimpleNamespace(pid=4242, stdin=os.fdopen(order_w, "wb"))
    try:
        with caplog.at_level(logging.WARNING, "robustdist.launcher.warm_spare"):
            got = kept._fork(None, SimpleNamespace(global_rank=1), stalled, {"env": {}, "args": ["x.py"]})
        assert got is None and ended == [4242]
        assert json.loads(os.read(order_r, 4096).splitlines()[0])["id"] == "1"  # the order went, with its id
        assert "the warm spare (pid 4242) did not fork rank 1 (the spare said nothing within 0.2 s); expected the " \
               "forked worker's pid within 0.2 s. Rank 1 starts cold; the spare is ended (another follows). Fix:" \
               in caplog.text
    finally:
        stalled.stdin.close()
        kept.channel.close()
        for fd in (order_r, said_w):
            os.close(fd)


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_the_agents_wait_wakes_at_a_forked_workers_end_then_at_the_spares_word_of_it(tmp_path):
    """launcher.deaths: the agent's wait before each look ends when a forked worker dies (its pidfd), and, where the
    spare has not yet said how it ended, when the spare says it (its pipe): never the whole interval."""
    proc, channel = _start()
    watch, workers = DeathWatch(), []
    try:
        workers.append(worker := _worker(proc, channel, tmp_path, "1", 60, 0))
        _seen(tmp_path / "1.json")
        threading.Timer(0.3, worker.send_signal, (signal.SIGKILL,)).start()
        start = time.monotonic()
        waits = 0
        while worker.poll() is None:
            assert waits < 1000, "the wait returned at once without the worker's end seen: a busy loop"
            watch.wait([worker], 60.0)
            waits += 1
        assert time.monotonic() - start < 30 and worker.poll() == -signal.SIGKILL
    finally:
        _stop(proc, channel, *workers)
        watch.close()


_PARENT = """
import os, sys, time
for code in (3, None):  # one child exits with 3; the other waits to be killed
    pid = os.fork()
    if pid == 0:
        time.sleep(1.0 if code is not None else 600)
        os._exit(code or 0)
    print(pid, flush=True)
time.sleep(600)  # never reaps them (it is stopped meanwhile, as a SIGSTOPped spare is)
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_forked_workers_end_is_seen_with_its_code_while_the_spare_is_stopped():
    """The spare that forked two workers is stopped (SIGSTOP) and says nothing more; one worker exits with code 3,
    the other is SIGKILLed. Each one's end is seen from its own pidfd, with its code read from the unreaped child,
    not left waiting for a spare that cannot speak."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, start_new_session=True)
    said_r, said_w = os.pipe()  # the spare's pipe: its writer open and silent, as a stopped spare's is
    channel = Channel(said_r, parent.pid)
    try:
        assert parent.stdout is not None
        pids = [int(parent.stdout.readline()) for _ in range(2)]
        exiting, killed = (ForkedWorker(pid, channel) for pid in pids)
        os.kill(parent.pid, signal.SIGSTOP)
        assert exiting.poll() is None and killed.poll() is None
        os.kill(killed.pid, signal.SIGKILL)
        assert exiting.wait(timeout=20) == 3 and killed.wait(timeout=20) == -signal.SIGKILL
        assert not channel.closed  # the spare is still there, stopped: nothing was read from it
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
        os.close(said_w)
        channel.close()
