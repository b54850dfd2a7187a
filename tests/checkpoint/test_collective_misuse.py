"""save/resume/load are collective: when some ranks reach them and others do not, the ranks that arrived raise
within checkpoint.arrival_timeout, naming the ranks that did not and the rule, instead of waiting silently in a
broadcast for the collective timeout (as a script that saves only on rank 0, like the pytorch/examples DDP
tutorial, used to)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from robustdist import harden
from robustdist.checkpoint import AtomicCheckpointer
from robustdist.runtime.errors import CheckpointError
from robustdist.testing.ranks import run_ranks
from tests import _training as tr

pytestmark = pytest.mark.processes

ARRIVAL = 2.0


def _error(fn):
    start = time.monotonic()
    try:
        fn()
    except CheckpointError as e:
        return str(e), e.ranks, time.monotonic() - start
    return None, None, time.monotonic() - start


def _elsewhere():
    """What a rank that skips the call does meanwhile: it trains on (and keeps rank 0's store up)."""
    time.sleep(ARRIVAL + 3)
    return None, None, 0.0


def _save_on_rank_0_only(rank, directory):
    ckpt = AtomicCheckpointer(directory, arrival_timeout=ARRIVAL, timeout=60)
    out = _error(lambda: ckpt.save(1, {"x": torch.ones(1)})) if rank == 0 else _elsewhere()
    again = _error(lambda: ckpt.save(2, {"x": torch.ones(1)})) if rank == 0 else (None, None, 0.0)
    ckpt.close()
    return out, again[0]


def test_save_on_one_rank_names_the_absent_rank(tmp_path):
    (message, ranks, elapsed), again = run_ranks(_save_on_rank_0_only, 2, args=(str(tmp_path),), timeout=60)[0]
    assert message.startswith("[rank 0] save() is collective: call it on every rank. Rank 1 did not reach save() "
                              f"within {ARRIVAL:g} s; expected all 2 ranks.")
    assert "Fix: call save() on every rank, not under `if rank == 0:`" in message
    assert "or raise checkpoint.arrival_timeout if rank 1 is only slow" in message
    assert ranks == (1,) and ARRIVAL <= elapsed < ARRIVAL + 5
    assert again.startswith("[rank 0] this checkpointer's ranks fell out of step earlier")  # no second hang
    assert not list(tmp_path.glob("step_*"))


def _mismatched(rank, directory):
    ckpt = AtomicCheckpointer(directory, arrival_timeout=ARRIVAL, timeout=60)
    if rank == 0:
        out = _error(lambda: ckpt.save(1, {"x": torch.ones(1)}))
    else:
        out = _error(lambda: ckpt.load(missing_ok=True))
    ckpt.close()
    return out


def test_ranks_in_different_calls_name_each_other(tmp_path):
    (m0, r0, _), (m1, r1, _) = run_ranks(_mismatched, 2, args=(str(tmp_path),), timeout=60)
    assert "Rank 1 did not reach save() within 2 s (rank 1 is in load() instead)" in m0 and r0 == (1,)
    assert "Rank 0 did not reach load() within 2 s (rank 0 is in save() instead)" in m1 and r1 == (0,)


def _late(rank, directory):
    ckpt = AtomicCheckpointer(directory, arrival_timeout=ARRIVAL, timeout=60)
    if rank == 1:
        time.sleep(ARRIVAL + 2)  # arrives after rank 0 gave up
    out = _error(lambda: ckpt.save(1, {"x": torch.ones(1)}))
    if rank == 0:
        time.sleep(4)  # rank 0 hosts the store: keep it up while rank 1 arrives
    ckpt.close()
    return out


def test_a_rank_that_arrives_after_the_others_gave_up_raises_too(tmp_path):
    (m0, _, _), (m1, _, e1) = run_ranks(_late, 2, args=(str(tmp_path),), timeout=60)
    assert "Rank 1 did not reach save()" in m0
    assert m1.startswith("[rank 1] save() is collective: call it on every rank. The other ranks stopped waiting "
                         "for save() before this rank arrived") and e1 < 2


def _tutorial_shape(rank, directory, call):
    """The pytorch/examples DDP tutorial saves on rank 0 only; here with harden()."""
    cfg = {"checkpoint": {"dir": directory, "arrival_timeout": ARRIVAL}, "health": {"hang_timeout": None}}
    h = harden(tr.make_model(), tr.make_loader(), cfg)
    try:
        if call == "save":
            return _error(lambda: h.save(1, force=True)) if rank == 0 else _elsewhere()
        return _error(h.resume) if rank == 1 else _elsewhere()
    finally:
        h.close()


def test_harden_save_on_rank_0_only_and_resume_on_rank_1_only(tmp_path):
    (message, ranks, elapsed), _ = run_ranks(_tutorial_shape, 2, args=(str(tmp_path / "a"), "save"), timeout=90)
    assert "save() is collective: call it on every rank. Rank 1 did not reach save()" in message
    assert ranks == (1,) and elapsed < ARRIVAL + 5
    _, (message, ranks, elapsed) = run_ranks(_tutorial_shape, 2, args=(str(tmp_path / "b"), "resume"), timeout=90)
    assert "load() is collective: call it on every rank. Rank 0 did not reach load()" in message
    assert ranks == (0,) and elapsed < ARRIVAL + 5


def _dies_after_arriving(rank, directory):
    import os

    ckpt = AtomicCheckpointer(directory, arrival_timeout=ARRIVAL, timeout=20)
    if rank == 1:
        ckpt._committer.begin = lambda step: os._exit(3)  # arrives, then dies before the save's first collective
    start = time.monotonic()
    try:
        ckpt.save(1, {"x": torch.ones(1)})
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        result = [type(e).__name__, str(e), time.monotonic() - start]
        (Path(directory) / "rank0.json").write_text(json.dumps(result))


def test_a_rank_dying_inside_save_gives_the_survivor_a_checkpoint_error(tmp_path):
    import pytest

    from robustdist.runtime.errors import RanksFailed

    with pytest.raises(RanksFailed) as exc:
        run_ranks(_dies_after_arriving, 2, args=(str(tmp_path),), timeout=60)
    assert exc.value.ranks == (1,)
    name, message, elapsed = json.loads((tmp_path / "rank0.json").read_text())
    assert name == "CheckpointError" and elapsed < 25
    assert "failed after" in message and "(bound 20 s)" in message and "another rank probably died" in message
