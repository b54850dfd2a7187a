"""Tier (c), GPU only: the NCCL init path for real. Skipped without CUDA; never part of CI's verdict.

Run on a GPU machine: ``.venv/bin/python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the lent GPU machine)"),
]


def test_nccl_single_rank_group(monkeypatch):
    from robustdist.init.process_group import distributed

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with distributed({"distributed": {"timeout": 120}}, init_single=True) as report:
        assert report.backend == "nccl" and report.created
        assert torch.cuda.current_device() == 0
        assert report.fingerprints[0]["gpu"] is not None  # the physical id came from the real device
        assert report.timings["smoke"] > 0
    assert not dist.is_initialized()


def test_native_syncbn_conversion_on_cuda():
    from torch import nn

    from robustdist.parallel.ddp import _convert_bn

    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2)).cuda()
    converted = _convert_bn(model, torch.device("cuda", 0))
    assert isinstance(converted[1], nn.SyncBatchNorm)  # torch's own on CUDA, not robustdist's CPU one


def test_pin_memory_auto_pins_on_cuda(monkeypatch):
    from robustdist.data.dataloader import safe_dataloader

    monkeypatch.delenv("RANK", raising=False)
    data = [torch.full((4,), float(i)) for i in range(8)]
    loader = safe_dataloader(data, batch_size=4, num_workers=1)
    assert loader.pin_memory is True  # data.pin_memory="auto" with CUDA available
    assert all(batch.is_pinned() for batch in loader)
