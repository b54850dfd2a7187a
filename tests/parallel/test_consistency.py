"""check_consistency on real gloo ranks: equal models pass, any drift is named on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from robustdist.parallel.consistency import check_consistency, tensor_digest
from robustdist.parallel.ddp import wrap_ddp
from robustdist.runtime.errors import ConfigError, RankDivergenceError
from robustdist.testing.ranks import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _check(rank, perturb, include):
    model = wrap_ddp(_model(), sync_batchnorm=False)
    inner = model.module
    if rank == 1 and perturb == "value":
        with torch.no_grad():
            inner[2].weight[0, 1] += 1e-6  # one value, one rank
    if rank == 1 and perturb == "buffer":
        inner[1].running_mean[0] = 5.0
    if rank == 1 and perturb == "extra":
        inner.register_buffer("step", torch.zeros(1))
    try:
        report = check_consistency(model, include=include)
    except RankDivergenceError as e:
        return str(e), e.ranks
    return report.tensors, report.world_size


@pytest.mark.processes
def test_equal_models_pass():
    assert run_ranks(_check, 3, args=(None, ("keys", "shapes", "dtypes", "values")), timeout=60) == [(9, 3)] * 3


@pytest.mark.processes
@pytest.mark.parametrize(("perturb", "needle"), [
    ("value", "2.weight: ranks 0, 2: shape (2, 4) float32 crc "),
    ("buffer", "1.running_mean: ranks 0, 2: shape (4,) float32 crc "),
    ("extra", "step: ranks 0, 2: absent; rank 1: shape (1,) float32 crc "),
])
def test_drift_on_rank_1_is_named_on_every_rank(perturb, needle):
    out = run_ranks(_check, 3, args=(perturb, ("keys", "shapes", "dtypes", "values")), timeout=60)
    for rank, (message, ranks) in enumerate(out):
        assert message.startswith(f"[rank {rank}] 1 tensor(s) differ across the 3 ranks:\n  ")
        assert needle in message and ranks == (1,)
        assert "Fix: look for a rank that skipped an optimizer step" in message


@pytest.mark.processes
def test_include_limits_what_is_compared():
    assert run_ranks(_check, 2, args=("value", ("keys", "shapes", "dtypes")), timeout=60) == [(9, 2)] * 2


def test_single_process_and_bad_include(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    report = check_consistency(_model())
    assert (report.tensors, report.world_size) == (9, 1)
    with pytest.raises(ConfigError, match=r"include=\('values', 'weights'\) has \['weights'\]"):
        check_consistency(_model(), include=("values", "weights"))


def test_digest_is_exact_for_any_dtype_and_layout():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(t) == tensor_digest(t.clone()) == tensor_digest(t.t().contiguous().t())
    flipped = t.clone()
    flipped.view(torch.int32)[1, 1] ^= 1  # one bit
    assert tensor_digest(flipped) != tensor_digest(t)
    b = t.to(torch.bfloat16)
    assert tensor_digest(b) == tensor_digest(b.clone()) and tensor_digest(torch.empty(0))
