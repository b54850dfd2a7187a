"""A failure while the next in-process recovery generation is built, on real gloo ranks (a DDP-tutorial-shaped
loop, test_loop's): the rank whose build fails declares it; every rank ends promptly (not after the collective or
init timeout, 60 s here), the failing rank with its own error, the others with a RecoveryError naming it, and each
error is recorded for the restart-loop guard.

The failure is injected into harden's own steps in the rank's process (a fault that needs no GPU and no broken disk
to happen): the run directory's claim (a collective every rank is in while the failing rank raises), or the
watchdog's start (after the last collective of the build: the other ranks are resuming by then), or the script's own
make() after harden returned."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist import harden
from robustdist.recovery import generation, run_in_process
from robustdist.runtime.errors import RecoveryError
from robustdist.testing.ranks import run_ranks
from tests.recovery.test_loop import ToyModel

pytestmark = pytest.mark.timeout(300)
TOTAL = 10


def _job(rank: int, root: str, failing: int, where: str) -> dict:
    """Rank 1 raises ValueError after step 4 in generation 0; generation 1's build then fails on rank ``failing``
    at ``where`` ("claim", "watchdog", or "make": the script's make() after harden returned) with OSError."""
    def fail_in_generation_1(real):
        def call(*args, **kwargs):
            if generation() == 1 and rank == failing:
                raise OSError(f"injected: {where} failed on rank {rank}")
            return real(*args, **kwargs)
        return call

    harden_module = sys.modules[harden.__module__]  # harden's own module, where its steps are looked up
    if where == "claim":
        harden_module.claim = fail_in_generation_1(harden_module.claim)
    elif where == "watchdog":
        harden_module.Watchdog = fail_in_generation_1(harden_module.Watchdog)
    torch.manual_seed(0)
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64, 10), torch.randn(64, 5)), batch_size=4, shuffle=True)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": 100, "local_every_n_steps": 1,
                          "local_dir": f"{root}/shm"},
           "health": {"hang_timeout": 600},
           "distributed": {"timeout": 60, "init_timeout": 60, "barrier_timeout": 60}}

    def train(h, step: int) -> int:
        while step < TOTAL:
            for x, y in h.loader:
                nn.functional.mse_loss(h.model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if rank == 1 and step == 4 and generation() == 0:
                    raise ValueError("boom at step 4")
                h.save(step, optimizer=optimizer)
                if step == TOTAL:
                    break
        return step

    out: dict = {}
    start = time.monotonic()
    try:
        def make():
            h = harden(model, loader, cfg, optimizer=optimizer)
            if where == "make":  # the script's own part of make(), after harden returned, fails
                fail_in_generation_1(lambda: None)()
            return h

        out["end"] = run_in_process(make, train, optimizer=optimizer)
    except BaseException as e:
        out.update(raised=f"{type(e).__name__}: {e}", named=isinstance(e, RecoveryError))
    out["seconds"] = time.monotonic() - start
    return out


def _recorded(root: Path) -> dict[int, str]:
    found = {}
    for path in (root / "ckpt").rglob("attempt_0_rank_*.txt"):
        found[int(path.stem.rsplit("_", 1)[1])] = path.read_text()
    return found


@pytest.mark.processes
@pytest.mark.parametrize("failing,where", [(1, "claim"), (0, "claim"), (1, "watchdog"), (1, "make")],
                         ids=["rank1-in-a-collective", "rank0-serving-the-store", "rank1-after-the-collectives",
                              "rank1-in-make-after-harden"])
def test_a_failed_build_of_the_next_generation_ends_every_rank_promptly_naming_it(tmp_path, failing, where):
    out = run_ranks(_job, 2, args=(str(tmp_path), failing, where), init=False, timeout=200)
    other = 1 - failing
    assert out[failing]["raised"] == f"OSError: injected: {where} failed on rank {failing}", out
    assert not out[failing]["named"]
    message = out[other]["raised"]
    assert out[other]["named"], message
    assert message.startswith(f"RecoveryError: [rank {other}] in-process recovery generation 1 "), message
    assert (f"rank {failing} (" in message and "building in-process recovery generation 1 failed: OSError: "
            f"injected: {where} failed on rank {failing}" in message), message
    # long before the group's and the rendezvous's timeouts (60 s), which a rank not told would wait out
    assert max(o["seconds"] for o in out) < 45, out
    recorded = _recorded(tmp_path)
    assert f"injected: {where} failed on rank {failing}" in recorded.get(failing, ""), recorded
    assert "RecoveryError" in recorded.get(other, ""), recorded
    assert os.listdir(tmp_path / "ckpt")  # the run directory is there (the guard's record with it)


class _DeadStore:
    """A store that stopped answering: every call raises."""

    def check(self, keys):
        raise RuntimeError("store gone")

    get = set = check


def test_a_failing_rank_that_cannot_reach_the_store_says_so_and_still_gets_out(monkeypatch, caplog):
    import logging

    from robustdist.recovery import generations

    monkeypatch.setattr(generations._dist, "default_store", lambda: _DeadStore())
    monkeypatch.setattr(generations._dist, "world_size", lambda group=None: 2)
    monkeypatch.setattr(generations._dist, "rank", lambda group=None: 1)
    caplog.set_level(logging.WARNING, logger="robustdist")
    g = generations.Generation("robustdist/recovery/test", 1)
    start = time.monotonic()
    generations.tell(g, OSError("disk gone"), None, bound=2.0)
    assert time.monotonic() - start < 2.0 + 1.0  # bounded
    assert g.told and g.fired.is_set() and not g.own and g.cause is None
    text = " ".join(r.getMessage() for r in caplog.records)
    assert ("rank 1: could not tell the other ranks that building in-process recovery generation 1 failed "
            "(RuntimeError: store gone); expected the job's store to answer within 2 s." in text), text
    assert "Fix: check the store's host (rank 0's node) and this node's link to it." in text
    generations.tell(g, OSError("again"), None)  # once per generation
    assert len([r for r in caplog.records if "could not tell" in r.getMessage()]) == 1


@pytest.mark.parametrize("error,transport", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"), True),
    (OSError("injected: claim failed on rank 1"), False)])
def test_a_lost_connection_is_told_apart_from_a_cause(error, transport):
    from robustdist.recovery.generations import looks_like_transport

    assert looks_like_transport(error) is transport


def test_a_watch_that_cannot_start_says_what_it_costs_and_the_fix(monkeypatch, caplog):
    import logging

    from robustdist.recovery import generations

    def no_watch(*args, **kwargs):
        raise RuntimeError("connect refused")

    monkeypatch.setattr(generations._dist, "default_store", lambda: _DeadStore())
    monkeypatch.setattr(generations._dist, "world_size", lambda group=None: 2)
    monkeypatch.setattr(generations._dist, "rank", lambda group=None: 1)
    monkeypatch.setattr(generations, "FaultWatch", no_watch)
    caplog.set_level(logging.WARNING, logger="robustdist")
    g = generations.Generation("robustdist/recovery/test", 2)
    with generations.building(g):
        generations.group_made(5.0)
    assert g.rank == 1 and g.watch is None
    text = " ".join(r.getMessage() for r in caplog.records)
    assert ("rank 1: could not start the fault watch of in-process recovery generation 2 (RuntimeError: connect "
            "refused); expected one for every generation." in text), text
    assert "Fix: check that the job's c10d store is reachable from this node." in text
    generations.group_made(5.0)  # outside a build: nothing
    assert len([r for r in caplog.records if "could not start" in r.getMessage()]) == 1
