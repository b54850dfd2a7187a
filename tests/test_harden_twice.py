"""harden() refuses a model it already hardened, and one another wrapper already wrapped (Ray's prepare_model,
the script's DDP), before it starts anything. A model Accelerate prepared composes instead, while its
Accelerator exists (tests/frameworks/test_accelerate.py), and so does one Lightning Fabric set up
(tests/frameworks/test_fabric.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from robustdist import harden
from robustdist.runtime.errors import ConfigError
from robustdist.testing.ranks import run_ranks
from tests import _training as tr

OFF = {"health": {"hang_timeout": None}}


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def test_a_second_harden_of_an_open_one_is_refused_and_a_closed_one_may_be_hardened_again(single_process, tmp_path):
    model = nn.Linear(2, 2)
    h = harden(model, None, {**OFF, "checkpoint": {"dir": str(tmp_path)}})
    for again in (model, h.model):
        with pytest.raises(ConfigError) as exc:
            harden(again, None, {**OFF, "checkpoint": {"dir": str(tmp_path)}})
        assert str(exc.value) == (
            "harden() was given Linear, which an earlier harden() call hardened (the model it was given or the one "
            "it returned) and is still open; expected the bare model, hardened once. Fix: keep the first result "
            "(h.model, h.loader) and remove the second harden() call, or h.close() the first before hardening the "
            "model again.")
    h.close()
    with harden(model, None, {**OFF, "checkpoint": {"dir": str(tmp_path)}}) as again:  # closed: a fresh start
        assert again.model is model
    with pytest.raises(ConfigError, match="bad_section"):  # a harden that failed holds nothing
        harden(model, None, {"bad_section": {}})
    held = harden(model, None, OFF)
    with pytest.raises(ConfigError, match=r"^harden\(\) was given OptimizedModule, which an earlier harden\(\) call"):
        harden(torch.compile(model), None, OFF)  # the same model, compiled
    held.close()


def _twice(rank):
    model = tr.make_model()
    h = harden(model, tr.make_loader(), OFF)
    out = []
    for again in (model, h.model, TorchDDP(tr.make_model())):  # the last: what prepare_model hands a script
        groups = dist.is_initialized()
        try:
            harden(again, None, OFF)
        except ConfigError as e:
            out.append((str(e), dist.is_initialized() == groups))
    h.close()
    try:
        harden(h.model, None, OFF)  # closed, but what it returned is robustdist's DDP: not a bare model
    except ConfigError as e:
        out.append((str(e), True))
    return out


@pytest.mark.processes
def test_two_ranks_name_the_rank_and_refuse_before_init():
    for rank, out in enumerate(run_ranks(_twice, 2, init=False, timeout=120)):
        assert len(out) == 4 and all(unchanged for _, unchanged in out)
        assert out[3][0] == (f"[rank {rank}] harden() was given the DistributedDataParallel a closed harden() call "
                             "returned (its wrapper); expected the bare model. Fix: pass "
                             "robustdist.unwrap_model(h.model), or the model you first gave harden().")
        assert out[0][0].startswith(f"[rank {rank}] harden() was given Sequential, which an earlier harden() call "
                                    "hardened")
        assert out[1][0].startswith(f"[rank {rank}] harden() was given DistributedDataParallel, which an earlier "
                                    "harden() call hardened")
        assert out[2][0] == (
            f"[rank {rank}] harden() was given a model already wrapped by DistributedDataParallel "
            "(ray.train.torch.prepare_model, accelerator.prepare under a launcher, or the script's own DDP(...)); "
            "expected the bare model: harden() wraps it itself (DDP or FSDP), so a second wrapper would average "
            "every gradient twice or shard the data twice. Fix: remove that wrapping call "
            "(ray.train.torch.prepare_model, accelerator.prepare or DDP(...)) and pass the bare module "
            "(robustdist.unwrap_model(model) gives it back); see docs/porting.md.")

