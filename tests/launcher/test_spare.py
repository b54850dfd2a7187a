"""The warm spare's warm-up priority (robustdist.launcher.idle): at SCHED_IDLE with its session's autogroup at nice 19
where the process can come back (every thread and the autogroup back before it says it is warm, and the worker it
becomes runs at the workers' policy), at the workers' priority where it cannot (no CAP_SYS_NICE: a root container's
default), and what it says on the agent's pipe in each case. Real processes, each in a session of its own (as the
agent starts a spare: the autogroup is the session's); capabilities dropped with capsh. (RLIMIT_NICE >= 20 - nice
also lets a process come back; this machine cannot raise it: no CAP_SYS_RESOURCE.)"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from robustdist.launcher import spare
from robustdist.launcher.forked import Channel

SCHED_IDLE = getattr(os, "SCHED_IDLE", 5)

WORKER = """
import json, os, sys
import torch
x = torch.randn(512, 512)
for _ in range(20):
    x = torch.tanh(x @ x)  # the intra-op pool, if any, is started here
policies = {}
for tid in os.listdir("/proc/self/task"):
    try:
        policies[tid] = os.sched_getscheduler(int(tid))
    except OSError:
        pass
json.dump({"main": os.sched_getscheduler(0), "threads": policies, "argv": sys.argv,
           "autogroup": open("/proc/self/autogroup").read()}, open(sys.argv[1], "w"))
"""

AUTOGROUP = Path("/proc/self/autogroup")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")


def _policies(pid: int) -> dict[int, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:
            continue
    return out


# the spare where it cannot fork (no pidfd, a CUDA driver loaded): it becomes the one worker itself
NO_FORK = "import sys; import robustdist.launcher.spare as s; s.forks = lambda: False; sys.exit(s.main())"


def _spare(shell: str | None, forking: bool = True, with_workers: bool = False
           ) -> tuple[subprocess.Popen[bytes], int]:
    """The spare, as the agent starts it (``with_workers``: with an attempt's workers); under ``capsh
    --drop=cap_sys_nice`` after ``shell`` where given."""
    ready_r, ready_w = os.pipe()
    env = {**os.environ, spare.READY_FD_ENV: str(ready_w), "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-u", "-m", "robustdist.launcher.spare"] if forking else [sys.executable, "-u", "-c",
                                                                                      NO_FORK]
    cmd += [spare.WITH_WORKERS] if with_workers else []
    if shell is not None:
        cmd = [_capsh(), "--drop=cap_sys_nice", "--", "-c", f"{shell}; exec {' '.join(cmd)}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(ready_w,), env=env, cwd="/",
                            start_new_session=True)
    os.close(ready_w)
    return proc, ready_r


def _autogroup_nice(pid: int | str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _run(tmp_path: Path, shell: str | None = None, forking: bool = True, with_workers: bool = False
         ) -> tuple[bytes, set[int], dict]:
    """Start a spare, watch its threads' policies and its autogroup until it says it is warm, check them then, order
    it to run WORKER; returns what it said, the policies and autogroup nice values seen while warming (the nice
    values as 100 + nice), and what the worker found."""
    proc, ready = _spare(shell, forking, with_workers)
    seen: set[int] = set()
    idled: set[int] = set()  # threads seen at SCHED_IDLE
    try:
        deadline = time.monotonic() + 120
        while not select.select([ready], [], [], 0.02)[0]:
            assert proc.poll() is None, f"the spare ended with {proc.returncode} before it was warm"
            assert time.monotonic() < deadline, "the spare was not warm within 120 s"
            try:
                policies = _policies(proc.pid)
            except FileNotFoundError:
                policies = {}
            seen |= set(policies.values())
            idled |= {tid for tid, policy in policies.items() if policy == SCHED_IDLE}
            nice = _autogroup_nice(proc.pid)
            if nice is not None:
                seen.add(100 + nice)
        said = os.read(ready, 2)
        assert (said[1:] == spare.FORKS) is (forking and spare.forks()), said
        if said[:1] == spare.READY:  # it could not come back: only idle.possible()'s throwaway thread tried, and ended
            assert proc.pid not in idled and not [t for t in idled if Path(f"/proc/{proc.pid}/task/{t}").exists()]
        assert set(_policies(proc.pid).values()) == {os.SCHED_OTHER}, "a thread still idles once the spare is warm"
        assert _autogroup_nice(proc.pid) in (None, 0), "the autogroup stays lowered once the spare is warm"
        script, out = tmp_path / "worker.py", tmp_path / "out.json"
        script.write_text(WORKER)
        order = {"env": dict(os.environ), "args": ["-u", str(script), str(out)], "cwd": str(tmp_path),
                 "stdout": str(tmp_path / "stdout"), "stderr": str(tmp_path / "stderr")}
        if said[1:] == spare.FORKS:  # it forks the worker (its child), lets it go, and ends once the worker has
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({**order, "id": "1"}).encode() + b"\n")
            proc.stdin.flush()
            channel, ready = Channel(ready, proc.pid), -1
            try:
                assert isinstance(channel.forked("1", 60), int)
                proc.stdin.write(b'{"go": "1"}\n')
                proc.stdin.close()
                proc.wait(120)
            finally:
                channel.close()
        else:
            proc.communicate(json.dumps(order).encode() + b"\n", timeout=120)
        assert proc.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
        return said[:1], seen, json.loads(out.read_text())
    finally:
        if ready >= 0:
            os.close(ready)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _capsh() -> str:
    path = shutil.which("capsh")
    if path is None or os.geteuid() != 0:
        pytest.skip("needs capsh and root to drop CAP_SYS_NICE")
    return path


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("forking", [True, False], ids=["forks", "becomes"])
def test_the_spare_warms_at_idle_priority_and_the_worker_it_becomes_does_not(tmp_path, forking):
    if not spare.idle_possible():
        pytest.skip("this process cannot return from SCHED_IDLE (no CAP_SYS_NICE): the next tests cover it")
    said, seen, worker = _run(tmp_path, forking=forking)
    # READY_LATE: it began at idle priority and, the host busy past IDLE_PATIENCE_S, finished at the workers'
    assert said in (spare.READY_IDLE, spare.READY_LATE), said
    assert SCHED_IDLE in seen, f"no thread of the spare was seen at SCHED_IDLE while it warmed: {seen}"
    if AUTOGROUP.exists():
        assert 119 in seen, f"the spare's autogroup was not seen at nice 19 while it warmed: {seen}"
        assert worker["autogroup"].split()[-1] == "0"
    assert worker["main"] == os.SCHED_OTHER
    assert set(worker["threads"].values()) == {os.SCHED_OTHER}, worker
    assert worker["argv"][0].endswith("worker.py")


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_without_cap_sys_nice_the_spare_warms_at_the_workers_priority(tmp_path):
    """A root container without CAP_SYS_NICE (and RLIMIT_NICE 0) could go to SCHED_IDLE but never come back: the spare
    does not warm there (only the throwaway thread of idle.possible() tries it, and ends: _run checks that)."""
    said, seen, worker = _run(tmp_path, "ulimit -e 0")
    assert said == spare.READY
    assert seen - {100, SCHED_IDLE} == {os.SCHED_OTHER} and 119 not in seen  # the autogroup never lowered
    assert set(worker["threads"].values()) == {os.SCHED_OTHER}


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_spare_started_with_the_workers_idles_first_then_warms_at_their_priority(tmp_path):
    """The agent starts an attempt's first spare with the workers (WITH_WORKERS): it warms at idle priority for
    WITH_WORKERS_PATIENCE_S (their own start gets the CPU first), then at their priority (beside ranks that fill the
    cores an idle warm-up waits for the CPU until the training pauses), and says so; every thread ends up back."""
    said, seen, worker = _run(tmp_path, with_workers=True)
    if spare.idle_possible():
        assert said == spare.READY_WITH_WORKERS and SCHED_IDLE in seen, (said, seen)
    else:  # it could not come back from idle: at the workers' priority throughout, and says so
        assert said == spare.READY and SCHED_IDLE not in seen, (said, seen)
    assert set(worker["threads"].values()) == {os.SCHED_OTHER}, worker
    assert worker["argv"][0].endswith("worker.py")


def test_a_thread_that_already_idles_does_not_probe():
    import threading

    found = []

    def idle_then_probe():
        os.sched_setscheduler(0, SCHED_IDLE, os.sched_param(0))
        found.append(spare.idle_possible())

    if not spare.idle_possible():
        pytest.skip("this process cannot return from SCHED_IDLE")
    t = threading.Thread(target=idle_then_probe)
    t.start()
    t.join()
    assert found == [False]  # the whole job idles: the spare has nothing to come back to


IDLE_RUN = """
import json, os, sys, threading
from robustdist.launcher import idle

def nice():
    try:
        return int(open("/proc/self/autogroup").read().split()[-1])
    except OSError:
        return None

seen, stop, lingering = {}, threading.Event(), []

def work():
    seen["policy"], seen["nice"] = os.sched_getscheduler(0), nice()
    t = threading.Thread(target=stop.wait, daemon=True)  # a pool the work leaves behind
    t.start()
    lingering.append(t)
    if sys.argv[1] == "raise":
        raise KeyError("the work failed")

def slow():  # past the patience: it finishes at the calling thread's priority
    work()
    import time
    time.sleep(1.0)
    seen["policy_late"], seen["nice_late"] = os.sched_getscheduler(0), nice()

out = {"possible": idle.possible(), "nice_before": nice()}
try:
    out["idle_to_the_end"] = idle.run(slow, patience_s=0.3) if sys.argv[1] == "late" else idle.run(work)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
out.update(seen, main=os.sched_getscheduler(0), nice_after=nice(),
           lingering=os.sched_getscheduler(lingering[0].native_id) if lingering else None)
stop.set()
print(json.dumps(out))
"""


def _idle_run(mode: str, shell: str | None = None) -> dict:
    cmd = [sys.executable, "-c", IDLE_RUN, mode]
    if shell is not None:
        cmd = [_capsh(), "--drop=cap_sys_nice", "--", "-c", f'{shell}; exec "$0" "$@"', *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["ok", "raise", "late"])
def test_idle_run_lowers_only_the_work_and_puts_everything_back(mode):
    out = _idle_run(mode)
    if not out["possible"]:
        pytest.skip("this process cannot return from SCHED_IDLE (no CAP_SYS_NICE)")
    assert out["policy"] == SCHED_IDLE and out["main"] == os.SCHED_OTHER
    assert out["lingering"] == os.SCHED_OTHER  # started at SCHED_IDLE inside the work, put back after it
    if out["nice_before"] is not None:
        assert (out["nice_before"], out["nice"], out["nice_after"]) == (0, 19, 0)
    if mode == "raise":
        assert out["error"] == "KeyError: 'the work failed'"
    else:
        assert "error" not in out
        assert out["idle_to_the_end"] is (mode == "ok")
    if mode == "late":  # the patience ran out: the work went on at the calling thread's policy, the autogroup back
        assert out["policy_late"] == os.sched_getscheduler(0)
        assert out["nice_late"] == out["nice_before"]


@pytest.mark.processes
def test_idle_run_where_threads_cannot_come_back_names_them_and_the_fix():
    """Called where possible() says no (a bug in a caller): the work runs, the autogroup comes back, and the error
    says which thread stays idle, what was expected and what to do."""
    out = _idle_run("ok", "ulimit -e 0")
    assert out["possible"] is False
    assert out["policy"] == SCHED_IDLE and out["lingering"] == SCHED_IDLE
    assert out["error"].startswith("RuntimeError: pid ")
    assert "after the work at idle priority, thread " in out["error"]
    assert "could not be read or set (Operation not permitted); expected every thread back at the calling " \
           "thread's policy and the autogroup back at its nice value. Fix: none needed where a fallback exists" \
           in out["error"]
    if out["nice_before"] is not None:
        assert out["nice_after"] == out["nice_before"] == 0


def test_possible_is_false_off_linux_and_where_the_calls_are_refused(monkeypatch):
    from robustdist.launcher import idle

    def refused(*_):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "sched_getscheduler", refused)  # musl's stub, a sandbox
    assert idle.possible() is False
    monkeypatch.undo()
    monkeypatch.delattr(os, "SCHED_IDLE")  # not Linux
    assert idle.possible() is False


@pytest.mark.parametrize("said, used, text", [
    (spare.READY_IDLE, True, " s after this attempt's workers started (warmed at idle priority; it becomes the next "
                             "replacement itself: it cannot fork here"),
    (spare.READY_IDLE + spare.FORKS, True, "(warmed at idle priority; it forks each replacement and stays warm)"),
    (spare.READY_LATE, True, "then at the workers' priority after 30 s: the host had little idle CPU time"),
    (spare.READY_WITH_WORKERS + spare.FORKS, True, "(started with the workers: warmed at idle priority for up to "
                                                  f"{spare.WITH_WORKERS_PATIENCE_S:g} s, then at theirs; it forks "
                                                  "each replacement"),
    (b"x", False, "the warm spare (pid 4242) said b'x' on its pipe; expected one of b'1', b'2', b'3', b'4'. It is not "
                  "used: replacements start cold until it ends. Fix: run the launcher with the same Python and "
                  "robustdist as the workers"),
])
def test_the_agent_reads_what_the_spare_says_and_names_what_it_cannot(said, used, text, caplog):
    import logging
    from types import SimpleNamespace

    from robustdist.launcher.warm_spare import WarmSpare

    kept = WarmSpare()
    read, write = os.pipe()
    os.write(write, said)
    os.close(write)
    kept._ready, kept.proc, kept._started = read, SimpleNamespace(pid=4242), time.monotonic()
    kept.workers_started = kept._started - 1.5
    with caplog.at_level(logging.INFO, "robustdist.launcher.warm_spare"):
        kept.look_ready()
    assert kept.warm is used
    assert text in caplog.text
    assert not used or re.search(r"is ready after [\d.]+ s, 1\.[5-9] s after this attempt's workers started",
                                 caplog.text)
    assert (kept.channel is not None) is said.endswith(spare.FORKS)  # the pipe then stays: the workers' news
    if kept.channel is not None:
        kept.channel.close()


def test_a_death_while_the_spare_warms_waits_briefly_for_it(monkeypatch):
    """A death while the spare still warms: the agent waits up to SPARE_WAIT_S for it to say it is warm (then the
    spare becomes the worker), else starts the worker cold; it waits once per look, not once per dead rank, and
    not at all for a worker command no spare can run."""
    import sys
    import threading
    from types import SimpleNamespace

    from robustdist.launcher import warm_spare
    from robustdist.launcher.warm_spare import WarmSpare
    from robustdist.runtime import _elastic_compat

    launch = {"entrypoint": sys.executable, "args": ("-u", "train.py"), "env": {}, "stdout": "", "stderr": "",
              "numa": None}
    monkeypatch.setattr(_elastic_compat, "worker_launch", lambda agent, worker: dict(launch))
    monkeypatch.setattr(_elastic_compat, "adopt_worker", lambda agent, worker, proc: 777)

    def a_warming_spare() -> tuple[WarmSpare, int, list[bytes]]:
        kept = WarmSpare()
        read, write = os.pipe()
        orders: list[bytes] = []
        stdin = SimpleNamespace(write=orders.append, close=lambda: None)
        kept._ready, kept._started = read, time.monotonic()
        kept.proc = SimpleNamespace(pid=4242, stdin=stdin, poll=lambda: None)
        return kept, write, orders

    def timed(call) -> tuple[object, float]:
        start = time.monotonic()
        return call(), time.monotonic() - start

    look = 1  # the agent's look at its workers
    # it says it is warm 0.3 s into the wait: it becomes the worker, before the wait's end
    monkeypatch.setattr(warm_spare, "SPARE_WAIT_S", 10.0)
    kept, write, orders = a_warming_spare()
    timer = threading.Timer(0.3, os.write, (write, spare.READY_IDLE))
    timer.start()
    got, waited = timed(lambda: kept.take(None, SimpleNamespace(local_rank=1), {}, look))
    timer.join()
    os.close(write)
    assert got == 777 and len(orders) == 1 and waited < 9.0, (got, orders, waited)
    # it stays silent: one wait of SPARE_WAIT_S, then cold; a second death in the same look does not wait again
    monkeypatch.setattr(warm_spare, "SPARE_WAIT_S", 1.5)
    kept, write, orders = a_warming_spare()
    got, waited = timed(lambda: kept.take(None, SimpleNamespace(local_rank=0), {}, look))
    assert got is None and not kept.warm and 1.5 <= waited < 10.0, (got, waited)
    got, waited = timed(lambda: kept.take(None, SimpleNamespace(local_rank=1), {}, look))
    assert got is None and waited < 1.0, waited
    # a command no spare runs (not the launcher's Python): no wait at all
    launch["entrypoint"] = "/bin/bash"
    look += 1
    got, waited = timed(lambda: kept.take(None, SimpleNamespace(local_rank=1), {}, look))
    assert got is None and waited < 1.0, waited
    os.close(write)
    os.close(kept._ready)
