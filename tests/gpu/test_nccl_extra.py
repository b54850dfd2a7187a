"""Tier (c), GPU only: device pinning, an NCCL group's abort, and harden on NCCL with in-process recovery asked for
(it must say the run takes the ordinary path). Skipped without CUDA; never part of CI's verdict."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the lent GPU machine)"),
]


def _single(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def test_local_device_pins_the_launchers_local_rank(monkeypatch):
    from robustdist import local_device

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    device = local_device()
    assert device == torch.device("cuda", 0) and torch.cuda.current_device() == 0


def test_an_nccl_groups_abort_returns_and_the_group_can_be_made_again(monkeypatch, tmp_path):
    from robustdist.init.process_group import distributed

    _single(monkeypatch, tmp_path)
    with distributed({"distributed": {"timeout": 60}}, init_single=True) as report:
        assert report.backend == "nccl"
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        pg = dist.distributed_c10d._get_default_group()
        start = time.monotonic()
        pg.abort() if hasattr(pg, "abort") else pg._get_backend(torch.device("cuda")).abort()
        assert time.monotonic() - start < 30
    with distributed({"distributed": {"timeout": 60}}, init_single=True) as report:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4


def test_harden_and_h_run_on_a_one_rank_nccl_job_with_in_process_recovery(monkeypatch, tmp_path):
    from robustdist import harden
    from robustdist.testing.ranks import free_port

    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(var, value)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"checkpoint": {"dir": str(tmp_path / "ckpt"), "every_n_steps": 1}, "recovery": {"in_process": True}}
    h = harden(model, None, cfg, optimizer=opt)
    assert h.init_report.backend == "nccl"

    def train(h, step):
        x = torch.randn(4, 8, device="cuda")
        h.model(x).square().mean().backward()
        opt.step()
        h.save(step + 1, optimizer=opt)
        return step + 1

    assert h.run(train, optimizer=opt) == 1
    assert next(model.parameters()).is_cuda and h.closed and not dist.is_initialized()
