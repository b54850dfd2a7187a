"""The in-memory tier restores a rank's own copy from this process's memory after an in-process recovery
(``robustdist.checkpoint.local.held``): no file read, bitwise the same, taken once, never a stale snapshot.

Real gloo ranks, each labelled its own node. The proof that no file is read: the files of the copies held in memory
are corrupted before the load; the load still restores that step bitwise from them (while a tier that holds
nothing, given the same files, falls back to the replicas on the other node, with a warning naming the corrupt
copy).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from robustdist.checkpoint import LocalTier, _faults
from robustdist.checkpoint.local import held as _held
from robustdist.checkpoint.local import layout
from robustdist.runtime.errors import CheckpointError
from robustdist.testing.ranks import run_ranks
from tests.checkpoint.test_local_tier import Counter, _fingerprint, _objects, _train

pytestmark = pytest.mark.timeout(180)
NODES = [{"GROUP_RANK": "0"}, {"GROUP_RANK": "1"}]


def _tier(root: str, rank: int) -> LocalTier:
    return LocalTier(os.path.join(root, f"node{rank}"), lineage="held", timeout=60)


def _corrupt_payload(tier: LocalTier, rank: int, step: int) -> None:
    """Flip bytes in the middle of this rank's own payload file of ``step``."""
    path = Path(layout.step_path(tier.directory, rank, "own", step), layout.PAYLOAD)
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))


def _generations(rank: int, root: str, carry: bool) -> dict[str, Any]:
    """Every rank trains alike (as under DDP: the replicated entries are rank 0's). Generation 0 saves steps 1 and 2 and closes keeping its files (``carry``: as in-process recovery does);
    both ranks' own payload files of step 2 are then corrupted; generation 1 (a new tier, same process) loads."""
    model, opt = _objects()
    counter = Counter(10 + rank)
    state = {"model": model, "optimizer": opt}
    tier = _tier(root, rank)
    _train(model, opt, 2, 0)
    tier.save(1, state, per_rank={"counter": counter})
    tier.wait()
    _train(model, opt, 2, 0)
    counter.value += 5
    torch.manual_seed(77 + rank)
    tier.save(2, state, per_rank={"counter": counter})
    tier.wait()
    expected = _fingerprint(model, opt, counter)  # what step 2 restores (the RNG stream after it included)
    torch.manual_seed(77 + rank)
    _train(model, opt, 3, 0)  # the live objects move on (a fault comes later)
    tier.carry = carry
    tier.close()
    _corrupt_payload(tier, rank, 2)
    torch.distributed.barrier()
    again = _tier(root, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = again.load(state=state, per_rank={"counter": counter})
    got = _fingerprint(model, opt, counter)
    out = {"step": loaded.step if loaded else None, "from_process": loaded.from_process if loaded else None,
           "source": loaded.source if loaded else None,
           "detail": loaded.source_detail if loaded else "", "warnings": [str(w.message) for w in caught],
           "bitwise": loaded is not None and loaded.step == 2 and all(torch.equal(a, b) for a, b in
                                                                      zip(got, expected))}
    # taken once: the next generation reads step 2's files: its own are corrupt, so the replicas on the other node
    again.carry = True
    again.close()
    torch.distributed.barrier()
    third = _tier(root, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        later = third.load(state=state, per_rank={"counter": counter})
    out["third"] = (later.step, later.from_process, later.source) if later else None
    third.close()
    return out


def _saved_once(rank: int, root: str) -> tuple[Any, ...]:
    """The objects, trained 2 steps alike on every rank, and a tier holding them as step 1."""
    model, opt = _objects()
    state = {"model": model, "optimizer": opt}
    tier = _tier(root, rank)
    _train(model, opt, 2, 0)
    tier.save(1, state)
    tier.wait()
    return model, opt, state, tier


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.processes
def test_a_recovered_generation_restores_its_own_copy_from_memory_without_reading_the_file(tmp_path):
    results = run_ranks(_generations, 2, args=(str(tmp_path), True), env=NODES, timeout=120)
    for rank, r in enumerate(results):
        assert r["step"] == 2 and r["bitwise"], r
        assert r["from_process"] is True and "as this process holds it (no file read)" in r["detail"], r
        assert not [w for w in r["warnings"] if "unusable" in w], r["warnings"]  # the corrupt file was never read
        assert r["source"] == "memory", r
        assert r["third"] == (2, False, "replica"), r  # held once: then the files (its own corrupt: the replica)


@pytest.mark.processes
def test_without_the_carried_copy_the_same_files_fall_back_to_the_replicas(tmp_path):
    results = run_ranks(_generations, 2, args=(str(tmp_path), False), env=NODES, timeout=120)
    for r in results:
        assert (r["step"], r["from_process"], r["source"], r["bitwise"]) == (2, False, "replica", True), r
    warned = [w for w in results[0]["warnings"] if "unusable" in w]  # rank 0 names each corrupt copy
    assert any("its own copy of rank 0's step 2" in w for w in warned), results[0]["warnings"]
    assert any("its own copy of rank 1's step 2" in w for w in warned), results[0]["warnings"]


def _after_restore(rank: int, root: str) -> tuple[Any, ...]:
    """A restore from memory, then training and the next save: the live optimizer state keeps its values and the
    checkpoint returned to the script holds either its own values or the live model's (no buffer of theirs is one
    a snapshot writes into). A load on the tier that took the step (a rollback, no recovery) reads the files, as
    before."""
    model, opt, state, tier = _saved_once(rank, root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same_tier = tier.load(state=state)
    tier.carry = True
    tier.close()
    again = _tier(root, rank)
    loaded = again.load(state=state)
    kept = {k: v.clone() for k, v in loaded.state.get("model", {}).items()}  # rank 0's replicated entries
    _train(model, opt, 2, 0)
    optimizer_now = [t.clone() for t in _opt_tensors(opt)]
    again.save(2, state)
    again.wait()
    live = {t.data_ptr() for t in _opt_tensors(opt)}
    shared = sum(1 for t in again._staging.values() if t.data_ptr() in live)
    params = dict(model.state_dict())
    intact = all(torch.equal(loaded.state["model"][k], v) or torch.equal(loaded.state["model"][k], params[k])
                 for k, v in kept.items()) and all(torch.equal(a, b) for a, b in zip(_opt_tensors(opt), optimizer_now))
    again.close()
    return same_tier.from_process, loaded.from_process, len(kept), shared, intact


@pytest.mark.processes
def test_a_restore_from_memory_shares_no_buffer_with_a_later_save(tmp_path):
    results = run_ranks(_after_restore, 2, args=(str(tmp_path),), env=NODES, timeout=120)
    for rank, (same_tier, from_process, kept, shared, intact) in enumerate(results):
        assert (same_tier, from_process) == (False, True)
        assert kept > 0
        assert shared == 0 and intact, (shared, intact)


def _stale(rank: int, root: str) -> tuple[int | None, bool | None, bool]:
    """Step 2's save fails after its snapshot overwrote the buffers of step 1: step 1 is restored from the files,
    never from the overwritten buffers."""
    model, opt, state, tier = _saved_once(rank, root)
    expected = _fingerprint(model, opt, Counter())[:-1]
    _train(model, opt, 2, 0)

    def hook(phase: str) -> None:
        if phase == "local_writing":
            raise OSError(28, "No space left on device")

    _faults.HOOK = hook
    tier.save(2, state)
    try:
        tier.wait()
    except CheckpointError:
        pass
    _faults.HOOK = None
    tier.carry = True
    tier.close()
    again = _tier(root, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = again.load(state=state)
    got = _fingerprint(model, opt, Counter())[:-1]
    again.close()
    return (loaded.step if loaded else None, loaded.from_process if loaded else None,
            all(torch.equal(a, b) for a, b in zip(got[:-1], expected[:-1])))


@pytest.mark.processes
def test_a_save_that_failed_after_its_snapshot_leaves_nothing_held(tmp_path):
    for step, from_process, same in run_ranks(_stale, 2, args=(str(tmp_path),), env=NODES, timeout=120):
        assert (step, from_process, same) == (1, False, True)


def test_only_a_tier_on_the_same_directory_rank_world_and_lineage_takes_what_was_carried():
    held = _held.Held(3, "s", rank=1, world_size=2, lineage="a", payload={}, replicated={})
    for other in ({"rank": 0, "world_size": 2, "lineage": "a"}, {"rank": 1, "world_size": 4, "lineage": "a"},
                  {"rank": 1, "world_size": 2, "lineage": "b"}):
        _held.carry("/x", held)
        assert _held.take("/x", **other) is None  # and it is gone: a mismatch drops it
        assert _held.take("/x", rank=1, world_size=2, lineage="a") is None
    _held.carry("/x", held)
    assert _held.take("/y", rank=1, world_size=2, lineage="a") is None
    assert _held.take("/x", rank=1, world_size=2, lineage="a") is held
    assert _held.take("/x", rank=1, world_size=2, lineage="a") is None  # once
    _held.carry("/x", held)
    _held.discard("/x")
    assert _held.take("/x", rank=1, world_size=2, lineage="a") is None


def _damaged_in_memory(rank: int, root: str) -> tuple[Any, ...]:
    """The carried snapshot itself is wrong (not what a save leaves: a bug's or a stray write's doing): its check
    fails, and the copy's file is read instead, naming it."""
    import logging

    model, opt = _objects()
    state = {"model": model, "optimizer": opt}
    tier = _tier(root, rank)
    _train(model, opt, 2, 0)
    tier.save(1, state, per_rank={"counter": Counter(7)})
    tier.wait()
    expected = _fingerprint(model, opt, Counter(7))[:-1]
    tier.carry = True
    tier.close()
    _held._CARRIED[tier.directory].payload = {"mine": "not a payload", "shards": {}}
    again = _tier(root, rank)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("robustdist").addHandler(handler)
    _train(model, opt, 2, 0)
    counter = Counter()
    try:
        loaded = again.load(state=state, per_rank={"counter": counter})
    finally:
        logging.getLogger("robustdist").removeHandler(handler)
    same = all(torch.equal(a, b) for a, b in zip(_fingerprint(model, opt, counter)[:-2], expected[:-1]))
    again.close()
    return loaded.step, loaded.from_process, same, counter.value, [m for m in records if "holds it" in m]


@pytest.mark.processes
def test_a_held_copy_that_fails_its_check_is_read_from_its_file(tmp_path):
    for rank, (step, from_process, same, value, said) in enumerate(
            run_ranks(_damaged_in_memory, 2, args=(str(tmp_path),), env=NODES, timeout=120)):
        assert (step, from_process, same, value) == (1, False, True, 7)
        assert len(said) == 1 and f"rank {rank}:" in said[0] and "reading the file instead" in said[0], said
