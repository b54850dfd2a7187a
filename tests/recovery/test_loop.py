"""The in-process recovery loop (robustdist.recovery.run_in_process) on real gloo ranks: a script in the shape of
the pytorch/examples DDP tutorial (a two-layer toy model, MSE, SGD) fed by a DataLoader, checkpointing to the
in-memory tier every step and to disk rarely."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist import harden
from robustdist.recovery import generation, run_in_process
from robustdist.testing.ranks import run_ranks
from tests._torchrun import once_per_session

pytestmark = pytest.mark.timeout(300)
TOTAL = 12


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def _job(rank: int, root: str, fault: tuple[int, int, bool] | None, before_backward: bool = False,
         kind: type[BaseException] = ValueError, keep: str | None = None, settle: bool = False) -> dict:
    """``fault``: (rank, step, every generation?) raises ValueError there: after the optimizer step (the other
    rank then waits in the save's arrival check, in the store), or before ``backward()`` (the other rank then
    waits in DDP's gradient all-reduce, a gloo collective). ``keep``: the training function keeps generation 0's
    ``h.<keep>`` (a script holding a part of a generation past its end); ``settle``: the faulting rank first waits
    for its last in-memory save (a fault in its replication may leave that save behind, which the teardown names
    too); ``out["logged"]``: what robustdist logged at INFO and above."""
    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("robustdist").addHandler(handler)
    logging.getLogger("robustdist").setLevel(logging.INFO)  # this rank's own process: nothing else logs here
    kept: list[object] = []
    torch.manual_seed(0)
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 10), torch.randn(64, 5))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": 100, "local_every_n_steps": 1,
                          "local_dir": f"{root}/shm"},
           "health": {"hang_timeout": None},
           "distributed": {"timeout": 60, "init_timeout": 60, "barrier_timeout": 60}}
    seen: list[tuple[int, int, str]] = []  # (generation, step resumed from, where it came from)

    def train(h, step: int) -> int:
        loaded = h.last_loaded
        seen.append((generation(), step, loaded.source if loaded is not None else "none"))
        if keep and generation() == 0:
            kept.append(getattr(h, keep))
        while step < TOTAL:
            for x, y in h.loader:
                loss = nn.functional.mse_loss(h.model(x), y)
                hit = fault and rank == fault[0] and step + 1 == fault[1] and (fault[2] or generation() == 0)
                if hit and settle:
                    h.local.wait()
                if hit and before_backward:
                    raise kind(f"boom at step {step + 1}")
                loss.backward()  # the other rank's backward is cut mid-way by this fault: partial gradients
                optimizer.step()
                optimizer.zero_grad()  # after the step, as the README's loop does
                step += 1
                if hit:
                    raise kind(f"boom at step {step}")
                h.save(step, optimizer=optimizer)
                if step == TOTAL:
                    break
        return step

    out: dict = {"pid": os.getpid()}
    start = time.monotonic()
    try:
        out["end"] = run_in_process(lambda: harden(model, loader, cfg, optimizer=optimizer), train,
                                    optimizer=optimizer)
    except BaseException as e:
        out["raised"] = f"{type(e).__name__}: {e}"
        out["first_s"] = time.monotonic() - start
        if kind is MemoryError:  # the launcher would restart the process; here the same process calls again
            fault = None
            out["again"] = run_in_process(lambda: harden(model, loader, cfg, optimizer=optimizer), train,
                                          optimizer=optimizer)
    logging.getLogger("robustdist").removeHandler(handler)
    out.update(seen=seen, generation=generation(), params=[p.detach().clone() for p in model.parameters()],
               logged=logged)
    return out


@pytest.mark.processes
@pytest.mark.parametrize("before_backward", [False, True], ids=["peer-in-save", "peer-in-allreduce"])
def test_an_exception_on_one_rank_recovers_in_process_from_memory_bitwise(tmp_path, tmp_path_factory,
                                                                          before_backward):
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "a"), (1, 7, False), before_backward), init=False,
                        timeout=180)

    def make(root):  # the run without a fault, made once per session
        torch.save(run_ranks(_job, 2, args=(str(root), None), init=False, timeout=180), root / "out.pt")

    straight = torch.load(once_per_session(tmp_path_factory, f"{__name__} straight", make) / "out.pt",
                          weights_only=False)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert "raised" not in got, got.get("raised")
        assert got["end"] == ref["end"] == TOTAL and got["generation"] == ref["generation"] == 0  # reset after
        # generation 0 started fresh; generation 1 resumed step 6 (the fault came before step 7's save) from the
        # in-memory tier (the durable tier holds nothing: every_n_steps=100), in the same process
        assert [g for g, _, _ in got["seen"]] == [0, 1] and got["seen"][1][1] == 6, got["seen"]
        assert got["seen"][1][2] != "durable", got["seen"]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


@pytest.mark.processes
def test_a_part_of_a_torn_down_generation_the_script_keeps_is_named_and_the_recovery_goes_on_bitwise(tmp_path):
    """The training function keeps generation 0's checkpointer past the fault: the teardown's collection cannot
    free it, so rank 0 says so at INFO (robustdist's INFO lines come from rank 0 only, by default), naming the
    part, and every rank recovers anyway; without it, nothing is said."""
    kept = run_ranks(_job, 2, args=(str(tmp_path / "k"), (1, 7, False), True, ValueError, "checkpointer", True),
                     init=False, timeout=180)
    plain = run_ranks(_job, 2, args=(str(tmp_path / "p"), (1, 7, False), True, ValueError, None, True), init=False,
                      timeout=180)
    for rank in range(2):
        assert "raised" not in kept[rank] and kept[rank]["end"] == TOTAL, kept[rank].get("raised")
        assert "raised" not in plain[rank] and plain[rank]["end"] == TOTAL, plain[rank].get("raised")
        assert not [m for m in plain[rank]["logged"] if "outlive(s) it" in m], plain[rank]["logged"]
        assert all(torch.equal(a, b) for a, b in zip(kept[rank]["params"], plain[rank]["params"]))
        if rank != 0:
            continue
        said = [m for m in kept[rank]["logged"] if "outlive(s) it" in m]
        assert len(said) == 1 and f"rank {rank}: generation 0's checkpointer" in said[0], kept[rank]["logged"]
        assert said[0].endswith(" outlive(s) it (held by a save left behind, or a module or group the script "
                                "keeps); its store may serve the next generation. Expected: nothing of it left once "
                                "torn down. Fix: nothing, unless this repeats (then see what keeps it: "
                                "gc.get_referrers)"), said


@pytest.mark.processes
def test_a_fault_that_repeats_at_the_same_step_escalates(tmp_path):
    out = run_ranks(_job, 2, args=(str(tmp_path / "c"), (1, 3, True)), init=False, timeout=180)
    # a fresh start, then health.max_restarts_without_progress=3 faults in a row after resuming from step 2: the
    # error then leaves the loop on every rank (the process would exit, and the launcher restart it)
    assert out[1]["raised"] == "ValueError: boom at step 3"
    # rank 0 did not fault: it raises a named error naming rank 1's fault, not the collective the teardown cut
    assert out[0]["raised"].startswith("RecoveryError: [rank 0] in-process recovery generation 3 ended: a declared "
                                       "fault (generation 3: rank 1 ("), out[0]["raised"]
    assert "ValueError: boom at step 3" in out[0]["raised"] and "3 faults in a row" in out[0]["raised"]
    for rank in range(2):
        assert [(g, s) for g, s, _ in out[rank]["seen"]] == [(0, 0), (1, 2), (2, 2), (3, 2)]


@pytest.mark.processes
def test_a_fault_that_must_not_be_recovered_ends_every_rank_promptly(tmp_path):
    """MemoryError on rank 1: it escalates, and so does rank 0 (they agree), long before init_timeout (60 s), which
    a rank recovering alone would wait out in the next rendezvous. Then both call run_in_process again."""
    out = run_ranks(_job, 2, args=(str(tmp_path / "e"), (1, 3, False), False, MemoryError), init=False, timeout=180)
    assert max(o["first_s"] for o in out) < 45  # not init_timeout (60 s) in a rendezvous rank 1 never joins
    assert out[1]["raised"] == "MemoryError: boom at step 3"
    assert out[0]["raised"].startswith("RecoveryError: [rank 0] in-process recovery generation 0 ended: a declared "
                                       "fault (generation 0: rank 1 ("), out[0]["raised"]
    assert "MemoryError: boom at step 3" in out[0]["raised"] and "rank(s) [1] did not recover" in out[0]["raised"]
    for rank in range(2):  # no recovery happened; a second call in the process (keys of its own) runs to the end
        assert out[rank]["generation"] == 0 and [g for g, _, _ in out[rank]["seen"]] == [0, 0]
        # a fresh start: a second call at attempt 0 is a new launch (the in-memory lineage is renewed; a launcher's
        # restart, attempt 1, would resume step 2 from memory)
        assert out[rank]["again"] == TOTAL and out[rank]["seen"][1][1] == 0


def test_one_process_runs_the_function_once(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    logger = logging.getLogger("robustdist")
    level, handlers = logger.level, list(logger.handlers)
    try:  # _job sets up robustdist's logger for its own process, which here is the test's
        out = _job(0, str(tmp_path / "d"), None)
    finally:
        logger.setLevel(level)
        for handler in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(handler)
    assert out["end"] == TOTAL and out["seen"] == [(0, 0, "none")] and out["generation"] == 0
