"""The watchdog names lost ranks by node, apart from live ranks that are behind, on every rank that can still
reach the store; neither its report nor hang_action='abort' waits on a lost rank or on a store that stopped
answering.

Real gloo ranks on one host (``run_ranks``). A "node" is a ``GROUP_RANK`` value (``robustdist.runtime.node``). A node
whose link went down is simulated with SIGSTOP: its heartbeats stop while its sockets stay open, so gloo sees
no reset and the others wait in their collective, as in a partition. A dead rank SIGKILLs itself. Every
stopped process is resumed and killed at the end, pass or fail (``_Job``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from robustdist.health import watchdog_store as ws
from robustdist.health.step_guard import HANG_EXIT_CODE, Watchdog
from robustdist.runtime.errors import RanksFailed
from robustdist.testing.ranks import run_ranks
from tests import _procs

T = 4.0  # hang_timeout: a heartbeat every 1 s, lost after 3 s without one, grace 2 s
BOUND = T + 5  # the bound: every survivor's report lands within hang_timeout + 5 s of the hang
STOP_STEP = 2
NODES = [{"GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}] * 2 + \
        [{"GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"}] * 2  # torchrun counts restarts per node


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------------------------------- rank side
def _write(out: str, name: str, text: str) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))


def _setup_rank(rank: int, out: str) -> None:
    """Log robustdist's warnings and errors to ``rank<r>.log`` with their wall time; publish the pid."""
    handler = logging.FileHandler(os.path.join(out, f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter("@%(created).3f %(levelname)s %(message)s"))
    logger = logging.getLogger("robustdist")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    _write(out, f"pid{rank}", str(os.getpid()))


def _finish(rank: int, out: str, wd: Watchdog) -> int:
    wd.close()
    _write(out, f"reports{rank}", json.dumps([dataclasses.asdict(r) for r in wd.reports]))
    return len(wd.reports)


def _frozen_node(rank: int, out: str, action: str) -> int:
    """DDP training; at step STOP_STEP both ranks of node 1 (2 and 3) freeze: node 1's link is down."""
    _setup_rank(rank, out)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    wd = Watchdog(T, dump_dir=os.path.join(out, "dumps"), action=action).attach(model)
    for step in range(STOP_STEP + 3):
        wd.beat(step)
        if rank in (2, 3) and step == STOP_STEP:
            _write(out, f"stopped{rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    time.sleep(1.0)  # a few watchdog ticks: it notices that beats resumed
    return _finish(rank, out, wd)


def _stuck_here(seconds: float) -> None:
    time.sleep(seconds)


def _dead_and_behind(rank: int, out: str) -> int:
    """Rank 2 (node 1) dies at STOP_STEP; rank 1 is stuck in _stuck_here; rank 0 waits for rank 1 in a
    collective of their own group (so no connection to the dead rank is involved). Ranks 0 and 1 beat
    STOP_STEP only once rank 2 is dead, so the verdict does not depend on how the machine schedules its death."""
    _setup_rank(rank, out)
    pair = dist.new_group([0, 1])
    wd = Watchdog(T, dump_dir=os.path.join(out, "dumps"))
    t = torch.ones(1)
    for step in range(STOP_STEP):
        wd.beat(step)
        wd.beat()
        dist.all_reduce(t)
    if rank == 2:
        wd.beat(STOP_STEP)
        _write(out, "stopped2", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    # The survivors' last beats come after rank 2 is gone, so when their watchdog fires (T s later) rank 2's
    # last heartbeat is older than the 3 s "lost" threshold however late a loaded machine scheduled its death.
    dead = int(_wait_for(lambda: _read(out, "pid2") if _read(out, "stopped2") else None, time.time() + 60,
                         "rank 2 to stop"))
    _wait_for(lambda: not _running(dead), time.time() + 60, "rank 2 to die")
    wd.beat(STOP_STEP)
    if rank == 1:
        _stuck_here(T + 8)
    wd.beat()
    dist.all_reduce(t, group=pair)
    return _finish(rank, out, wd)


# ---------------------------------------------------------------------------------------------- test side
class _Job:
    """``run_ranks`` on a thread, so the test can watch the ranks, and stop, resume or kill them."""

    def __init__(self, out: str, world_size: int):
        self.out, self.world_size = out, world_size
        self.result: list[Any] | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, fn: Any, args: tuple[Any, ...], env: list[dict[str, str]], timeout: float) -> None:
        def target() -> None:
            try:
                self.result = run_ranks(fn, self.world_size, args=args, env=env, timeout=timeout)
            except BaseException as e:  # handed to the test
                self.error = e

        self.thread = threading.Thread(target=target, name="run-ranks", daemon=True)
        self.thread.start()

    def pid(self, rank: int, deadline: float) -> int:
        return int(_wait_for(lambda: _read(self.out, f"pid{rank}"), deadline, f"rank {rank}'s pid"))

    def send(self, ranks: tuple[int, ...], *signals: signal.Signals) -> None:
        """Send ``signals`` to those ranks that are still this process's descendants (no pid reuse)."""
        for rank in ranks:
            pid = _read(self.out, f"pid{rank}")
            for sig in signals:
                if pid and int(pid) in _procs.descendants(os.getpid()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), sig)

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"run_ranks did not return within {timeout} s"

    def close(self) -> None:
        """Resume and kill every rank still running (stopped ones included), then wait for run_ranks."""
        if self.thread is not None and self.thread.is_alive():
            self.send(tuple(range(self.world_size)), signal.SIGKILL, signal.SIGCONT)
            self.thread.join(30)


@contextlib.contextmanager
def _job(out: str, world_size: int) -> Iterator[_Job]:
    job = _Job(out, world_size)
    try:
        yield job
    finally:
        job.close()


def _read(out: str, name: str) -> str | None:
    try:
        with open(os.path.join(out, name)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _wait_for(probe: Any, deadline: float, what: str) -> Any:
    while True:
        found = probe()
        if found:
            return found
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].startswith("T")


def _running(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not _procs.is_zombie(pid)


def _errors(out: str, rank: int) -> list[tuple[float, str]]:
    """``(wall time, message)`` of every ERROR record rank ``rank`` logged."""
    text = _read(out, f"rank{rank}.log") or ""
    records = re.split(r"^@(?=\d+\.\d+ )", text, flags=re.M)
    found = []
    for record in records:
        stamp, _, rest = record.partition(" ")
        if rest.startswith("ERROR "):
            found.append((float(stamp), rest[len("ERROR "):]))
    return found


def _report_time(out: str, rank: int, phrase: str) -> float | None:
    return next((t for t, message in _errors(out, rank) if phrase in message), None)


def _node(node_rank: int) -> str:
    from robustdist.runtime.node import node_label

    return node_label({"GROUP_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1"})


def _start_frozen_node(job: _Job, action: str) -> float:
    """Start the 4 ranks; return when both ranks of node 1 are stopped, with the time the first stopped."""
    job.start(_frozen_node, (job.out, action), NODES, timeout=90)
    deadline = time.time() + 60
    pids = {r: job.pid(r, deadline) for r in (2, 3)}
    _wait_for(lambda: all(_stopped(pids[r]) for r in (2, 3)), deadline, "ranks 2 and 3 to stop")
    return min(float(_read(job.out, f"stopped{r}") or "inf") for r in (2, 3))


# ---------------------------------------------------------------------------------------------- the tests
@pytest.mark.processes
@pytest.mark.timeout(150)
def test_every_survivor_names_the_frozen_node_within_the_bound_and_training_resumes_with_the_link(tmp_path):
    out, lost_phrase = str(tmp_path), f"lost ranks 2, 3 on {_node(1)}: no heartbeat for"
    with _job(out, 4) as job:
        t0 = _start_frozen_node(job, "dump")
        latency = {}
        for rank in (0, 1):
            at = _wait_for(lambda r=rank: _report_time(out, r, lost_phrase), t0 + BOUND + 10, f"rank {rank}'s report")
            latency[rank] = at - t0
        print(f"frozen node named after {latency} s (hang_timeout {T:g} s)")
        job.send((2, 3), signal.SIGCONT)  # the link is back: the collective completes, training goes on
        job.join(60)
    assert job.error is None, job.error
    assert job.result is not None and job.result[0] == job.result[1] == 1
    for rank in (0, 1):
        assert latency[rank] <= BOUND, f"rank {rank} named the lost node {latency[rank]:.1f} s after the hang"
        message = next(m for _, m in _errors(out, rank) if lost_phrase in m)
        assert f"hang report from rank {rank} on {_node(0)}: {lost_phrase}" in message
        assert re.search(r"\(expected one every 1 s; the last (said step [0-2]|came before the first step)\)", message)
        assert "every rank still alive (ranks 0, 1) is at step 2" in message  # alive, named apart
        assert "they wait for the lost ranks. Suspect: ranks 2, 3." in message
        assert f"Fix: bring back {_node(1)}: check links and processes" in message
        report = json.loads(_read(out, f"reports{rank}") or "[]")[0]
        assert report["lost"] == [2, 3] and report["lost_nodes"] == {_node(1): [2, 3]} and report["behind"] == []
        assert report["store_reachable"] is True and report["step"] == STOP_STEP
        assert lost_phrase in (_read(os.path.dirname(report["dump_path"]), os.path.basename(report["dump_path"]))
                               or "")
        assert "beats resumed at step" in (_read(out, f"rank{rank}.log") or "")  # the link came back


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_with_abort_the_survivors_exit_86_promptly_while_the_node_is_still_cut_off(tmp_path):
    out = str(tmp_path)
    with _job(out, 4) as job:
        t0 = _start_frozen_node(job, "abort")
        survivors = [job.pid(r, t0 + 10) for r in (0, 1)]
        _wait_for(lambda: not any(_running(p) for p in survivors), t0 + BOUND + 10, "the survivors to exit")
        exited = time.time() - t0
        print(f"survivors exited {exited:.1f} s after the node froze (hang_timeout {T:g} s)")
        job.send((2, 3), signal.SIGKILL, signal.SIGCONT)  # what the launcher does to the rest of the group
        job.join(30)
    assert isinstance(job.error, RanksFailed), job.error
    failures = job.error.failures
    assert sorted(failures) == [0, 1, 2, 3]
    for rank in (0, 1):
        assert f"exited with code {HANG_EXIT_CODE}" in failures[rank]
        messages = "\n".join(m for _, m in _errors(out, rank))
        assert f"lost ranks 2, 3 on {_node(1)}: no heartbeat for" in messages
        assert f"health.hang_action='abort': exiting with code {HANG_EXIT_CODE}" in messages
        dumps = [name for name in os.listdir(os.path.join(out, "dumps")) if name.startswith(f"hang-rank{rank}-")]
        assert len(dumps) == 1 and "no heartbeat for" in (_read(os.path.join(out, "dumps"), dumps[0]) or "")
    for rank in (2, 3):
        assert "SIGKILL" in failures[rank]
    # the rank serving the store (rank 0) exits last: 2 ticks + grace + 0.5 s after its own hang fired
    assert exited <= BOUND + 2 * min(1.0, T / 10) + min(2.0, T / 2) + 0.5


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_dead_rank_is_lost_by_node_and_a_stuck_live_rank_is_behind_on_every_survivor(tmp_path):
    out = str(tmp_path)
    env = [{"GROUP_RANK": "0"}, {"GROUP_RANK": "0"}, {"GROUP_RANK": "1"}]
    with _job(out, 3) as job:
        job.start(_dead_and_behind, (out,), env, timeout=90)
        job.join(100)
    assert isinstance(job.error, RanksFailed), job.error
    assert list(job.error.failures) == [2] and "died by signal SIGKILL" in job.error.failures[2]
    t0 = float(_read(out, "stopped2") or "nan")
    lost = f"lost rank 2 on {_node(1)}: no heartbeat for"
    for rank in (0, 1):
        errors = _errors(out, rank)
        found = next(((t, m) for t, m in errors if lost in m), None)
        assert found is not None, f"rank {rank} never named the dead rank ({lost!r}); its errors: {errors}"
        at, message = found
        print(f"rank {rank} named the dead rank {at - t0:.1f} s after it died (hang_timeout {T:g} s)")
        assert at - t0 <= BOUND, f"rank {rank} named the dead rank {at - t0:.1f} s after it died"
        assert f"alive but behind: rank 1 last beat at step {STOP_STEP} (earlier in that step: beat #5 vs #6)" \
               in message
        assert "MainThread in _stuck_here (test_watchdog_lost.py:" in message
        assert f"rank 0 at step {STOP_STEP}. Suspect: ranks 1, 2." in message
        report = json.loads(_read(out, f"reports{rank}") or "[]")[0]
        assert report["lost"] == [2] and report["lost_nodes"] == {_node(1): [2]} and report["behind"] == [1]


_STORE_HOST = ("import time\nfrom datetime import timedelta\nimport torch.distributed as d\n"
               "s = d.TCPStore('127.0.0.1', 0, is_master=True, timeout=timedelta(seconds=60))\n"
               "print(s.port, flush=True)\ntime.sleep(120)\n")


@contextlib.contextmanager
def _store_host() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())  # type: ignore[union-attr]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]


def _wait_threads_gone(prefix: tuple[str, ...], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := [t.name for t in threading.enumerate() if t.name.startswith(prefix)]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    return left


_ABORTING = """
import time
from datetime import timedelta
import torch.distributed as d
from robustdist.health import Watchdog
store = d.TCPStore('127.0.0.1', {port}, is_master=False, timeout=timedelta(seconds=30))
w = Watchdog(1.0, store=store, rank=1, world_size=2, action='abort')
w.beat(3)
time.sleep(0.3)
print('ready', flush=True)
time.sleep(60)
"""


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_store_that_stops_answering_delays_neither_the_dump_nor_the_abort(single_process, tmp_path):
    budget = 1.0 + 0.1 + 0.5 + 0.5  # hang_timeout, a tick, grace, the last read
    with _store_host() as (host, port):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        wd = Watchdog(1.0, dump_dir=tmp_path, store=store, rank=0, world_size=2)
        try:
            wd.beat(5)
            time.sleep(0.3)  # a heartbeat went through
            os.kill(host.pid, signal.SIGSTOP)  # the store's host stops answering (its sockets stay open)
            last = time.time()
            wd.beat(6)
            _wait_for(lambda: wd.reports, last + 30, "the hang report")
        finally:
            wd.close()
        report = wd.reports[0]
        print(f"reported {report.detected_at - last:.1f} s after the last beat, the store stopped (budget {budget:g} s)")
        assert report.detected_at - last <= budget + 1.0, f"reported {report.detected_at - last:.1f} s after the beat"
        assert report.store_reachable is False and report.lost == () and report.step == 6
        assert (f"hang report from rank 0 on node ? (host {os.uname().nodename}): the c10d store at "
                f"127.0.0.1:{port} did not answer within 1.0 s") in report.summary
        assert "Fix: check this node's link to it; with health.hang_action='abort' this rank exits now" \
               in report.summary
        dump = open(report.dump_path).read()
        assert "had no beat for" in dump and "in test_a_store_that_stops_answering" in dump
        assert report.summary in dump

        os.kill(host.pid, signal.SIGCONT)
        proc = subprocess.Popen([sys.executable, "-c", _ABORTING.format(port=port)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
            os.kill(host.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            _, err = proc.communicate(timeout=30)
            exited = time.monotonic() - stopped
        finally:
            proc.kill()
            proc.wait(10)
        print(f"exited {exited:.1f} s after the store stopped (budget {budget:g} s)")
        assert proc.returncode == HANG_EXIT_CODE, err
        assert exited <= budget + 1.5, f"exited {exited:.1f} s after the store stopped"
        assert "did not answer within 1.0 s" in err and f"exiting with code {HANG_EXIT_CODE}" in err
    # the host is gone: the abandoned report call fails at once, and no thread outlives the test
    assert _wait_threads_gone(("robustdist-heartbeat", "robustdist-hang-report", "robustdist-watchdog"), 15) == []


class _CountingStore:
    """A store (duck-typed, used as given) that records every call, with its time.monotonic()."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple[str, str, float]] = []

    def set(self, key: str, value: str) -> None:
        self.calls.append(("set", key, time.monotonic()))
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self.calls.append(("check", ",".join(keys), time.monotonic()))
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self.calls.append(("get", key, time.monotonic()))
        return self.data[key]


def test_a_beating_rank_s_heartbeat_is_one_small_set_per_interval_and_keys_are_the_same_on_every_node(
        single_process, monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "5")  # counted per node: must not enter a key
    store = _CountingStore()
    wd = Watchdog(8.0, store=store, rank=1, world_size=2)  # a heartbeat every 2 s; reads from 5 s without a beat
    try:
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            wd.beat(7)
            time.sleep(0.1)
    finally:
        wd.close()
    assert wd.reports == []
    kinds = {kind for kind, _, _ in store.calls}
    assert kinds == {"set"}, f"a rank that beats only writes: {store.calls}"
    keys = {key for _, key, _ in store.calls}
    assert len(keys) == 1 and re.fullmatch(r"robustdist/watchdog/\d+/1", keys.pop())
    assert 2 <= len(store.calls) <= 4  # 0 and 2 s, and the closed record
    record = json.loads(next(iter(store.data.values())))
    assert record["node"].startswith(f"node 3 (host {os.uname().nodename}") and record["node_rank"] == 3
    assert record["pid"] == os.getpid() and record["closed"] is True and record["step"] == 7
    assert len(json.dumps(record)) < 400


def test_without_beats_the_heartbeat_goes_on_and_reads_every_record_only_near_the_hang_verdict(single_process):
    """The heartbeat does not depend on training; within 3.5 intervals of the verdict (hang_timeout 4 s: a heartbeat
    every 1 s, lost after 3 s unchanged) it also reads every rank's record, so the verdict knows whose stopped."""
    store = _CountingStore()
    made = time.monotonic()
    wd = Watchdog(4.0, store=store, rank=1, world_size=2)
    try:
        time.sleep(2.5)  # no beat at all
    finally:
        wd.close()
    assert wd.reports == []
    sets = [(key, at) for kind, key, at in store.calls if kind == "set"]
    reads = [(kind, key, at) for kind, key, at in store.calls if kind != "set"]
    assert 3 <= len(sets) <= 5 and len({key for key, _ in sets}) == 1  # 0, 1, 2 s, and the closed record
    assert reads, f"no read within 2.5 s of a 4 s hang timeout: {store.calls}"
    first = min(at for _, _, at in reads) - made
    assert first >= 4.0 - 3.0 - 0.5, f"read every record {first:.2f} s after the last beat, before the watch"
    assert any(kind == "check" and re.fullmatch(r"robustdist/watchdog/(\d+)/0,robustdist/watchdog/\1/1", key)
               for kind, key, _ in reads), reads


def _rec(alive: float, step: int | None, seq: int, node: str, **extra: Any) -> dict[str, Any]:
    return {"alive": alive, "step": step, "seq": seq, "beat_wall": alive - 1, "node": node, **extra}


def test_the_report_groups_lost_ranks_by_node_apart_from_the_ranks_behind():
    n0, n1, n2 = "node 0 (host a, 10.0.0.1)", "node 1 (host a, 10.0.0.2)", "node 2 (host b, 10.0.0.3)"
    now = 1000.0
    records = {0: _rec(999.5, 41, 9, n0, where="wait (ddp.py:1)"), 1: _rec(999.0, 41, 8, n0, where="MainThread in load (x.py:2)"),
               2: _rec(988.0, 41, 9, n1), 3: _rec(987.6, 40, 3, n1), 4: _rec(970.0, 41, 9, n2, closed=True)}
    # seconds each record was seen unchanged, on the reader's clock (the wall times in the records only date beats)
    quiet = {0: 0.5, 1: 1.0, 2: 12.0, 3: 12.4, 4: 30.0}
    box = ws.Collected(records=records, read_at=now, quiet=quiet)
    found = ws.findings(box, rank=0, node=n0, world_size=6, interval=3, stale_after=9, grace=2,
                        store="the c10d store at 10.0.0.1:29500")
    assert found.lost == (2, 3, 4, 5) and found.behind == (1,) and found.store_reachable
    assert found.lost_nodes == {n1: (2, 3), n2: (4,), "node unknown": (5,)}
    text = found.text
    assert text.startswith(f"hang report from rank 0 on {n0}: lost ranks 2, 3 on {n1}: no heartbeat for 12 s")
    assert "(expected one every 3 s; the last said steps 40, 41)" in text
    assert f"lost rank 4 on {n2}: closed its watchdog (it left training: finished, or raised)" in text
    assert "lost rank 5, node unknown: never sent a heartbeat" in text
    assert "alive but behind: rank 1 last beat at step 41 (earlier in that step: beat #8 vs #9), 2 s ago, training " \
           "thread MainThread in load (x.py:2); rank 0 at step 41. Suspect: ranks 1, 2, 3, 4, 5." in text
    assert f"Fix: bring back {n1}, {n2} and the nodes of the ranks never seen: check links and processes" in text
    left = ws.findings(ws.Collected(records={0: records[0], 1: records[4]}, read_at=now, quiet={0: 0.5, 1: 30.0}),
                       rank=0, node=n0, world_size=2, interval=3, stale_after=9, grace=2, store="s")
    assert left.lost == (1,) and left.text.endswith(
        "rank 0, the only one still alive, is at step 41 (beat #9). Suspect: rank 1. Fix: a rank left training "
        "while the others wait in a collective: run the same steps on every rank, and see the log of the rank that "
        "left for the error that ended it.")
    # only how long a record was seen unchanged decides: a wall time far behind the reader's (a node whose clock is
    # off) is alive while its record changes, and a record with a current wall time that stopped changing is lost
    skewed = {0: records[0], 1: {**records[1], "alive": -1e6, "beat_wall": -1e6}, 2: {**records[2], "alive": now}}
    judged = ws.findings(ws.Collected(records=skewed, read_at=now, quiet={0: 0.5, 1: 0.5, 2: 9.5}), rank=0, node=n0,
                         world_size=3, interval=3, stale_after=9, grace=2, store="s")
    assert judged.lost == (2,) and "no heartbeat for 10 s" in judged.text, judged.text
    # a malformed record is no record (that rank counts as never seen)
    for raw in (b"{not json", b"[1]", json.dumps({**records[0], "alive": "x"}), json.dumps({**records[0], "seq": None}),
                json.dumps({**records[0], "alive": float("nan")}), json.dumps({**records[0], "node": 3})):
        assert ws.parse_record(raw) is None, raw
    assert ws.parse_record(json.dumps(records[0])) == records[0]
    unreachable = ws.findings(ws.Collected(error="TimeoutError: x"), rank=2, node=n1, world_size=4, interval=5,
                              stale_after=15, grace=2, store="the c10d store at 10.0.0.1:29500")
    assert unreachable.store_reachable is False and unreachable.lost == ()
    assert unreachable.text.startswith(f"hang report from rank 2 on {n1}: the c10d store at 10.0.0.1:29500 did "
                                       "not answer within 2.5 s (TimeoutError: x), so this rank cannot tell which "
                                       "ranks are lost; expected a reply within 2.5 s.")


class _FailingSets(_CountingStore):
    """Its ``set`` raises ``fail`` times in a row, from the ``after``-th call on; reads always answer."""

    def __init__(self, after: int, fail: int) -> None:
        super().__init__()
        self.after, self.fail = after, fail

    def set(self, key: str, value: str) -> None:
        sets = sum(1 for kind, _, _ in self.calls if kind == "set")
        if self.after <= sets < self.after + self.fail:
            self.calls.append(("set", key, time.monotonic()))
            raise ConnectionResetError("Connection reset by peer")
        super().set(key, value)


def test_failed_writes_while_watching_do_not_restart_the_clocks():
    """A heartbeat write that fails (twice in a row here) does not cost the look of that interval: a reader that
    skipped them would see a pause of its own and judge nobody, and a rank that stopped would be called alive."""
    store = _FailingSets(after=2, fail=2)
    store.data["robustdist/watchdog/9/0"] = json.dumps(_rec(5.0, 3, 1, "node 0 (host a, 10.0.0.1)")).encode()
    watch = ws.Watch("robustdist/watchdog/9", 2, limit=0.6, interval=0.2)  # watching from the start
    beat = ws.Heartbeat(lambda: store, "robustdist/watchdog/9/1", 0.2, lambda closed: {"alive": time.time(),
                        "closed": closed}, rank=1, stale_after=0.6, watch=watch).start()
    try:
        time.sleep(1.6)
    finally:
        beat.stop(wait=5)
    failed = [at for kind, _, at in store.calls if kind == "set"][2:4]
    assert len(failed) == 2 and "robustdist/watchdog/9/1" in store.data
    assert watch.changes.stopped() == [0], (watch.changes.quiet(), store.calls)
    assert watch.changes.quiet()[0] >= 1.2  # seen unchanged since the first look, across the failed writes


_SKEWED = """
import sys, time
from datetime import timedelta
import torch.distributed as d
real = time.time
time.time = lambda: real() - 1000.0  # this "node"'s wall clock is 1000 s behind the other's
from robustdist.health import Watchdog, watchdog
watchdog._generation = int(sys.argv[2]) - 1  # the key rank 0's watchdog uses (it counts a process's watchdogs)
store = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
w = Watchdog(4.0, store=store, rank=1, world_size=2)
print('ready', flush=True)
while True:  # training: beats, so this rank never hangs; its heartbeat thread writes its skewed wall time
    w.beat(3)
    time.sleep(0.2)
"""


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_rank_whose_clock_is_far_behind_is_alive_while_it_beats_and_lost_once_it_stops(single_process):
    """Only how long a record was seen unchanged decides (the liveness rule): rank 1's records carry wall times
    1000 s behind rank 0's, yet rank 0's hang report finds it alive while it runs, and lost once it is stopped."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    wd = Watchdog(4.0, store=server, rank=0, world_size=2)
    generation = wd.heartbeats[0].rsplit("/", 1)[1] if wd.heartbeats else "?"
    proc = subprocess.Popen([sys.executable, "-c", _SKEWED, str(server.port), generation], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        wd.beat()  # from now on rank 0 never beats: a verdict 4 s later
        seen = len(wd.reports)  # a verdict before the child was up (a slow start) is not the one judged here
        _wait_for(lambda: len(wd.reports) > seen, time.time() + 60, "rank 0's first hang report")
        first = wd.reports[seen]
        assert first.lost == () and first.store_reachable, first.summary
        os.kill(proc.pid, signal.SIGSTOP)  # rank 1 stops: its record stops changing
        wd.beat(1)  # a new silence on rank 0: the next verdict 4 s from now
        _wait_for(lambda: len(wd.reports) > seen + 1, time.time() + 60, "rank 0's second hang report")
        second = wd.reports[seen + 1]
        assert second.lost == (1,), second.summary
        assert re.search(r"lost rank 1 on node \S.*: no heartbeat for \d+ s or more", second.summary or ""), \
            second.summary
    finally:
        wd.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
