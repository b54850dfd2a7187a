"""Regression tests for the second adversarial review of robustdist.checkpoint (one section per finding):
saving after falling back past corrupt steps, step-2 failures with sharded state, forged optimizer and
scheduler state (more hostile cases in tests/security/test_checkpoint_live_state.py), loads that fail without
side effects, close() with a stuck save, the checkpointer's own process group, and honest error messages."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from robustdist.checkpoint import AtomicCheckpointer, _faults, verify_all
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, RobustDistWarning
from robustdist.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(120)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:010d}"


def _fill(model: torch.nn.Module, value: float) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _load_quietly(ckpt: AtomicCheckpointer, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RobustDistWarning)
        return ckpt.load(**kwargs)


# 1. saving after load() fell back past corrupt newer steps --------------------------------------------------
def _three_steps_two_corrupt(directory: Path) -> torch.nn.Module:
    model = torch.nn.Linear(4, 4)
    with AtomicCheckpointer(directory, keep_last=3) as ckpt:
        for step in (8, 9, 10):
            ckpt.save(step, {"model": _fill(model, float(step))})
    for step in (9, 10):
        _flip(_step_dir(directory, step) / "replicated.pt")
    return model


def test_a_save_after_falling_back_past_corrupt_steps_commits_and_sets_them_aside(tmp_path, caplog):
    from robustdist.cli import main as cli_main

    model = _three_steps_two_corrupt(tmp_path)
    with AtomicCheckpointer(tmp_path, keep_last=3) as ckpt:
        assert _load_quietly(ckpt, state={"model": model}).step == 8
        with caplog.at_level(logging.WARNING, logger="robustdist"):
            ckpt.save(9, {"model": _fill(model, 9.5)})  # was: "step 9 is lower than the newest committed step 10"
        aside = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".rejected-"))
        assert len(aside) == 1 and aside[0].startswith(".rejected-step_0000000010-")
        assert f"moved aside to {tmp_path / aside[0]}" in caplog.text and "never deletes it" in caplog.text
        assert ckpt.steps() == [8, 9] and ckpt.load().state["model"]["weight"].eq(9.5).all()
        ckpt.save(10, {"model": model})
        ckpt.save(11, {"model": model})  # rotation and the clean-up leave the rejected copy alone
        assert ckpt.steps() == [9, 10, 11] and (tmp_path / aside[0] / "replicated.pt").is_file()
    assert [r["step"] for r in verify_all(str(tmp_path))] == [9, 10, 11]  # not a step: neither listed nor verified
    assert cli_main(["verify-checkpoint", str(tmp_path)]) == 0


def test_a_newer_step_no_load_rejected_still_blocks_a_lower_save(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(5, {"x": torch.zeros(1)})
        ckpt.save(10, {"x": torch.ones(1)})
    with AtomicCheckpointer(tmp_path) as ckpt:  # never loaded
        with pytest.raises(CheckpointError, match="step 6 is lower than the newest committed step 10"):
            ckpt.save(6, {"x": torch.zeros(1)})
        assert ckpt.load(5).step == 5  # a load that rejected nothing
        with pytest.raises(CheckpointError, match="step 6 is lower than the newest committed step 10"):
            ckpt.save(6, {"x": torch.zeros(1)})


def test_a_rejected_step_replaced_since_the_load_counts_again(tmp_path):
    directory, spare = tmp_path / "ckpt", tmp_path / "spare"
    model = _three_steps_two_corrupt(directory)
    with AtomicCheckpointer(spare) as other:
        other.save(10, {"model": model})
    with AtomicCheckpointer(directory, keep_last=3) as ckpt:
        assert _load_quietly(ckpt, state={"model": model}).step == 8
        shutil.rmtree(_step_dir(directory, 10))  # another writer re-saved step 10 meanwhile: a new directory
        shutil.copytree(_step_dir(spare, 10), _step_dir(directory, 10))
        with pytest.raises(CheckpointError, match="step 9 is lower than the newest committed step 10"):
            ckpt.save(9, {"model": model})


def test_a_rejected_old_copy_restored_by_the_clean_up_is_set_aside_too(tmp_path):
    model = _three_steps_two_corrupt(tmp_path)
    shutil.rmtree(_step_dir(tmp_path, 9))
    old = tmp_path / ".old-step_0000000010-abc123"  # a crash inside a re-save of step 10 left only this copy
    _step_dir(tmp_path, 10).rename(old)
    with AtomicCheckpointer(tmp_path, keep_last=3) as ckpt:
        assert ckpt.steps() == [8, 10]
        assert _load_quietly(ckpt, state={"model": model}).step == 8
        ckpt.save(9, {"model": model})  # the clean-up renames the .old- copy back, then it is set aside
        assert ckpt.steps() == [8, 9]
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith(".rejected-")]
    assert not old.exists() and len(aside) == 1 and aside[0].startswith(".rejected-step_0000000010-")


def _corrupt_on_rank_1_then_save_lower(rank, directory):
    with AtomicCheckpointer(directory, timeout=20, arrival_timeout=3) as ckpt:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = ckpt.load(state={"x": torch.zeros(1)}).step
        ckpt.save(2, {"x": torch.full((1,), 2.5)})  # rank 0 sets step 3 aside after the commit (no collective)
        return step, [str(w.message) for w in caught]


def _save_steps(rank, directory, steps):
    with AtomicCheckpointer(directory, timeout=20, arrival_timeout=3) as ckpt:
        for step in steps:
            ckpt.save(step, {"x": torch.full((1,), float(step))})


@pytest.mark.processes
def test_a_step_only_one_rank_finds_corrupt_is_rejected_on_every_rank(tmp_path):
    run_ranks(_save_steps, 2, args=(str(tmp_path), (1, 2, 3)), timeout=60)
    _flip(_step_dir(tmp_path, 3) / "rank_00001.pt")  # only rank 1 reads it
    out = run_ranks(_corrupt_on_rank_1_then_save_lower, 2, args=(str(tmp_path),), timeout=60)
    for step, caught in out:
        assert step == 2 and "checkpoint step 3 failed verification (rank 1: " in caught[0] and "CRC-32" in caught[0]
    names = sorted(os.listdir(tmp_path))
    assert names[:2] == [".lock", ".rejected-step_0000000003-" + names[1][26:]] and names[2:] == [
        "step_0000000001", "step_0000000002"]


# 2 and 7a. step 2 agrees before any collective write: a rank-local failure with sharded state ----------------
def _step_two_failures(rank, directory):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sharded = {"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}
    ckpt = AtomicCheckpointer(directory, timeout=10, arrival_timeout=3)
    ckpt.save(1, {"sh": sharded, "n": 1})
    out = {}
    for name, call in (
        ("bad per_rank on rank 1", lambda: ckpt.save(2, {"sh": sharded}, per_rank={"bad": object()} if rank else {})),
        ("different steps", lambda: ckpt.save(10 if rank == 0 else 15, {"sh": sharded})),
    ):
        start = time.monotonic()
        try:
            call()
            out[name] = ("no error", 0.0, ())
        except CheckpointError as e:
            out[name] = (str(e), time.monotonic() - start, e.ranks)
    ckpt.save(3, {"sh": sharded, "n": 3})  # the checkpointer still works
    steps, names = ckpt.steps(), sorted(os.listdir(directory))
    ckpt.close()
    return out, steps, names


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_rank_local_failure_beside_sharded_state_is_named_on_every_rank_at_once(tmp_path):
    for out, steps, names in run_ranks(_step_two_failures, 2, args=(str(tmp_path),), timeout=45):
        message, elapsed, ranks = out["bad per_rank on rank 1"]
        assert "checkpoint step 2 was not committed: 1 rank(s) failed (rank 1: " in message
        assert "checkpoint value per_rank['bad'] is a builtins.object" in message and elapsed < 5 and ranks == (1,)
        message, elapsed, ranks = out["different steps"]
        assert "ranks disagree on the step: rank 0 save(10), rank 1 save(15)" in message and ranks == (1,)
        assert "Fix: pass the same step on every rank" in message and elapsed < 5
        assert steps == [1, 3] and names == [".lock", "step_0000000001", "step_0000000003"]


# 3 is in tests/security/test_checkpoint_live_state.py. 4. a failed load changes nothing --------------------
def test_a_load_that_fits_no_candidate_leaves_the_model_alone_and_says_it_is_not_corruption(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with AtomicCheckpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": _fill(model, float(step)), "optimizer": opt})
    live = _fill(torch.nn.Linear(2, 2), 42.0)
    two_groups = torch.optim.SGD([{"params": [live.weight]}, {"params": [live.bias]}], lr=0.1)
    with AtomicCheckpointer(tmp_path) as ckpt, pytest.raises(CheckpointError) as exc:
        _load_quietly(ckpt, state={"model": live, "optimizer": two_groups})
    assert not isinstance(exc.value, CheckpointCorruptError)
    message = str(exc.value)
    assert message.startswith(f"no checkpoint in {tmp_path} could be restored into the live objects (step 2: rank 0: ")
    assert "the saved optimizer has 1 parameter group(s) of [2] parameters; the live SGD has 2 parameter group(s) " \
           "of [1, 1] parameters. The checkpoint is not corrupt" in message and "Nothing was restored" in message
    assert live.weight.eq(42.0).all() and live.bias.eq(42.0).all()


class Counter:
    """A user's stateful object whose load_state_dict changes it, then fails on a value it cannot take."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]
        if state["value"] in self.refuse:
            raise ValueError(f"cannot take {state['value']}")

    refuse = frozenset()


def test_a_restore_that_fails_puts_every_live_object_back(tmp_path):
    model = torch.nn.Linear(2, 2)
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": _fill(model, 1.0), "counter": Counter(1)})
        ckpt.save(2, {"model": _fill(model, 2.0), "counter": Counter(2)})
    live, counter = _fill(torch.nn.Linear(2, 2), 42.0), Counter(7)
    counter.refuse = {2}  # step 2's restore fails: step 1 loads, with nothing of step 2 left behind
    with AtomicCheckpointer(tmp_path) as ckpt:
        with pytest.warns(RobustDistWarning, match=r"step 2 failed verification \(rank 0: state\['counter'\]: "
                                                   r"ValueError: cannot take 2\)"):
            assert ckpt.load(state={"model": live, "counter": counter}).step == 1
    assert live.weight.eq(1.0).all() and counter.value == 1
    counter.refuse, counter.value = {1, 2}, 7  # every candidate fails
    _fill(live, 42.0)
    rng = torch.get_rng_state()
    with AtomicCheckpointer(tmp_path) as ckpt, pytest.raises(CheckpointError, match="cannot take 1"):
        _load_quietly(ckpt, state={"model": live, "counter": counter})
    assert counter.value == 7 and live.weight.eq(42.0).all() and torch.equal(torch.get_rng_state(), rng)


def test_the_common_load_copies_nothing(tmp_path, monkeypatch):
    from robustdist.checkpoint import _restore

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt, "sched": sched, "epoch": 3})
        copied = []
        monkeypatch.setattr(_restore, "_capture", lambda live: copied.append(live) or {})
        assert ckpt.load(state={"model": model, "optimizer": opt, "sched": sched}).step == 1 and copied == []
        ckpt.save(2, {"model": model}, per_rank={"c": Counter()})
        assert ckpt.load(state={"model": model}, per_rank={"c": Counter()}).step == 2
        assert len(copied) == 1 and isinstance(copied[0], Counter)  # only what step 2 cannot check


def _per_rank_fails_on_rank_1(rank, directory):
    ckpt = AtomicCheckpointer(directory, timeout=20, arrival_timeout=3)
    model = _fill(torch.nn.Linear(2, 2), 1.0)
    ckpt.save(1, {"model": model}, per_rank={"counter": Counter(1)})
    live, counter = _fill(torch.nn.Linear(2, 2), 42.0), Counter(7)
    if rank == 1:
        counter.refuse = {1}
    try:
        _load_quietly(ckpt, state={"model": live}, per_rank={"counter": counter})
        error = None
    except CheckpointError as e:
        error = str(e)
    ckpt.close()
    return error, counter.value, live.weight.flatten().tolist()


@pytest.mark.processes
def test_a_restore_failing_on_one_rank_is_put_back_on_every_rank(tmp_path):
    (e0, value0, weight0), (e1, value1, weight1) = run_ranks(_per_rank_fails_on_rank_1, 2, args=(str(tmp_path),),
                                                             timeout=60)
    assert "rank 1: per_rank['counter']: ValueError: cannot take 1" in e0 and e0.startswith("[rank 0] no checkpoint")
    assert "could be restored" in e1
    assert (value0, value1) == (7, 7)  # rank 0 had restored it: put back
    assert weight0 == weight1 == [42.0] * 4  # the model was never touched


# 5. close() with a stuck background save -------------------------------------------------------------------
def test_close_keeps_the_lock_while_a_stuck_save_runs(tmp_path, monkeypatch):
    from robustdist.checkpoint import checkpointer

    monkeypatch.setattr(checkpointer, "WAIT_GRACE_S", 0.2)
    gate = threading.Event()
    monkeypatch.setattr(_faults, "HOOK", lambda phase: gate.wait(30) if phase == "manifest_written" else None)
    ckpt = AtomicCheckpointer(tmp_path, async_save=True, timeout=0.5, keep_last=1)
    try:
        ckpt.save(1, {"x": torch.zeros(1)})
        with pytest.raises(CheckpointError) as exc:
            ckpt.close()
        assert "still running after 0.5 s + 0.2 s" in str(exc.value) and "The directory lock is kept" in str(exc.value)
        assert "did not finish within 0.7 s (the checkpoint timeout 0.5 s + 0.2 s)" in str(exc.value.__context__)
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} ")
        with pytest.raises(CheckpointError, match="already being written by another AtomicCheckpointer"):
            AtomicCheckpointer(tmp_path).save(2, {"x": torch.ones(1)})
        assert any(p.name.startswith(".tmp-step_0000000001-") for p in tmp_path.iterdir())  # still being written
    finally:
        gate.set()
    ckpt.close()  # the save finished: close() can be called again, and releases the lock
    assert ckpt.steps() == [1] and (tmp_path / ".lock").read_text() == ""


# 6 and 7c. the checkpointer's own group; a rotation failure on rank 0 -------------------------------------
def _groups_and_rotation(rank, directory):
    import torch.distributed as dist

    def groups():
        return len(dist.distributed_c10d._world.pg_map)

    before = groups()
    for _ in range(3):
        with AtomicCheckpointer(directory, timeout=20, arrival_timeout=3):
            assert groups() == before + 1
    after = groups()
    given = AtomicCheckpointer(directory, group=dist.group.WORLD, timeout=20, arrival_timeout=3)
    given.close()
    dist.barrier()  # a group the caller passed is left alone
    ckpt = AtomicCheckpointer(directory, keep_last=1, timeout=20, arrival_timeout=3)
    ckpt.save(1, {"x": torch.zeros(1)})
    if rank == 0:
        _faults.HOOK = lambda phase: (_ for _ in ()).throw(OSError("EIO while rotating")) if phase == "rotating" \
            else None
    ckpt.save(2, {"x": torch.ones(1)})  # committed on every rank; rank 0 only warns
    _faults.HOOK = None
    ckpt.save(3, {"x": torch.ones(1)})  # the ranks are still in step
    dist.barrier()  # rank 0 rotates after the commit, with no collective
    steps = ckpt.steps()
    ckpt.close()
    return before, after, groups(), steps


@pytest.mark.processes
def test_close_destroys_only_its_own_group_and_rotation_failures_never_split_ranks(tmp_path):
    for before, after, end, steps in run_ranks(_groups_and_rotation, 2, args=(str(tmp_path),), timeout=60):
        assert before == after == end and steps == [3]


def test_a_rotation_failure_is_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(_faults, "HOOK", lambda phase: (_ for _ in ()).throw(OSError("EIO")) if phase == "rotating"
                        else None)
    with AtomicCheckpointer(tmp_path, keep_last=1) as ckpt:
        ckpt.save(1, {"x": torch.zeros(1)})
        with caplog.at_level(logging.WARNING, logger="robustdist"):
            assert ckpt.save(2, {"x": torch.ones(1)}).step == 2
        assert "checkpoint step 2 is committed, but tidying" in caplog.text and "OSError: EIO" in caplog.text
        assert ckpt.steps() == [2]


# 7b. a failure after the commit rename says the step is committed ------------------------------------------
def test_a_failure_after_the_commit_rename_reports_the_step_as_committed(tmp_path, monkeypatch):
    from robustdist.checkpoint import _protocol

    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"x": torch.zeros(1)})
        real = _protocol.fsync_dir
        monkeypatch.setattr(_protocol, "fsync_dir", lambda path: (_ for _ in ()).throw(OSError(5, "EIO")))
        with pytest.raises(CheckpointError) as exc:
            ckpt.save(2, {"x": torch.ones(1)})
        monkeypatch.setattr(_protocol, "fsync_dir", real)
        message = str(exc.value)
        assert message.startswith(f"checkpoint step 2 was committed ({_step_dir(tmp_path, 2)} is in place and load() "
                                  "uses it), but rank 0 then failed: OSError: [Errno 5] EIO. The directory fsync did "
                                  "not complete, so the commit may not survive a power loss")
        assert "previous checkpoints are untouched" not in message and ckpt.load().step == 2
        monkeypatch.setattr(_faults, "HOOK", lambda phase: (_ for _ in ()).throw(OSError("late")) if phase ==
                            "committed" else None)
        with pytest.raises(CheckpointError, match=r"step 3 was committed .* OSError: late. The directory was fsynced"):
            ckpt.save(3, {"x": torch.ones(1)})


def test_a_failed_rename_of_a_resave_puts_the_committed_copy_back(tmp_path, monkeypatch):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"x": torch.zeros(1)})
        monkeypatch.setattr(_faults, "HOOK", lambda phase: (_ for _ in ()).throw(OSError("boom")) if phase ==
                            "moved_aside" else None)
        with pytest.raises(CheckpointError, match="could not commit checkpoint step 1: OSError: boom.*untouched"):
            ckpt.save(1, {"x": torch.ones(1)})
        assert sorted(os.listdir(tmp_path)) == [".lock", "step_0000000001"]
        assert torch.equal(ckpt.load().state["x"], torch.zeros(1))


# 7d. the report's error says what happens to the staging dir -----------------------------------------------
def test_a_failed_report_says_rank_0_removes_the_staging_dir_now(tmp_path):
    from robustdist.checkpoint._protocol import Committer
    from robustdist.checkpoint._types import CheckpointInfo, Context, SaveJob

    class Broken:
        def all_gather(self, obj, what):
            raise CheckpointError("the checkpoint's report collective failed after 3.0 s")

    ctx = Context(directory=str(tmp_path), group=None, rank=0, world_size=2, distributed=True, timeout=3.0,
                  collectives=Broken())
    staging = tmp_path / ".tmp-step_0000000001-abc"
    staging.mkdir()
    job = SaveJob(step=1, token="abc", staging=str(staging), info=CheckpointInfo(step=1, path=""), start=0.0)
    with pytest.raises(CheckpointError) as exc:
        Committer(ctx, keep_last=1, config_fingerprint=None).finish(job, {}, None)
    assert "rank 0 removes the staging directory now (or, if rank 0 is the one that died, the next save does)" \
        in str(exc.value) and "removed by the next save" not in str(exc.value)
    assert not staging.exists()


# 8. an in-process recovery does not wait out a background save stuck in its report ----------------------------
def _durable_interrupted_while_waiting(rank, directory):
    """Rank 1's background save of step 2 is still writing its files (held back 6 s); rank 0's is in the report's
    all-gather, and rank 0's main thread is already waiting for it when an in-process recovery interrupts the waits
    on both ranks (1 s in). Then, as the recovery's next generation would, each rank opens the directory again."""
    from robustdist.runtime import dist as rdist

    ckpt = AtomicCheckpointer(directory, async_save=True, timeout=20, arrival_timeout=10)
    ckpt.save(1, {"x": torch.ones(1)})
    ckpt.wait()
    if rank == 1:
        _faults.HOOK = lambda phase: time.sleep(6) if phase == "files_written" else None
    ckpt.save(2, {"x": torch.full((1,), 2.0)})
    timer = threading.Timer(1.0, rdist.interrupt_waits, args=("a rank faulted",))
    start = time.monotonic()
    timer.start()
    raised, seconds = "", 0.0
    try:
        ckpt.wait()
    except CheckpointError as e:
        raised, seconds = str(e), time.monotonic() - start
    timer.join()
    _faults.HOOK = None
    try:
        ckpt.close()
        closed = ""
    except CheckpointError as e:  # a left-behind part's error may surface here; the lock is released anyway
        closed = str(e)
    rdist.resume_waits()
    for left in [t for t in threading.enumerate() if t.name == "robustdist-ckpt-2"]:
        left.join(60)  # the part left behind ends when its collective fails (rank 1's group is gone)
    with AtomicCheckpointer(directory, timeout=20, arrival_timeout=10) as again:  # the lock was let go
        loaded = again.load(state={"x": torch.zeros(1)})
        steps = again.steps()
    staging = [n for n in os.listdir(directory) if n.startswith(".tmp-")]
    return raised, seconds, closed, loaded.step, steps, staging


@pytest.mark.processes
def test_a_wait_under_way_leaves_a_save_stuck_in_its_report_once_a_recovery_interrupts_it(tmp_path):
    (raised0, seconds0, _, step0, steps, staging), (raised1, seconds1, _, step1, _, _) = run_ranks(
        _durable_interrupted_while_waiting, 2, args=(str(tmp_path),), timeout=150)
    # rank 0's part, in the report's all-gather, is left 2 s after the interrupt, not after 20 s + 60 s
    assert "background save of checkpoint step 2 was still in its report collective 2 s after an in-process " \
        "recovery interrupted the waits; left to fail on its own: it commits nothing" in raised0, raised0
    assert "nothing to fix" in raised0, raised0
    assert seconds0 < 15, seconds0
    # rank 1's part was still writing its files: waited for, then its report was not started (interrupted)
    assert "checkpoint not committed: an in-process recovery interrupted the report" in raised1, raised1
    assert "report collective was not started: a rank faulted" in raised1 and "left behind" not in raised1, raised1
    assert 5 < seconds1 < 30, seconds1
    assert step0 == step1 == 1 and steps == [1] and staging == [], (steps, staging)


def test_a_save_left_behind_while_it_waited_for_the_reports_commits_nothing_and_rank_0_removes_its_staging(tmp_path):
    from robustdist.checkpoint._protocol import Committer
    from robustdist.checkpoint._types import CheckpointInfo, Context, SaveJob

    job = SaveJob(step=3, token="abc", staging=str(tmp_path / ".tmp-step_0000000003-abc"),
                  info=CheckpointInfo(step=3, path=""), start=0.0)

    class LeftDuringTheReport:  # the report arrives, but a recovery's wait left the part behind meanwhile
        def all_gather(self, obj, what):
            assert job.leaving.try_leave()
            return [obj, obj]

    ctx = Context(directory=str(tmp_path), group=None, rank=0, world_size=2, distributed=True, timeout=3.0,
                  collectives=LeftDuringTheReport())
    Path(job.staging).mkdir()
    job.leaving.enter()
    with pytest.raises(CheckpointError, match=r"checkpoint step 3 was left behind by an in-process recovery; not "
                                              r"committed \(the previous checkpoint stays\)"):
        Committer(ctx, keep_last=1, config_fingerprint=None).finish(job, {}, None)
    assert not Path(job.staging).exists() and not (tmp_path / "step_0000000003").exists()
