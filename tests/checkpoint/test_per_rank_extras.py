"""Plain extras given to ``h.save(step, name=value)`` come back to each rank as that rank saved them
(rank 1 saved ``X=[1, 1]`` resumes with ``[1, 1]``, not rank 0's ``[0, 0]``), from the durable tier and the in-memory
one; a rank that saved nothing (more ranks on resume) gets rank 0's value with a warning."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from robustdist import harden
from robustdist.testing.ranks import run_ranks


def _cfg(root: str, local: bool = False) -> dict:
    ckpt = {"dir": f"{root}/ckpt", "every_n_steps": 2}
    if local:
        ckpt.update({"local_every_n_steps": 1, "local_dir": f"{root}/shm"})
    return {"checkpoint": ckpt, "health": {"hang_timeout": None}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _save(rank: int, root: str, local: bool) -> None:
    model = _model()
    h = harden(model, None, _cfg(root, local), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for step in (2, 3) if local else (2,):  # with the in-memory tier, step 3 is in memory only (newer than 2)
        h.save(step, X=[rank, rank], seen={"rank": rank, "tokens": 1000 + rank}, buf=torch.full((3,), float(rank)),
               same="identical")
    if local:
        h.local.wait()
    h.close(keep_local=local)  # the in-memory copies stay for the next process, as after a crash


def _resume(rank: int, root: str, local: bool) -> tuple:
    model = _model()
    h = harden(model, None, _cfg(root, local), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = h.resume()
    state, source = h.last_loaded.state, h.last_loaded.source
    h.close()
    return step, source, state["X"], state["seen"], state["buf"].tolist(), state["same"]


@pytest.mark.processes
def test_each_rank_resumes_its_own_plain_extras_from_the_durable_tier(tmp_path):
    run_ranks(_save, 2, args=(str(tmp_path), False), init=False, timeout=120)
    out = run_ranks(_resume, 2, args=(str(tmp_path), False), init=False, timeout=120)
    for rank, (step, source, x, seen, buf, same) in enumerate(out):
        assert (step, source) == (2, "durable")
        assert x == [rank, rank] and seen == {"rank": rank, "tokens": 1000 + rank}
        assert buf == [float(rank)] * 3 and same == "identical"


@pytest.mark.processes
def test_each_rank_resumes_its_own_plain_extras_from_the_in_memory_tier(tmp_path):
    run_ranks(_save, 2, args=(str(tmp_path), True), init=False, timeout=120)
    out = run_ranks(_resume, 2, args=(str(tmp_path), True), init=False, timeout=120)
    for rank, (step, source, x, seen, buf, _) in enumerate(out):
        assert (step, source) == (3, "memory")
        assert x == [rank, rank] and seen["rank"] == rank and buf == [float(rank)] * 3


def _resume_x(rank: int, root: str) -> list:
    model = _model()
    h = harden(model, None, _cfg(root), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    h.resume()
    x = h.last_loaded.state["X"]
    h.close()
    return x


def _resume_logged(rank: int, root: str, only_x: bool = False) -> tuple:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("robustdist").addHandler(handler)
    try:
        got = _resume_x(rank, root) if only_x else _resume(rank, root, False)[2]
        return got, [m for m in records if "plain extras" in m]
    finally:
        logging.getLogger("robustdist").removeHandler(handler)


@pytest.mark.processes
def test_a_rank_that_saved_nothing_gets_rank_0s_values_and_a_warning(tmp_path):
    run_ranks(_save, 2, args=(str(tmp_path), False), init=False, timeout=120)
    out = run_ranks(_resume_logged, 3, args=(str(tmp_path),), init=False, timeout=120)
    assert [x for x, _ in out] == [[0, 0], [1, 1], [0, 0]]
    assert out[0][1] == [] and out[1][1] == []
    (warning,) = out[2][1]
    assert warning == ("[rank 2/3] checkpoint step 2 holds no values of this rank's own for the plain extras X, buf, "
                       "same, seen (saved by 2 rank(s); the job now has more ranks): this rank gets rank 0's")


def test_a_forged_rank_file_cannot_replace_a_live_entry_or_an_entry_saved_as_state():
    from robustdist.checkpoint import LoadedCheckpoint
    from robustdist.checkpoint.train_state import _own_extras

    loaded = LoadedCheckpoint(step=4, path="/x", state={"model": {"w": 1}, "optimizer": {"s": 2}, "ema": {"e": 3},
                                                        "counter": 0},
                              per_rank={"extras": {"model": "forged", "optimizer": "pwned", "ema": "forged",
                                                   "counter": 7, "new": 1}},
                              metadata={}, manifest={"entries": {"model": "module", "optimizer": "stateful",
                                                                 "ema": "stateful", "counter": "data"},
                                                     "world_size": 2})
    _own_extras(loaded, 1, 2, {"model", "optimizer"})
    assert loaded.state == {"model": {"w": 1}, "optimizer": {"s": 2}, "ema": {"e": 3}, "counter": 7}


def _save_three(rank: int, root: str) -> None:
    model = _model()
    h = harden(model, None, _cfg(root), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    h.save(2, X=[rank])
    h.close()


@pytest.mark.processes
def test_fewer_ranks_on_resume_warn_that_the_missing_ranks_values_are_not_restored(tmp_path):
    run_ranks(_save_three, 3, args=(str(tmp_path),), init=False, timeout=120)
    out = run_ranks(_resume_logged, 2, args=(str(tmp_path), True), init=False, timeout=120)
    assert [x for x, _ in out] == [[0], [1]]
    assert out[1][1] == []
    (warning,) = out[0][1]
    assert warning == ("[rank 0/2] checkpoint step 2 was saved by 3 ranks and is loaded by 2: the plain extras X of "
                       "ranks 2 to 2 are not restored (no rank here has their number)")
