"""A DDP model freed right after ``h.close()`` destroys the group cannot deadlock in torch's group destructor.

torch frees a DDP model's Reducer with the GIL held, and the Reducer's reference can be the group's last:
``~ProcessGroupGloo`` then joins a gloo worker that waits for the GIL to drop the tensors of a Python-made
collective. Without the pin (``group_teardown.pin_ddp_modules``, run before robustdist destroys a group), the second
test hung on every run here (3 of 3) at the line that freed the model."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from robustdist import harden
from robustdist.runtime.group_teardown import GROUP_PIN as _GROUP_PIN
from robustdist.runtime.group_teardown import pin_ddp_modules
from robustdist.testing.ranks import run_ranks

pytestmark = pytest.mark.processes


def _pinned(rank: int) -> tuple[int, bool, int]:
    before = pin_ddp_modules()  # none alive yet in this fresh process
    model = DistributedDataParallel(nn.Linear(3, 1))
    count = pin_ddp_modules() + before
    keys = list(vars(model))
    again = pin_ddp_modules()  # idempotent: still one pin, still the last attribute
    return count, keys[-1] == _GROUP_PIN and model.__dict__[_GROUP_PIN] is model.process_group, \
        again + list(vars(model)).count(_GROUP_PIN) + (list(vars(model))[-1] == _GROUP_PIN)


def test_each_ddp_gets_its_group_as_its_last_attribute():
    assert run_ranks(_pinned, 2, timeout=60) == [(1, True, 3)] * 2


def _close_then_free(rank: int, rounds: int) -> list[bool]:
    sys.setswitchinterval(1.0)  # a thread waiting for the GIL gets it only when this one blocks: widens the race
    closed = []
    for _ in range(rounds):
        h = harden(nn.Linear(3, 1), None, {"health": {"hang_timeout": None}})
        seen: list[int | None] = [None, None]
        dist.all_gather_object(seen, rank)  # tensors Python creates, which gloo's worker thread releases
        assert seen == [0, 1]
        h.close()
        closed.append(not dist.is_initialized())
        del h  # frees the DDP model, whose Reducer held the destroyed group
    return closed


def test_a_model_freed_right_after_close_does_not_deadlock_in_the_group_destructor():
    rounds = 6
    assert run_ranks(_close_then_free, 2, args=(rounds,), init=False, timeout=30 * rounds) == [[True] * rounds] * 2
