"""Fault injection for AtomicCheckpointer: each case checks that the newest committed checkpoint still loads
and equals what was saved at that step. Crashes are real SIGKILLs of real processes."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from robustdist.checkpoint import AtomicCheckpointer, _faults, verify_all
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, RanksFailed, RobustDistWarning
from robustdist.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def state_for(step, size=64):
    return {"weights": torch.full((size,), float(step)), "meta": {"step": step}}


def _child(directory, last, phase, action, *extra):
    return subprocess.run([sys.executable, "-m", "tests.faults.child", str(directory), str(last), phase, action,
                           *map(str, extra)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _assert_newest(directory, step):
    """The newest valid checkpoint is ``step`` and holds exactly what was saved at ``step``."""
    with AtomicCheckpointer(directory) as ckpt:
        loaded = ckpt.load()
        assert loaded.step == step
        assert torch.equal(loaded.state["weights"], state_for(step)["weights"])
        assert loaded.state["meta"] == {"step": step}


def _entries(directory):
    return sorted(n for n in os.listdir(directory) if n != ".lock")


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    _faults.HOOK = None


# 1. SIGKILL of the writer in each phase ------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize(("phase", "newest"), [("writing", 2), ("files_written", 2), ("manifest_written", 2),
                                                ("rotating", 3)])
def test_sigkill_in_each_phase(tmp_path, phase, newest):
    out = _child(tmp_path, 3, phase, "kill")
    assert out.returncode == -9, out.stderr
    committed = [n for n in _entries(tmp_path) if n.startswith("step_")]
    assert committed == [f"step_{s:010d}" for s in (newest - 1, newest)]  # rotating: step 1 already in the trash
    assert all(row["status"] == "ok" for row in verify_all(tmp_path))  # nothing half-written is visible
    _assert_newest(tmp_path, newest)
    with AtomicCheckpointer(tmp_path, keep_last=2) as ckpt:  # a fresh process's next save cleans up
        ckpt.save(4, state_for(4))
    assert not [n for n in _entries(tmp_path) if n.startswith((".tmp-", ".trash-", ".old-"))]
    _assert_newest(tmp_path, 4)


# 2. write failures mid-file ------------------------------------------------------------------------------
@pytest.mark.processes
def test_efbig_from_a_real_file_size_limit(tmp_path):
    out = _child(tmp_path, 2, "-", "efbig", 1 << 20)  # a 4 MiB tensor under a 1 MiB RLIMIT_FSIZE
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "error" and result["type"] == "CheckpointError"
    assert "checkpoint step 2 was not committed: 1 rank(s) failed (rank 0:" in result["message"]
    assert "File too large" in result["message"] or "EFBIG" in result["message"] or "Errno 27" in result["message"]
    assert _entries(tmp_path) == ["step_0000000001"]  # destination unchanged, tmp dir removed
    _assert_newest(tmp_path, 1)


def test_injected_enospc(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state_for(1))

        def hook(name):
            if name == "writing":
                raise OSError(errno.ENOSPC, "No space left on device")

        _faults.HOOK = hook
        with pytest.raises(CheckpointError, match=r"checkpoint step 2 was not committed: .*No space left on device") as e:
            ckpt.save(2, state_for(2))
        assert isinstance(e.value.__cause__, OSError)
    assert _entries(tmp_path) == ["step_0000000001"]
    _assert_newest(tmp_path, 1)


# 3. corruption of the newest checkpoint ------------------------------------------------------------------
def _truncate(p):
    p.write_bytes(p.read_bytes()[:-10])


def _flip(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


@pytest.mark.processes
@pytest.mark.parametrize(("damage", "target", "reason"), [
    (_truncate, "replicated.pt", "bytes, expected"),
    (_flip, "replicated.pt", "CRC-32 differs from the manifest"),
    (os.remove, "manifest.json", "manifest.json: missing"),
    (os.remove, "rank_00000.pt", "rank_00000.pt: missing"),
])
def test_corrupt_newest_falls_back_with_a_warning(tmp_path, damage, target, reason):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state_for(1))
        ckpt.save(2, state_for(2))
    damage(tmp_path / "step_0000000002" / target)
    with pytest.warns(RobustDistWarning, match=r"checkpoint step 2 failed verification \(rank 0: ") as record:
        _assert_newest(tmp_path, 1)
    message = str(record[0].message)
    assert f"step_0000000002/{target}" in message and reason in message
    assert message.endswith("falling back to the previous committed checkpoint.")
    out = subprocess.run([sys.executable, "-m", "robustdist", "verify-checkpoint", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    rows = out.stdout.splitlines()
    assert rows[0].split() == ["step", "files", "bytes", "status", "reason"]
    assert rows[1].split()[3] == "ok" and rows[2].split()[3] == "corrupt" and reason in rows[2]


def test_no_valid_checkpoint_raises(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state_for(1))
    _flip(tmp_path / "step_0000000001" / "replicated.pt")
    with pytest.warns(RobustDistWarning), pytest.raises(CheckpointCorruptError, match="no valid checkpoint in"):
        AtomicCheckpointer(tmp_path).load()


# 4 and 5. failures on one of two real ranks --------------------------------------------------------------
def _rank1_raises(rank, directory):
    ckpt = AtomicCheckpointer(directory, timeout=60)
    ckpt.save(1, state_for(1))
    if rank == 1:
        def hook(name):
            if name == "writing":
                raise PermissionError(13, "Permission denied", "rank_00001.pt")
        _faults.HOOK = hook
    try:
        ckpt.save(2, state_for(2))
    except CheckpointError as e:
        return str(e), e.ranks
    finally:
        _faults.HOOK = None
    return None


@pytest.mark.processes
def test_a_raising_rank_fails_the_save_on_every_rank(tmp_path):
    start = time.monotonic()
    out = run_ranks(_rank1_raises, 2, args=(str(tmp_path),), timeout=90)
    assert time.monotonic() - start < 60
    for rank, (message, ranks) in enumerate(out):
        assert message.startswith(f"[rank {rank}] checkpoint step 2 was not committed: 1 rank(s) failed (rank 1: "
                                  "PermissionError: [Errno 13] Permission denied")
        assert ranks == (1,)
    assert _entries(tmp_path) == ["step_0000000001"]
    _assert_newest(tmp_path, 1)


def _rank1_killed(rank, directory):
    ckpt = AtomicCheckpointer(directory, timeout=30)
    ckpt.save(1, state_for(1))
    if rank == 1:
        _faults.HOOK = lambda name: os.kill(os.getpid(), 9) if name == "writing" else None
    start = time.monotonic()
    try:
        ckpt.save(2, state_for(2))
    except CheckpointError as e:
        Path(directory, "rank0.json").write_text(json.dumps([str(e), e.ranks, time.monotonic() - start]))
    return None


@pytest.mark.processes
def test_a_killed_rank_fails_the_save_within_the_timeout(tmp_path):
    with pytest.raises(RanksFailed) as exc:
        run_ranks(_rank1_killed, 2, args=(str(tmp_path),), timeout=90)
    assert exc.value.ranks == (1,) and "SIGKILL" in exc.value.failures[1]
    message, ranks, elapsed = json.loads((tmp_path / "rank0.json").read_text())
    assert message.startswith("[rank 0] checkpoint not committed: rank 1 never reported (died or hung)")
    assert ranks == [1] and elapsed < 30 + 5
    assert [n for n in _entries(tmp_path) if n.startswith("step_")] == ["step_0000000001"]
    _assert_newest(tmp_path, 1)


# 6. two writers ------------------------------------------------------------------------------------------
HOLDER = "import sys, time; from robustdist.checkpoint import AtomicCheckpointer; import torch\n" \
         "c = AtomicCheckpointer(sys.argv[1]); c.save(1, {'weights': torch.full((64,), 1.0), 'meta': {'step': 1}})\n" \
         "print('ready', flush=True); time.sleep(120)"


@pytest.mark.processes
def test_a_second_writer_fails_fast_and_a_dead_holder_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=rf"is locked by another job \(pid {holder.pid} on host "):
            AtomicCheckpointer(tmp_path).save(2, state_for(2))
        assert time.monotonic() - start < 5
        _assert_newest(tmp_path, 1)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    with AtomicCheckpointer(tmp_path) as ckpt:  # the kernel released the dead holder's lock
        ckpt.save(2, state_for(2))
    _assert_newest(tmp_path, 2)


RELEASING = "import sys, time; from robustdist.checkpoint import AtomicCheckpointer; import torch\n" \
            "c = AtomicCheckpointer(sys.argv[1]); c.save(1, {'weights': torch.full((64,), 1.0), 'meta': {'step': 1}})\n" \
            "print('ready', flush=True); time.sleep(1.5); c.close(); time.sleep(60)"


@pytest.mark.processes
def test_a_patient_writer_waits_for_the_holder_to_release(tmp_path):
    """lock_patience (a Ray Tune trial that moved to another actor): the save waits while the holder still holds
    the lock, and commits once it lets go; no patience refuses at once, as above."""
    holder = subprocess.Popen([sys.executable, "-c", RELEASING, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        start = time.monotonic()
        with AtomicCheckpointer(tmp_path, lock_patience=30) as ckpt:
            ckpt.save(2, state_for(2))
        assert 0.5 < time.monotonic() - start < 25  # it waited for the release, not for its patience's end
        _assert_newest(tmp_path, 2)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    for bad in (-1, "30", True, float("nan")):
        with pytest.raises(CheckpointError, match=r"lock_patience=.*; expected a number of seconds in \[0, 1e9\]"):
            AtomicCheckpointer(tmp_path, lock_patience=bad)


# 7. a malicious pickle -----------------------------------------------------------------------------------
class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    ckpt_dir, victim = tmp_path / "ckpt", tmp_path / "pwned"
    with AtomicCheckpointer(ckpt_dir) as ckpt:
        ckpt.save(1, state_for(1))
    step_dir = ckpt_dir / "step_0000000001"
    payload = step_dir / "replicated.pt"
    torch.save({"weights": _Evil(str(victim))}, payload, pickle_protocol=2)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    from robustdist.checkpoint._io import sha256_file

    size, sha = sha256_file(str(payload))
    manifest["files"]["replicated.pt"] = {"size": size, "sha256": sha}  # the attacker recomputes the manifest
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"replicated.pt: refused to load: .*nothing was executed"):
        AtomicCheckpointer(ckpt_dir).load()
    assert not victim.exists()


def test_dcp_metadata_with_code_is_refused(tmp_path):
    from robustdist.checkpoint._sharded import check_metadata

    meta = tmp_path / ".metadata"
    meta.write_bytes(pickle.dumps(_Evil(str(tmp_path / "pwned"))))
    with pytest.raises(CheckpointError, match="refused to load: it holds .* is not allowed in DCP metadata"):
        check_metadata(str(meta))
    assert not (tmp_path / "pwned").exists()


# 8. bit-identical resume after a real crash --------------------------------------------------------------
def _train(mode, directory):
    return subprocess.run([sys.executable, "-m", "tests.faults.train", mode, str(directory)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.processes
def test_resume_after_sigkill_is_bit_identical(tmp_path):
    crashed = _train("crash", tmp_path / "b")  # the straight run first (its line), then the crash, in one process
    assert crashed.returncode == -9, crashed.stderr  # killed itself at step 13, after the step-10 checkpoint
    straight = json.loads(crashed.stdout.splitlines()[0])
    resumed = _train("resume", tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed_from"] == 10
    assert json.loads(resumed.stdout)["params_sha256"] == straight["params_sha256"]


# 9. keep_last --------------------------------------------------------------------------------------------
def test_keep_last(tmp_path):
    with AtomicCheckpointer(tmp_path, keep_last=3) as ckpt:
        for step in range(10):
            ckpt.save(step, state_for(step))
        assert ckpt.steps() == [7, 8, 9]
        ckpt.load(7)  # the checkpoint loaded from is never rotated out
        ckpt.save(10, state_for(10))
        assert ckpt.steps() == [7, 9, 10]
    assert _entries(tmp_path) == ["step_0000000007", "step_0000000009", "step_0000000010"]


# 10. an async save's background error surfaces -----------------------------------------------------------
@pytest.mark.parametrize("surface", ["wait", "save", "close"])
def test_async_error_surfaces_at_the_next_call(tmp_path, surface):
    ckpt = AtomicCheckpointer(tmp_path, async_save=True)
    ckpt.save(1, state_for(1))
    ckpt.wait()

    def hook(name):
        if name == "writing":
            raise OSError(errno.EIO, "Input/output error")

    _faults.HOOK = hook
    info = ckpt.save(2, state_for(2))
    assert info.done.wait(30)
    _faults.HOOK = None
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 was not committed: .*Input/output error"):
        {"wait": ckpt.wait, "close": ckpt.close, "save": lambda: ckpt.save(3, state_for(3))}[surface]()
    ckpt.close()
    _assert_newest(tmp_path, 1)


# 11. world-size change on resume -------------------------------------------------------------------------
def _save_on_ranks(rank, directory):
    torch.manual_seed(100 + rank)
    ckpt = AtomicCheckpointer(directory)
    ckpt.save(5, state_for(5))
    ckpt.close()
    return torch.rand(3).tolist()  # what each rank's RNG yields right after the save


def _load_on_ranks(rank, directory):
    import warnings

    ckpt = AtomicCheckpointer(directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = ckpt.load(state={"weights": torch.zeros(64)})
    ckpt.close()
    return (loaded.step, torch.rand(3).tolist(), [str(w.message) for w in caught if w.category is RobustDistWarning])


@pytest.mark.processes
def test_world_change_2_to_1_and_1_to_2(tmp_path):
    after_save = run_ranks(_save_on_ranks, 2, args=(str(tmp_path / "two"),), timeout=60)
    with AtomicCheckpointer(tmp_path / "two") as ckpt:
        loaded = ckpt.load(state={"weights": torch.zeros(64)})
        assert loaded.step == 5 and torch.rand(3).tolist() == after_save[0]  # rank 0's RNG restored
    with AtomicCheckpointer(tmp_path / "one") as ckpt:
        ckpt.save(5, state_for(5))
    first = run_ranks(_load_on_ranks, 2, args=(str(tmp_path / "one"),), timeout=60)
    second = run_ranks(_load_on_ranks, 2, args=(str(tmp_path / "one"),), timeout=60)
    assert first[0][0] == first[1][0] == 5 and first[0][2] == []
    assert "rank 1 has no saved RNG state in checkpoint step 5 (saved by 1 rank(s), loaded by 2)" in first[1][2][0]
    assert first[1][1] == second[1][1]  # rank 1 is reseeded deterministically
