"""``Collectives.problems`` and ``Collectives.attempt``: the agreement every stage ends with (every rank learns
every rank's outcome, so each raises the same named error or none does), on real gloo ranks."""

from __future__ import annotations

import pytest

from robustdist.runtime.dist import Collectives
from robustdist.runtime.errors import CheckpointError
from robustdist.testing import run_ranks


def _collectives(rank: int, world: int) -> Collectives:
    return Collectives(None, rank, world, timeout=30, arrival_timeout=10, error=CheckpointError, scope="outcomes")


def _stage(rank: int):
    c = _collectives(rank, 3)
    quiet = c.problems(None, "quiet stage")
    loud = c.problems("disk full" if rank == 1 else "", "loud stage")

    def fail() -> None:
        if rank == 2:
            raise OSError("x" * 1000)

    attempted = c.attempt("attempted stage", fail, limit=20)
    return quiet, loud, attempted


def test_every_rank_learns_every_rank_s_outcome():
    for quiet, loud, attempted in run_ranks(_stage, 3, timeout=90):
        assert quiet == {}
        assert loud == {1: "disk full"}  # an empty problem is no problem
        assert attempted == {2: "OSError: " + "x" * 20}


def test_one_process_agrees_with_itself():
    c = _collectives(0, 1)
    assert c.problems(None, "stage") == {} and c.problems("bad", "stage") == {0: "bad"}
    assert c.attempt("stage", lambda: None) == {}
    with pytest.raises(KeyboardInterrupt):  # only exceptions are outcomes; an interrupt goes through
        c.attempt("stage", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
