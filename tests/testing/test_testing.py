"""run_ranks, with real processes: results, raising, killed, exiting and hanging ranks, and no orphans."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from robustdist.runtime.errors import HangError, RanksFailed, RanksTimeout
from robustdist.testing.ranks import run_ranks


@pytest.fixture(autouse=True)
def _unscaled(monkeypatch):
    """These tests check run_ranks' own timeout and its message: the suite's load allowance stays out."""
    monkeypatch.setenv("ROBUSTDIST_TEST_TIMEOUT_SCALE", "1")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _sum_of_ranks(rank, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item() * scale, "world": dist.get_world_size(), "threads": os.environ["OMP_NUM_THREADS"]}


@pytest.mark.processes
def test_returns_each_ranks_value_in_rank_order():
    out = run_ranks(_sum_of_ranks, 3, args=(2,), timeout=60)
    assert out == [{"rank": r, "sum": 6.0, "world": 3, "threads": "1"} for r in range(3)]


def _env_probe(rank):
    return os.environ.get("PROBE"), os.environ.get("HOME") is None, dist.is_initialized()


@pytest.mark.processes
def test_env_per_rank_and_unset_and_no_init():
    out = run_ranks(_env_probe, 2, init=False, env=[{"PROBE": "a"}, {"PROBE": "b", "HOME": None}], timeout=60)
    assert out == [("a", False, False), ("b", True, False)]
    assert "PROBE" not in os.environ  # the parent's env is untouched


def _bind_master_port(rank):
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError as e:
            return int(os.environ["MASTER_PORT"]), e.errno
    return int(os.environ["MASTER_PORT"]), 0


@pytest.mark.processes
def test_the_master_port_stays_reserved_until_the_run_ends():
    """Nothing else can take MASTER_PORT between picking it and rank 0 binding it (a parallel test run once
    lost it that way: EADDRINUSE at init); the store still binds it, as every init=True test shows."""
    import errno
    import socket

    out = run_ranks(_bind_master_port, 2, init=False)
    port = out[0][0]
    assert out == [(port, errno.EADDRINUSE)] * 2
    with socket.socket() as s:  # let go when the run ends
        s.bind(("127.0.0.1", port))


def _raise_on_rank_1(rank):
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    return rank


@pytest.mark.processes
def test_raising_rank_gives_its_traceback():
    with pytest.raises(RanksFailed) as exc:
        run_ranks(_raise_on_rank_1, 2, init=False, timeout=60)
    err = exc.value
    assert err.ranks == (1,)
    assert set(err.failures) == {1}
    assert "1 of 2 ranks failed (rank 1); expected every rank to return." in str(err)
    assert "rank 1 raised:\nTraceback (most recent call last):" in err.failures[1]
    assert "ValueError: bad batch on rank 1" in err.failures[1]
    assert "_raise_on_rank_1" in err.failures[1]


def _raise_then_peer_sees_it(rank):
    if rank == 1:
        raise RuntimeError("rank 1 gave up")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 never joins: gloo reports the closed peer quickly
    return rank


@pytest.mark.processes
def test_a_raising_rank_does_not_hang_its_peers():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as exc:
        run_ranks(_raise_then_peer_sees_it, 2, timeout=60)
    assert time.monotonic() - start < 30
    assert 1 in exc.value.ranks
    assert "RuntimeError: rank 1 gave up" in exc.value.failures[1]


def _sigkill_rank_1(rank):
    if rank == 1:
        os.kill(os.getpid(), 9)
    return rank


@pytest.mark.processes
def test_rank_killed_by_signal_is_named():
    with pytest.raises(RanksFailed) as exc:
        run_ranks(_sigkill_rank_1, 2, init=False, timeout=60)
    assert exc.value.ranks == (1,)
    assert exc.value.failures[1] == "rank 1 died by signal SIGKILL (9) without returning a result (its stderr says why)"


def _exit_3(rank):
    if rank == 0:
        os._exit(3)
    return rank


@pytest.mark.processes
def test_rank_exiting_without_result_is_named():
    with pytest.raises(RanksFailed) as exc:
        run_ranks(_exit_3, 2, init=False, timeout=60)
    assert exc.value.failures == {0: "rank 0 exited with code 3 without returning a result (its stderr says why)"}


def _hang_rank_1(rank, pid_dir):
    if rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(pid_dir, "pids"), "w") as fh:
            fh.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    return rank


@pytest.mark.processes
def test_hanging_rank_is_killed_with_its_children_and_named(tmp_path):
    start = time.monotonic()
    with pytest.raises(RanksTimeout) as exc:
        run_ranks(_hang_rank_1, 2, args=(str(tmp_path),), init=False, timeout=8)
    elapsed = time.monotonic() - start
    assert elapsed < 8 + 10
    err = exc.value
    assert isinstance(err, HangError) and isinstance(err, RanksFailed)
    assert err.ranks == (1,)
    text = str(err)
    assert text.startswith("rank 1 had not finished after 8 s and was killed; expected every rank to return")
    assert "rank 1 stack:" in text and "in _hang_rank_1" in text  # faulthandler's dump of the sleeping frame
    rank_pid, grandchild_pid = (int(x) for x in (tmp_path / "pids").read_text().split())
    deadline = time.monotonic() + 5
    while (_alive(rank_pid) or _alive(grandchild_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank_pid), "the hung rank survived"
    assert not _alive(grandchild_pid), "the hung rank's child survived (orphan)"


def _hang_and_fail(rank):
    if rank == 0:
        raise KeyError("missing shard")
    time.sleep(600)


@pytest.mark.processes
def test_timeout_report_also_carries_failures():
    with pytest.raises(RanksTimeout) as exc:
        run_ranks(_hang_and_fail, 2, init=False, timeout=6)
    assert exc.value.ranks == (0, 1)
    assert "KeyError: 'missing shard'" in exc.value.failures[0]
    assert "KeyError: 'missing shard'" in str(exc.value)


def _unpicklable_result(rank):
    return lambda: rank


@pytest.mark.processes
def test_unpicklable_return_value_is_a_failure():
    with pytest.raises(RanksFailed, match="the return value of rank 0 does not pickle"):
        run_ranks(_unpicklable_result, 1, init=False, timeout=60)


def test_bad_arguments_fail_before_starting_anything():
    with pytest.raises(TypeError, match="move fn to module top level"):
        run_ranks(lambda rank: rank, 2)
    with pytest.raises(ValueError, match="env has 1 per-rank mappings but world_size=2"):
        run_ranks(_env_probe, 2, env=[{}])
    with pytest.raises(ValueError, match="world_size=0; expected at least 1"):
        run_ranks(_env_probe, 0)


def test_ranks_failed_survives_pickling():
    err = RanksFailed("boom", failures={1: "rank 1 raised"})
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.ranks, again.failures, str(again)) == (RanksFailed, (1,), {1: "rank 1 raised"}, "boom")


def _child_square(x, queue):
    queue.put(x * x)


def _rank_with_a_child_process(rank):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_square, args=(rank + 2, queue))
    child.start()  # ranks are not daemonic, so they may have children (DataLoader workers)
    child.join(30)
    return queue.get(timeout=30)


@pytest.mark.processes
def test_ranks_may_start_child_processes():
    assert run_ranks(_rank_with_a_child_process, 2, init=False, timeout=60) == [4, 9]


def _return_tensors(rank):
    return {"t": torch.arange(4) * rank, "big": torch.ones(100_000)}


@pytest.mark.processes
def test_tensors_come_back_intact_after_the_rank_exits():
    # multiprocessing's pickler would send torch shared-memory handles that die with the rank
    out = run_ranks(_return_tensors, 2, init=False, timeout=60)
    assert torch.equal(out[1]["t"], torch.tensor([0, 1, 2, 3])) and out[0]["big"].sum().item() == 100_000
