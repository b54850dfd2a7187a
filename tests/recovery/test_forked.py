"""The warm spare that forks its workers (robustdist.recovery.spare.serve) and the agent's side of it
(robustdist.recovery.forked): a real spare process, real forked workers; what the spare says on its pipe, read as
the agent reads it, hostile lines and orders included."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from robustdist.recovery import spare
from robustdist.recovery.forked import UNKNOWN_EXIT, Channel, ForkedWorker

pytestmark = pytest.mark.skipif(not spare.forks(), reason="forking spares need Linux's pidfd_open")

WORKER = """
import json, os, sys, time
json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "env": dict(os.environ),
           "argv": sys.argv, "cwd": os.getcwd()}, open(sys.argv[1] + ".tmp", "w"))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(float(sys.argv[2]))
print("worker out", flush=True)
raise SystemExit(int(sys.argv[3]))
"""


def _start() -> tuple[subprocess.Popen[bytes], Channel]:
    """A spare as the agent starts it, once it has said it is warm and forks."""
    ready_r, ready_w = os.pipe()
    env = {**os.environ, spare.READY_FD_ENV: str(ready_w), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "robustdist.recovery.spare"], stdin=subprocess.PIPE,
                            pass_fds=(ready_w,), env=env, cwd="/", start_new_session=True)
    os.close(ready_w)
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


def _order(proc: subprocess.Popen[bytes], tmp_path: Path, name: str, sleep: float, code: int) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    order = {"env": {"PATH": os.environ.get("PATH", ""), "ORDER_NAME": name}, "args": ["-u", str(script),
             str(tmp_path / f"{name}.json"), str(sleep), str(code)], "cwd": str(tmp_path),
             "stdout": str(tmp_path / f"{name}.out"), "stderr": str(tmp_path / f"{name}.err")}
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(order).encode() + b"\n")
    proc.stdin.flush()
    return order


def _seen(path: Path) -> dict:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name}: the worker did not start"
        time.sleep(0.02)
    return json.loads(path.read_text())


def _stop(proc: subprocess.Popen[bytes], channel: Channel) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    channel.close()


@pytest.mark.timeout(240)
def test_the_spare_forks_each_order_reports_each_end_and_refuses_what_is_no_order(tmp_path):
    proc, channel = _start()
    try:
        _order(proc, tmp_path, "exits", 0.2, 3)
        first = channel.forked(10)
        assert isinstance(first, int), first
        worker = ForkedWorker(first, channel)
        assert worker.wait(60) == 3 and worker.poll() == 3
        seen = _seen(tmp_path / "exits.json")
        # the worker: the spare's child, leading a session of its own, with exactly the order's environment
        assert (seen["pid"], seen["ppid"], seen["sid"]) == (first, proc.pid, first)
        assert seen["env"]["ORDER_NAME"] == "exits" and spare.READY_FD_ENV not in seen["env"]
        assert seen["cwd"] == str(tmp_path) and seen["argv"][1:] == [str(tmp_path / "exits.json"), "0.2", "3"]
        assert (tmp_path / "exits.out").read_text() == "worker out\n"
        # hostile orders: each refused with its reason; the spare stays warm and forks the next one
        assert proc.stdin is not None
        for bad in (b"not json", b'{"env": 1, "args": ["x.py"]}', b'{"env": {}, "args": "x.py"}',
                    b'{"env": {}, "args": ["--version"]}', b"[" * 100000, b'"\xff\xfe"'):
            proc.stdin.write(bad + b"\n")
            proc.stdin.flush()
            got = channel.forked(10)
            assert isinstance(got, str) and got.split(":")[0] in ("ValueError", "RecursionError",
                                                                 "JSONDecodeError", "UnicodeDecodeError"), got
        _order(proc, tmp_path, "killed", 60, 0)
        second = channel.forked(10)
        assert isinstance(second, int) and second != first
        killed = ForkedWorker(second, channel)
        _seen(tmp_path / "killed.json")
        assert killed.poll() is None
        killed.send_signal(signal.SIGKILL)  # as the OOM killer would: the spare reads the signal, as a parent can
        assert killed.wait(30) == -signal.SIGKILL
        _order(proc, tmp_path, "slow", 60, 0)
        slow = ForkedWorker(channel.forked(10), channel)  # type: ignore[arg-type]
        with pytest.raises(subprocess.TimeoutExpired):
            slow.wait(0.2)
        slow.terminate()
        assert slow.wait(30) == -signal.SIGTERM and proc.poll() is None
    finally:
        _stop(proc, channel)


@pytest.mark.timeout(240)
def test_the_end_of_its_input_waits_for_its_workers_and_a_dead_spare_leaves_them_an_unknown_code(tmp_path, caplog):
    proc, channel = _start()
    try:
        _order(proc, tmp_path, "last", 1.0, 0)
        worker = ForkedWorker(channel.forked(10), channel)  # type: ignore[arg-type]
        assert proc.stdin is not None
        proc.stdin.close()  # the agent's end: the spare waits for the worker it forked (no zombie), then ends
        assert proc.wait(60) == 0
        assert worker.wait(10) == 0
    finally:
        _stop(proc, channel)
    proc, channel = _start()
    try:
        _order(proc, tmp_path, "orphan", 1.5, 0)
        orphan = ForkedWorker(channel.forked(10), channel)  # type: ignore[arg-type]
        _seen(tmp_path / "orphan.json")
        os.killpg(proc.pid, signal.SIGKILL)  # the spare dies first: only a pidfd still sees the worker end
        proc.wait()
        with caplog.at_level(logging.WARNING, "robustdist.recovery.forked"):
            assert orphan.wait(60) == UNKNOWN_EXIT
        assert channel.closed
        assert f"worker pid {orphan.pid} ended after the warm spare that forked it (pid {proc.pid}); its exit code is " \
               "unknown" in caplog.text and "Fix:" in caplog.text
    finally:
        _stop(proc, channel)


@pytest.mark.timeout(60)
def test_the_channel_reads_split_lines_in_order_and_names_what_it_cannot(caplog):
    read, write = os.pipe()
    channel = Channel(read, 4242)
    try:
        os.write(write, b"P 12\nX ValueError: not an ord")
        assert channel.forked(1) == 12
        os.write(write, b"er\nE 12 -9\nE 13 0\nhello\n")
        with caplog.at_level(logging.WARNING, "robustdist.recovery.forked"):
            assert channel.forked(1) == "ValueError: not an order"
        assert channel.ended == {12: -9, 13: 0}
        assert "the warm spare (pid 4242) said b'hello'; expected P <pid>, X <reason> or E <pid> <code>" in caplog.text
        assert channel.forked(0.1) == "the spare said nothing within 0.1 s"
        os.write(write, b"E 14 " + b"7" * 9000)  # no line end: not the spare's protocol (within the pipe's buffer)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "robustdist.recovery.forked"):
            channel.pump()
        assert channel.closed and "without a line end" in caplog.text
        assert channel.forked(1) == "the spare ended" and 14 not in channel.ended
    finally:
        channel.close()
        os.close(write)
    read, write = os.pipe()
    channel = Channel(read, 4242)
    os.write(write, b"E 20 3\n")
    os.close(write)  # the spare's end: what it said before is still read
    channel.pump()
    assert channel.closed and channel.ended == {20: 3}
