"""Names robustdist writes in a checkpoint directory, planted by someone else: a directory, a link or a hard link
at ``.robustdist-lineage``, ``.robustdist-restarts.json`` or ``.robustdist-errors``, through ``harden`` on two
ranks. Each is a named :class:`CheckpointError` on every rank (never a raw ``OSError`` on rank 0 and a gloo
error naming nothing on the others), or replaced without writing through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from robustdist.testing.ranks import run_ranks

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
TIMEOUT = 120


def _cfg(root: str) -> dict:
    return {"checkpoint": {"dir": os.path.join(root, "ckpt"), "every_n_steps": 1, "local_every_n_steps": 1,
                           "local_dir": os.path.join(root, "shm")},
            "health": {"hang_timeout": None}}


def _harden_and_resume(rank: int, root: str):
    from robustdist import harden
    from robustdist.runtime.errors import CheckpointError

    torch.manual_seed(0)
    try:
        with harden(nn.Linear(4, 1), None, _cfg(root)) as h:
            opt = torch.optim.SGD(h.model.parameters(), lr=0.1)
            h.resume(optimizer=opt)
            h.save(1)
            return "ok", (Path(root) / "ckpt" / ".robustdist-lineage").read_text()
    except CheckpointError as e:
        return type(e).__name__, str(e)


def _ckpt(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    return ckpt


@pytest.mark.parametrize("name", [".robustdist-lineage", ".robustdist-restarts.json"])
def test_a_directory_at_a_name_robustdist_writes_is_a_named_error_on_every_rank(tmp_path, name):
    (_ckpt(tmp_path) / name).mkdir()
    out = run_ranks(_harden_and_resume, 2, init=False, args=(str(tmp_path),), timeout=TIMEOUT)
    for rank, (kind, message) in enumerate(out):
        assert kind == "CheckpointError", (rank, message)
        assert message.startswith(f"[rank {rank}]")
        assert f"ckpt/{name}: is a directory" in message and "Fix: remove the directory" in message
    assert (tmp_path / "ckpt" / name).is_dir()  # not ours: left alone


def test_a_hard_link_at_the_lineage_name_is_replaced_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious, and not a token")
    os.link(victim, _ckpt(tmp_path) / ".robustdist-lineage")
    out = run_ranks(_harden_and_resume, 2, init=False, args=(str(tmp_path),), timeout=TIMEOUT)
    assert [kind for kind, _ in out] == ["ok", "ok"]
    assert len(out[0][1]) == 32 and out[0][1] == out[1][1]
    assert victim.read_text() == "precious, and not a token"
    assert os.stat(victim).st_nlink == 1


def test_an_errors_folder_linked_outside_is_not_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (_ckpt(tmp_path) / ".robustdist-errors").symlink_to(outside, target_is_directory=True)
    out = run_ranks(_fail_inside_harden, 2, init=False, args=(str(tmp_path),), timeout=TIMEOUT)
    assert out == ["raised", "raised"]
    assert list(outside.iterdir()) == []


def _fail_inside_harden(rank: int, root: str):
    from robustdist import harden

    try:
        with harden(nn.Linear(4, 1), None, _cfg(root)) as h:
            h.resume(optimizer=torch.optim.SGD(h.model.parameters(), lr=0.1))
            raise RuntimeError(f"boom on rank {rank}")
    except RuntimeError:
        return "raised"
