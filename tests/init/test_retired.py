"""A default group robustdist destroys stays referenced, so a DDP model freed right after cannot deadlock.

torch frees a DDP model's Reducer with the GIL held, and the Reducer's reference can be the group's last:
``~ProcessGroupGloo`` then joins a gloo worker that waits for the GIL to drop the tensors of a Python-made
collective. Before robustdist kept the group, the second test hung in most runs on this machine."""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch import nn

from robustdist import harden
from robustdist.init import retired
from robustdist.testing.ranks import run_ranks


def test_keep_holds_until_release_and_release_empties():
    marker = object()
    retired.release()
    retired.keep(marker)
    retired.keep(None)
    assert retired._kept == [marker]
    assert retired.release() == 1
    assert retired.release() == 0


def _close_then_free(rank: int, rounds: int) -> list[bool]:
    sys.setswitchinterval(1.0)  # a thread waiting for the GIL gets it only when this one blocks: widens the race
    held = []
    for _ in range(rounds):
        h = harden(nn.Linear(3, 1), None, {"health": {"hang_timeout": None}})
        seen: list[int | None] = [None, None]
        dist.all_gather_object(seen, rank)  # tensors Python creates, which gloo's worker thread releases
        assert seen == [0, 1]
        h.close()
        held.append(len(retired._kept) == 1 and not dist.is_initialized())
        del h  # frees the DDP model, whose Reducer held the destroyed group
    return held


def test_a_model_freed_right_after_close_does_not_deadlock_in_the_group_destructor():
    rounds = 6
    assert run_ranks(_close_then_free, 2, args=(rounds,), init=False, timeout=30 * rounds) == [[True] * rounds] * 2
