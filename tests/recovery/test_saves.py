"""In-process recovery around saves, and a NaN rollback under ``h.run``, on real gloo ranks, with a script in the
shape of the pytorch/examples DDP tutorial (a two-layer ``ToyModel``, SGD, MSE) driven by the README's loop
(``h.step_guard`` after ``backward()``, ``h.save`` every step).

* A fault while an in-memory save's background part commits: the step it was saving is not complete on every
  rank, so the ranks resume from the previous complete one, bitwise.
* A fault while a durable asynchronous save's background part is in its report: rank 0 does not wait out the
  checkpoint's timeout for it (it is left behind after 2 s, :mod:`robustdist.checkpoint._background`), and the
  ranks recover bitwise.
* A NaN with ``nan_policy: rollback``: rolled back in place, with no recovery generation; a NaN that comes back
  after every rollback escalates through the in-process recovery to the launcher.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist import harden
from robustdist.checkpoint import _faults
from robustdist.recovery import generation
from robustdist.testing.ranks import run_ranks
from tests._torchrun import once_per_session
from tests.recovery.test_loop import ToyModel  # the DDP tutorial's model

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
TOTAL = 10


class _Flaky:
    """A stateful extra (a step counter) whose restore raises on rank 1 in recovery generation 1, once."""

    def __init__(self, rank: int) -> None:
        self.rank, self.armed, self.count = rank, True, 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if self.armed and self.rank == 1 and generation() == 1:
            self.armed = False
            raise RuntimeError("the counter's restore failed during the recovery")
        self.count = state["count"]


def _job(rank: int, root: str, held: dict[str, float] | None = None, fault_after_save: int | None = None,
         durable_every: int = 100, nan: tuple[int, int, bool] | None = None, local_every: int | None = 1,
         flaky: bool = False) -> dict:
    """``held``: phase -> seconds: rank 1's background part of the save of step ``fault_after_save`` (generation 0)
    sleeps there; rank 1 then raises right after that ``h.save`` returned. ``nan``: (rank, step, every pass?) that
    rank's loss is NaN at that step (the first pass only, unless every pass). ``local_every``: the in-memory
    cadence (None: no in-memory tier). ``flaky``: a stateful extra whose restore fails on rank 1 in generation 1,
    once (a fault during the recovery itself)."""
    torch.manual_seed(0)
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 10), torch.randn(64, 5))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": durable_every, "local_every_n_steps": local_every,
                          "local_dir": f"{root}/shm", "async_save": True},
           "health": {"hang_timeout": None, "nan_policy": "rollback", "max_rollbacks": 2},
           "recovery": {"in_process": True},
           "distributed": {"timeout": 60, "init_timeout": 60, "barrier_timeout": 60}}
    seen: list[tuple[int, int, str, float]] = []  # (generation, step resumed from, source, when)
    armed: set[str] = set()
    nan_done: set[int] = set()
    out: dict = {"pid": os.getpid(), "rollbacks": []}

    def hook(phase: str) -> None:  # the background threads of rank 1's held save
        if phase in armed:
            armed.discard(phase)
            time.sleep(held[phase])

    if held and rank == 1:
        _faults.HOOK = hook

    def train(h, step: int) -> int:
        loaded = h.last_loaded
        seen.append((generation(), step, loaded.source if loaded is not None else "none", time.monotonic()))
        while step < TOTAL:
            for x, y in h.loader:
                loss = nn.functional.mse_loss(h.model(x), y)
                if nan and rank == nan[0] and step + 1 == nan[1] and (nan[2] or step + 1 not in nan_done):
                    nan_done.add(step + 1)
                    loss = loss * float("nan")
                loss.backward()
                decision = h.step_guard(loss, step)
                if decision:
                    optimizer.step()
                optimizer.zero_grad()
                if decision.rolled_back:
                    out["rollbacks"].append((generation(), step, decision.resume_step))
                    step = decision.resume_step
                    break
                step += 1
                hit = rank == 1 and step == fault_after_save and generation() == 0
                if hit:
                    armed.update(held or {})
                h.save(step, optimizer=optimizer)
                if hit:
                    out["fault_at"] = time.monotonic()
                    raise ValueError(f"boom right after the save of step {step}")
                if step == TOTAL:
                    break
        return step

    h = harden(model, loader, cfg, optimizer=optimizer)
    extra = {"counter": _Flaky(rank)} if flaky else {}
    try:
        out["end"] = h.run(train, optimizer=optimizer, **extra)
    except Exception as e:
        out["raised"] = f"{type(e).__name__}: {e}"
    _faults.HOOK = None
    for left in [t for t in threading.enumerate() if t.name.startswith("robustdist-") and "ckpt" in t.name]:
        left.join(90)  # parts left behind end when their collective fails (at the latest the group's timeout)
    out.update(seen=seen, generation=generation(), params=[p.detach().clone() for p in model.parameters()],
               steps=sorted(int(n[5:]) for n in os.listdir(f"{root}/ckpt") if n.startswith("step_")))
    return out


def _straight(tmp_path_factory) -> list[dict]:
    """What each rank of a run without faults returns (in-memory saves every step), made once per session. How often
    the in-memory tier saves and what extra state a save holds change no parameter: this run is the reference of
    every faulted run here but the durable one (whose straight run's own checkpoints are checked too)."""
    def make(root):
        torch.save(run_ranks(_job, 2, args=(str(root),), init=False, timeout=180), root / "out.pt")

    return torch.load(once_per_session(tmp_path_factory, f"{__name__} straight", make) / "out.pt", weights_only=False)


def test_a_fault_while_an_in_memory_save_commits_resumes_from_the_copies_in_place_bitwise(tmp_path, tmp_path_factory):
    """Rank 1's background part of step 6 is held 1.5 s after writing its own copy, and rank 1 faults as soon as the
    save returns: the step's commit collective never runs, but the recovery waits for the copies being written
    (only a part stuck in a collective is left behind), so every rank's own copy of step 6, from one save, is in
    place, and both ranks resume step 6 from memory, bitwise."""
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), {"local_own_committed": 1.5}, 6), init=False,
                        timeout=180)
    straight = _straight(tmp_path_factory)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert "raised" not in got, got["raised"]
        assert got["end"] == ref["end"] == TOTAL and got["generation"] == 0
        assert [(g, s) for g, s, _, _ in got["seen"]] == [(0, 0), (1, 6)], got["seen"]
        assert got["seen"][1][2] == "memory", got["seen"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


def test_a_fault_while_a_durable_async_save_reports_recovers_bitwise_without_waiting_for_it(tmp_path):
    """Durable saves every 3 steps, asynchronous. Rank 1's background part of the durable save of step 6 is held 4 s
    before its report (and its in-memory part 1.5 s), and rank 1 faults as soon as the save returns; rank 0's
    durable part is then at its report. The recovery does not wait for it (distributed.timeout 60 s + 60 s at
    most before; a part stuck inside the collective is left behind after 2 s, tested in
    tests/checkpoint/test_checkpoint_review.py), both ranks resume step 6 from memory (its own copies were in
    place), and the run ends bitwise equal to one without the fault; step 6's durable save commits nothing."""
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), {"local_own_committed": 1.5, "files_written": 4.0}, 6, 3),
                        init=False, timeout=240)
    straight = run_ranks(_job, 2, args=(str(tmp_path / "b"), None, None, 3), init=False, timeout=180)
    fault_at = faulted[1]["fault_at"]
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert "raised" not in got, got["raised"]
        assert got["end"] == ref["end"] == TOTAL
        assert [(g, s) for g, s, _, _ in got["seen"]] == [(0, 0), (1, 6)], got["seen"]
        # the held parts (4 s), the decision and the rebuild; not the checkpointer's 60 s + 60 s
        assert got["seen"][1][3] - fault_at < 30, got["seen"][1][3] - fault_at
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
    # step 6's durable save committed nothing, and generation 1 resumed past it: 3 and 9 (the straight run: 3, 6, 9)
    assert faulted[0]["steps"] == [3, 9] and straight[0]["steps"] == [3, 6, 9], (faulted[0]["steps"],
                                                                                  straight[0]["steps"])


def test_a_nan_is_rolled_back_in_place_under_h_run_bitwise(tmp_path, tmp_path_factory):
    """nan_policy: rollback: rank 1's loss is NaN at step 5 once. Every rank restores step 4 from memory, in place:
    no recovery generation, and the run ends bitwise equal to one without the NaN."""
    rolled = run_ranks(_job, 2, args=(str(tmp_path / "a"), None, None, 100, (1, 5, False)), init=False,
                       timeout=180)
    straight = _straight(tmp_path_factory)
    for rank in range(2):
        got, ref = rolled[rank], straight[rank]
        assert "raised" not in got, got["raised"]
        assert got["rollbacks"] == [(0, 4, 4)], got["rollbacks"]
        assert [(g, s) for g, s, _, _ in got["seen"]] == [(0, 0)] and got["end"] == TOTAL
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


def test_a_nan_on_every_pass_escalates_through_the_recovery(tmp_path):
    """The NaN comes back after every rollback: after health.max_rollbacks (2) the step guard raises on every rank,
    the in-process recovery resumes step 4, the NaN comes back again, and after
    health.max_restarts_without_progress (3) faults in a row after resuming step 4 every rank leaves the loop
    (the launcher's restart, then its RestartLoopError, would take over)."""
    out = run_ranks(_job, 2, args=(str(tmp_path / "a"), None, None, 100, (1, 5, True)), init=False,
                   timeout=240)
    for rank in range(2):
        raised = out[rank].get("raised", "")
        assert "NonFiniteLossError" in raised and "again after 2 rollback(s) of this step" in raised, raised
        assert [(g, s) for g, s, _, _ in out[rank]["seen"]] == [(0, 0), (1, 4), (2, 4), (3, 4)], out[rank]["seen"]
        assert [g for g, _, _ in out[rank]["rollbacks"]] == [0, 0, 1, 1, 2, 2, 3, 3], out[rank]["rollbacks"]


def test_a_fault_before_the_first_checkpoint_recovers_from_the_start_state_bitwise(tmp_path, tmp_path_factory):
    """In-memory saves every 5 steps; rank 1 faults after step 3. A fresh start under h.run keeps the start state in
    the in-memory tier (step 0), so both ranks run again from it, not from step 0 with the moved model."""
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), None, 3, 100, None, 5), init=False, timeout=180)
    straight = _straight(tmp_path_factory)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert "raised" not in got, got["raised"]
        assert [(g, s, src) for g, s, src, _ in got["seen"]][1:] == [(1, 0, "memory")], got["seen"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


def test_a_fault_before_the_first_checkpoint_without_an_in_memory_tier_escalates(tmp_path):
    """No in-memory tier, no durable checkpoint yet: running again from step 0 with the model moved would not be the
    same run, so each recovery that finds nothing is a fault, and after health.max_restarts_without_progress (3)
    of them every rank escalates with RecoveryError (a restart starts afresh), naming the fix."""
    out = run_ranks(_job, 2, args=(str(tmp_path / "a"), None, 3, 100, None, None), init=False, timeout=240)
    for rank in range(2):
        raised = out[rank].get("raised", "")
        assert raised.startswith("RecoveryError") and "found no checkpoint to resume from" in raised, raised
        assert "turn on the in-memory tier (checkpoint.local_every_n_steps)" in raised, raised
        assert [(g, s) for g, s, _, _ in out[rank]["seen"]] == [(0, 0)], out[rank]["seen"]


def test_a_restore_that_fails_during_the_recovery_is_a_fault_the_next_generation_recovers_bitwise(tmp_path,
                                                                                                   tmp_path_factory):
    """A fault during the recovery itself: rank 1's fault after step 6, then in generation 1 a stateful extra's
    restore raises on rank 1. The live objects are put back on every rank and nothing else holds the run:
    generation 1 ends as a fault, and generation 2 resumes step 6 and ends bitwise equal to a run without faults."""
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), {"local_own_committed": 1.5}, 6, 100, None, 1, True),
                        init=False, timeout=240)
    straight = _straight(tmp_path_factory)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert "raised" not in got, got["raised"]
        assert [(g, s) for g, s, _, _ in got["seen"]] == [(0, 0), (2, 6)], got["seen"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
