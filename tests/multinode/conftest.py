"""The lab tests' shared reference: the DDP-tutorial client (``tests/clients/ddp_tutorial_inprocess.py``) trained
straight through on this host, 2 ranks for ``STRAIGHT_EPOCHS`` epochs, once per session for every test that asks
for that run (``tests._torchrun.shared_straight``: the lab tests here and, on any pytest-xdist worker, the
single-host tests that compare with the same run).

Every lab run of that job on 2 ranks (in-process recovery after an exception or a healed partition, a whole node
replaced) ends bitwise equal to it. The parameters a run ends with depend on the data, the model, the world size and
the epochs, not on its pacing (``--step-sleep``) or on how often it saves to the in-memory tier (``--local-every``):
so one run without either serves them all, and a save that changed the training shows as a difference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._torchrun import results, shared_straight
from tests.multinode._lab import STRAIGHT_EPOCHS, TUTORIAL


@pytest.fixture(scope="session")
def straight_2_ranks(tmp_path_factory) -> list:
    """``results()`` of the straight run: per rank, its result record and its final parameters."""
    work = shared_straight(tmp_path_factory, Path(TUTORIAL), "--epochs", str(STRAIGHT_EPOCHS), timeout=200)
    return results(work, "straight")
