"""A node-local checkpoint directory is refused, never half-committed (``robustdist.checkpoint._shared``).

Two "nodes" on one host: each rank is its own process (``GROUP_RANK`` = its rank, ``LOCAL_RANK`` 0) started
as ``unshare -m --propagation private sh -c 'mount -t tmpfs tmpfs <ckpt> && exec python -m <this module> ...'``,
so each rank sees its own private tmpfs at the checkpoint directory, exactly as two nodes with node-local
disks would. The tmpfs is unmounted by the kernel when the rank (the only process in its mount namespace)
exits; ranks are killed with their process groups on any failure, and each dies with its parent
(``PR_SET_PDEATHSIG``). Every rank reports, as JSON written outside the tmpfs, the error it got and what its
own view of the checkpoint directory holds before it exits.

(a) private dirs: the first save raises on both ranks, naming both nodes and "shared storage"; nothing anywhere.
(b) the same through ``harden``: ``resume`` and ``save`` both raise.
(c) one shared directory, two nodes: save/resume works as before, no probe file is left, and the first
    save (with the check) costs little more than the next.
(d) the commit guard: with the check bypassed, sharded (DCP) state on node-local dirs is refused by rank 0
    before the manifest, nothing committed on either node; and a reported file removed between write and
    commit on a shared directory is refused the same way, leaving the previous step intact.
(e) a read-only directory: a load cannot check it (rank 0 cannot write a probe) and goes ahead; the first save
    refuses it, naming the ranks and the error.
(f) the commit guard alone, in one process: 100 reported files looked at on threads, each unseen one named
    with what rank 0 found (missing, wrong size, a link, a FIFO); only missing ones are looked for again.

(a), (b) and (e) run in turn in one launch on private dirs, each leaving the directory as empty as it found it;
(c) and the removed file of (d) run in one launch on a shared dir, each in a directory of its own; the tests
read those launches' results (module fixtures).

Hostile probe files are in ``tests/security/test_checkpoint_node_local.py`` (which uses :func:`run_nodes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.runtime.errors import CheckpointError
from robustdist.testing.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.checkpoint.test_checkpoint_shared_dir"
pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------------------- the launcher
def _isolation_works() -> bool:
    """Root, ``unshare`` and ``mount -t tmpfs`` in a private mount namespace all work here (asked in the test
    process only, never inside a rank)."""
    if "ROBUSTDIST_TEST_PARENT" in os.environ or os.geteuid() != 0:
        return False
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /mnt && umount /mnt"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


ISOLATION = _isolation_works()
needs_isolation = pytest.mark.skipif(not ISOLATION, reason="needs root and unshare/mount (private mount namespaces)")


def run_nodes(module: str, scenario: str, tmp_path: Path, *, private: bool, world_size: int = 2,
              args: Sequence[Any] = (), timeout: float = 60.0) -> list[dict[str, Any]]:
    """Run ``<module>.<scenario>(rank, ckpt_dir, *args)`` on ``world_size`` ranks, one "node" each.

    ``private``: each rank gets its own tmpfs at ``ckpt_dir`` (a node-local directory); else all share it.
    Returns each rank's JSON-able return value; fails the test (after killing every rank) on a crash or hang.
    """
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"rank{r}.log" for r in range(world_size)]
    outs = [tmp_path / f"rank{r}.json" for r in range(world_size)]
    try:
        for rank in range(world_size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                   "ROBUSTDIST_TEST_PARENT": str(os.getpid())}
            cmd = [sys.executable, "-m", MODULE, module, scenario, str(ckpt), str(outs[rank]), json.dumps(list(args))]
            if private:
                cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                       'mount -t tmpfs -o size=64m tmpfs "$0" && exec "$@"', str(ckpt), *cmd]
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        _wait(procs, outs, logs, timeout)
        results = []
        for rank in range(world_size):
            if not outs[rank].exists():
                pytest.fail(f"rank {rank} exited {procs[rank].returncode} without a result; its log:\n"
                            f"{_tail(logs[rank])}")
            result = json.loads(outs[rank].read_text())
            if "crash" in result:
                pytest.fail(f"rank {rank} raised:\n{result['crash']}\nits log:\n{_tail(logs[rank])}")
            results.append(result["ok"])
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if private:  # the tmpfs lived only in the ranks' namespaces: nothing is mounted here
            assert str(ckpt) not in Path("/proc/self/mountinfo").read_text()


def _wait(procs: list[subprocess.Popen[bytes]], outs: list[Path], logs: list[Path], timeout: float) -> None:
    """Until every rank exits; fail at once when one exits without a result (the others are then killed)."""
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in procs):
        for rank, proc in enumerate(procs):
            if proc.poll() is not None and not outs[rank].exists():
                pytest.fail(f"rank {rank} exited {proc.returncode} without a result (the others are killed); its "
                            f"log:\n{_tail(logs[rank])}")
        if time.monotonic() > deadline:
            running = [r for r, proc in enumerate(procs) if proc.poll() is None]
            pytest.fail(f"ranks {running} still running after {timeout:g} s (killed); their logs:\n"
                        + "\n".join(_tail(logs[r]) for r in running))
        time.sleep(0.05)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


# ----------------------------------------------------------------------------------------------- inside a rank
def _rank_main(argv: list[str]) -> None:
    module, scenario, ckpt, out, args = argv[0], argv[1], argv[2], argv[3], json.loads(argv[4])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: die with the test process
    if os.getppid() != int(os.environ["ROBUSTDIST_TEST_PARENT"]):
        os._exit(1)
    try:
        fn = getattr(importlib.import_module(module), scenario)
        result: dict[str, Any] = {"ok": fn(int(os.environ["RANK"]), ckpt, *args)}
    except BaseException:
        result = {"crash": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(out + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(out + ".tmp", out)


def init_group() -> None:
    """The rank's gloo group; a scenario run after another in the same rank keeps the group already made."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))


def attempt(call: Callable[[], Any]) -> dict[str, Any]:
    """Run ``call``: ``{"error": message, "ranks": [...], "seconds": s}`` or ``{"error": None, ...}``."""
    start = time.monotonic()
    try:
        call()
        return {"error": None, "ranks": None, "seconds": time.monotonic() - start}
    except CheckpointError as e:
        return {"error": str(e), "ranks": list(e.ranks or ()), "seconds": time.monotonic() - start}


def listing(directory: str) -> list[str]:
    """Everything under ``directory``, as this rank sees it (relative paths, sorted)."""
    found = []
    for root, dirs, files in os.walk(directory):
        found += [os.path.relpath(os.path.join(root, n), directory) for n in [*dirs, *files]]
    return sorted(found)


def save_on_private_dirs(rank: int, ckpt: str) -> dict[str, Any]:
    init_group()
    checkpointer = AtomicCheckpointer(ckpt, timeout=30, arrival_timeout=15)
    try:
        first = attempt(lambda: checkpointer.save(1, {"w": torch.ones(3)}))
        second = attempt(lambda: checkpointer.save(1, {"w": torch.ones(3)}))  # still refused: the check reruns
        return {"first": first, "second": second, "steps": checkpointer.steps(), "seen": listing(ckpt)}
    finally:
        checkpointer.close()


def harden_on_private_dirs(rank: int, ckpt: str) -> dict[str, Any]:
    from robustdist import harden
    from tests import _training as tr

    cfg = {"checkpoint": {"dir": ckpt}, "health": {"hang_timeout": None}, "distributed": {"timeout": 30}}
    init_group()  # harden adopts it (its own rendezvous refuses a loopback MASTER_ADDR across "nodes")
    with harden(tr.make_model(), None, cfg) as h:
        resumed = attempt(h.resume)
        saved = attempt(lambda: h.save(1, force=True))
        return {"resume": resumed, "save": saved, "steps": h.checkpointer.steps(), "seen": listing(ckpt)}


def save_and_resume_shared(rank: int, ckpt: str) -> dict[str, Any]:
    init_group()
    torch.manual_seed(0)  # the same model and step on both ranks (rank 0 saves the replicated state)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    times = []
    with AtomicCheckpointer(ckpt, timeout=30, arrival_timeout=15) as checkpointer:
        for step in (1, 2, 3):
            start = time.perf_counter()
            checkpointer.save(step, {"model": model, "optimizer": opt, "note": {"step": step}}, per_rank={"r": rank})
            times.append(time.perf_counter() - start)
        seen_after_save = listing(ckpt)
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with AtomicCheckpointer(ckpt, timeout=30, arrival_timeout=15) as again:
        loaded = again.load(state={"model": fresh, "optimizer": fresh_opt})
        steps = again.steps()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    buffers = [o.state_dict()["state"][0]["momentum_buffer"] for o in (opt, fresh_opt)]
    momentum = buffers[0].equal(buffers[1])
    return {"step": loaded.step, "per_rank": loaded.per_rank, "note": loaded.state["note"], "same": same and momentum,
            "steps": steps, "world_size": loaded.manifest["world_size"], "times": times,
            "seen_after_save": seen_after_save, "seen": listing(ckpt)}


def refusals_on_private_dirs(rank: int, ckpt: str) -> dict[str, Any]:
    """(a), (b) and (e) in turn in one group, each leaving the directory empty for the next: the plain save, the
    same through ``harden``, then the directory remounted read-only."""
    results = {"save": save_on_private_dirs(rank, ckpt), "harden": harden_on_private_dirs(rank, ckpt)}
    results["read_only"] = read_only_private_dirs(rank, ckpt)
    return results


def shared_dir_scenarios(rank: int, ckpt: str) -> dict[str, Any]:
    """(c) and the removed file of (d) in one group, each in a directory of its own under the shared one."""
    init_group()
    out = {}
    for name, scenario in (("resume", save_and_resume_shared), ("removed", file_removed_before_the_commit)):
        os.makedirs(os.path.join(ckpt, name), exist_ok=True)
        out[name] = scenario(rank, os.path.join(ckpt, name))
    return out


def sharded_without_the_check(rank: int, ckpt: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from robustdist.checkpoint import checkpointer as facade

    facade.check_shared_dir = lambda ctx, writing: True  # bypass step 0: only the commit's guard is left
    init_group()
    mesh = init_device_mesh("cpu", (2,))
    sharded = {"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}
    with AtomicCheckpointer(ckpt, timeout=30, arrival_timeout=15) as checkpointer:
        out = attempt(lambda: checkpointer.save(1, {"sh": sharded, "n": 1}))
        return {**out, "steps": checkpointer.steps(), "seen": listing(ckpt)}


def file_removed_before_the_commit(rank: int, ckpt: str) -> dict[str, Any]:
    from robustdist.checkpoint import _faults

    init_group()
    with AtomicCheckpointer(ckpt, timeout=30, arrival_timeout=15) as checkpointer:
        checkpointer.save(1, {"w": torch.ones(2)})
        if rank == 1:  # between this rank's write and rank 0's commit (before the report)
            def remove_own(phase: str) -> None:
                if phase == "files_written":
                    for name in os.listdir(ckpt):
                        if name.startswith(".tmp-step_0000000002"):
                            os.unlink(os.path.join(ckpt, name, "rank_00001.pt"))
            _faults.HOOK = remove_own
        out = attempt(lambda: checkpointer.save(2, {"w": torch.full((2,), 2.0)}))
        _faults.HOOK = None
        loaded = checkpointer.load(state={})
        return {**out, "steps": checkpointer.steps(), "loaded": loaded.step, "seen": listing(ckpt)}


def read_only_private_dirs(rank: int, ckpt: str) -> dict[str, Any]:
    subprocess.run(["mount", "-o", "remount,ro", ckpt], check=True, timeout=10)  # this rank's namespace only
    init_group()
    with AtomicCheckpointer(ckpt, timeout=30, arrival_timeout=15) as checkpointer:
        loaded = attempt(lambda: checkpointer.load(missing_ok=True))
        saved = attempt(lambda: checkpointer.save(1, {"w": torch.ones(2)}))
        return {"load": loaded, "save": saved, "seen": listing(ckpt)}


# ----------------------------------------------------------------------------------------------- the tests
FIX = ("Fix: put checkpoint.dir on shared storage that every node mounts at the same path (NFS, Lustre, or a "
       "bucket mount such as gcsfuse or s3fs), or run the job on one node.")


def _assert_unshared(message: str, rank: int, ckpt: Path, what: str) -> None:
    assert message.startswith(f"[rank {rank}] the checkpoint directory {ckpt} (checkpoint.dir) is not the same "
                              "directory on every node: rank 1 on node 1 (host "), message
    assert ") and rank 0 on node 0 (host " in message and ") do not see each other's files (" in message
    assert "rank 0 found no such file where rank 1 wrote its probe .robustdist-probe-00001-" in message
    assert "rank 1 found no such file where rank 0 wrote its probe .robustdist-probe-00000-" in message
    assert ("Expected one directory that every rank sees: rank 0 commits a manifest listing the files every rank "
            f"writes, and every rank reads rank 0's files on resume. {what}. {FIX}") in message


@pytest.fixture(scope="module")
def private_refusals(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch on private dirs that (a), (b) and (e) read: its directory and each rank's results."""
    tmp_path = tmp_path_factory.mktemp("private")
    return tmp_path, run_nodes(MODULE, "refusals_on_private_dirs", tmp_path, private=True, timeout=90)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch on a shared dir that (c) and the removed file of (d) read: its directory and each rank's results."""
    tmp_path = tmp_path_factory.mktemp("shared")
    return tmp_path, run_nodes(MODULE, "shared_dir_scenarios", tmp_path, private=False, timeout=90)


@pytest.mark.processes
@needs_isolation
@pytest.mark.xdist_group("shared_dir_private")  # one worker makes the launch the three tests read
def test_a_node_local_directory_is_refused_at_the_first_save_on_every_rank(private_refusals):
    tmp_path, results = private_refusals
    for rank, out in enumerate(r["save"] for r in results):
        for attempt_ in (out["first"], out["second"]):
            _assert_unshared(attempt_["error"], rank, tmp_path / "ckpt", "Nothing was saved or committed")
            assert attempt_["ranks"] == [0, 1] and attempt_["seconds"] < 10
        assert out["steps"] == [] and out["seen"] == []  # no step, no staging dir, no lock, no probe: on either node


@pytest.mark.processes
@needs_isolation
@pytest.mark.xdist_group("shared_dir_private")
def test_harden_resume_and_save_refuse_a_node_local_directory(private_refusals):
    tmp_path, results = private_refusals
    for rank, out in enumerate(r["harden"] for r in results):
        _assert_unshared(out["resume"]["error"], rank, tmp_path / "ckpt", "Nothing was loaded")
        _assert_unshared(out["save"]["error"], rank, tmp_path / "ckpt", "Nothing was saved or committed")
        assert out["steps"] == [] and out["seen"] == []


@pytest.mark.processes
@pytest.mark.xdist_group("shared_dir_shared")  # one worker makes the launch the two tests read
def test_two_nodes_sharing_one_directory_save_and_resume_as_before(shared_runs):
    for rank, out in enumerate(r["resume"] for r in shared_runs[1]):
        assert (out["step"], out["steps"], out["world_size"], out["same"]) == (3, [1, 2, 3], 2, True)
        assert out["per_rank"] == {"r": rank} and out["note"] == {"step": 3}
        assert out["seen_after_save"] == out["seen"] and not [n for n in out["seen"] if "probe" in n]


@pytest.mark.processes
@needs_isolation
def test_the_commit_guard_refuses_files_rank_0_cannot_see_even_without_the_check(tmp_path):
    results = run_nodes(MODULE, "sharded_without_the_check", tmp_path, private=True)
    for rank, out in enumerate(results):
        message = out["error"]
        assert message.startswith(f"[rank {rank}] checkpoint step 1 was not committed: rank 0 does not see files "
                                  "that rank 1 reported writing (rank 1 on node 1 (host "), message
        assert "): rank_00001.pt (missing), sharded/__1_0.distcp (missing)). Expected each of them in " in message
        assert (f"the checkpoint directory {tmp_path / 'ckpt'} (checkpoint.dir) is not the same directory on every "
                "node (or something removed the files). Nothing was committed and the staging directory was "
                f"removed; the previous checkpoints are untouched. {FIX}") in message
        assert out["ranks"] == [1] and out["steps"] == []
    assert results[0]["seen"] == [".lock"] and results[1]["seen"] == []  # rank 1's node-local staging dir went too


@pytest.mark.processes
@pytest.mark.xdist_group("shared_dir_shared")
def test_a_reported_file_removed_before_the_commit_is_refused_and_the_previous_step_stays(shared_runs):
    for rank, out in enumerate(r["removed"] for r in shared_runs[1]):
        assert out["error"].startswith(f"[rank {rank}] checkpoint step 2 was not committed: rank 0 does not see files "
                                       "that rank 1 reported writing (rank 1 on node 1 (host "), out["error"]
        assert "rank_00001.pt (missing))" in out["error"] and out["ranks"] == [1]
        assert (out["steps"], out["loaded"]) == ([1], 1)
        assert out["seen"] == [".lock", "step_0000000001", *[f"step_0000000001/{n}" for n in (
            "manifest.json", "rank_00000.pt", "rank_00001.pt", "replicated.pt")]]


@pytest.mark.processes
@needs_isolation
@pytest.mark.xdist_group("shared_dir_private")
def test_a_read_only_directory_is_loaded_from_unchecked_and_refused_at_the_first_save(private_refusals):
    tmp_path, results = private_refusals
    for rank, out in enumerate(r["read_only"] for r in results):
        assert out["load"]["error"] is None
        message = out["save"]["error"]
        assert message.startswith(f"[rank {rank}] ranks 0, 1 could not create a probe file in the checkpoint "
                                  f"directory {tmp_path / 'ckpt'} (rank 0 on node 0 ("), message
        assert ("OSError: Read-only file system); expected a directory every rank can write, since every rank writes "
                "its own files there. Nothing was saved. Fix: make checkpoint.dir writable by every rank, on storage "
                "every node shares.") in message
        assert out["save"]["ranks"] == [0, 1] and out["seen"] == []


def test_the_commit_guard_names_each_unseen_file_of_many_on_threads(tmp_path):
    from robustdist.checkpoint._shared import refusal, unseen_files

    staging = tmp_path / ".tmp-step_0000000001-abc"
    (staging / "sharded").mkdir(parents=True)
    reports = {r: (None, {f"sharded/__{r}_0.distcp": {"size": 3}, f"rank_{r:05d}.pt": {"size": 3}}, f"node {r}")
               for r in range(50)}  # 100 files: looked at on threads
    for r in range(50):
        (staging / "sharded" / f"__{r}_0.distcp").write_bytes(b"abc")
        (staging / f"rank_{r:05d}.pt").write_bytes(b"abc")
    (staging / "rank_00007.pt").unlink()
    (staging / "rank_00008.pt").write_bytes(b"abcd")
    (staging / "rank_00009.pt").unlink()
    (staging / "rank_00009.pt").symlink_to(staging / "rank_00010.pt")
    (staging / "sharded" / "__11_0.distcp").unlink()
    os.mkfifo(staging / "sharded" / "__11_0.distcp")
    start = time.monotonic()
    unseen = unseen_files(str(staging), reports)
    assert time.monotonic() - start < 0.5  # something is wrong beyond missing: no grace wait
    assert unseen == {(7, "rank_00007.pt"): "missing", (8, "rank_00008.pt"): "4 bytes, not the 3 rank 8 wrote",
                      (9, "rank_00009.pt"): "a symbolic link", (11, "sharded/__11_0.distcp"): "a FIFO"}
    error = refusal(1, str(tmp_path), str(staging), unseen, {r: reports[r][2] for r in reports})
    assert error.ranks == (7, 8, 9, 11) and str(error).startswith(
        "checkpoint step 1 was not committed: rank 0 does not see files that ranks 7, 8, 9, 11 reported writing "
        "(rank 7 on node 7: rank_00007.pt (missing); rank 8 on node 8: rank_00008.pt (4 bytes, not the 3 rank 8 "
        "wrote); rank 9 on node 9: rank_00009.pt (a symbolic link); rank 11 on node 11: sharded/__11_0.distcp "
        f"(a FIFO)). Expected each of them in {staging}, as written, before rank 0 commits the manifest")
    (staging / "rank_00008.pt").write_bytes(b"abc")
    (staging / "rank_00009.pt").unlink()
    (staging / "rank_00009.pt").write_bytes(b"abc")
    (staging / "sharded" / "__11_0.distcp").unlink()
    (staging / "sharded" / "__11_0.distcp").write_bytes(b"abc")
    start = time.monotonic()
    assert unseen_files(str(staging), reports) == {(7, "rank_00007.pt"): "missing"}
    assert 0.9 < time.monotonic() - start < 3  # only missing: looked for again for GRACE_S (1 s)


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
