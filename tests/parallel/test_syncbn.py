"""CPU SyncBatchNorm under real DDP on gloo equals one BatchNorm over the concatenated batch (float64).

Scales: DDP averages parameter gradients over W ranks, while each rank's input gradient is the gradient of
the *sum* of all ranks' losses (as with torch's CUDA SyncBatchNorm). So against a reference whose loss is
the sum of the per-slice losses, input gradients match directly and DDP-averaged parameter gradients match
after multiplying by W.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from robustdist.parallel import syncbn
from robustdist.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from robustdist.testing.ranks import run_ranks

TOL = {"atol": 1e-10, "rtol": 1e-9}
CASES = [
    # (BatchNorm class, per-sample spatial shape, affine, momentum, track_running_stats)
    (nn.BatchNorm1d, (), True, 0.1, True),
    (nn.BatchNorm1d, (4,), True, 0.3, True),
    (nn.BatchNorm2d, (3, 2), True, 0.1, True),
    (nn.BatchNorm3d, (2, 2, 2), True, 0.1, True),
    (nn.BatchNorm2d, (3, 3), False, 0.1, True),
    (nn.BatchNorm2d, (2, 3), True, None, True),
    (nn.BatchNorm1d, (5,), True, 0.1, False),
]
C = 3


class Net(nn.Module):
    """A per-channel scale before the BN, so the BN input gradient reaches a parameter too."""

    def __init__(self, bn_cls, affine, momentum, track):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, C, dtype=torch.float64))
        self.bn = bn_cls(C, affine=affine, momentum=momentum, track_running_stats=track, dtype=torch.float64)

    def forward(self, x):
        shape = [1, C] + [1] * (x.dim() - 2)
        return self.bn(x * self.scale.view(shape))


def _data(step, sizes, spatial):
    g = torch.Generator().manual_seed(1000 + step)
    total = sum(sizes)
    x = torch.randn(total, C, *spatial, generator=g, dtype=torch.float64) * 3 + 1.5
    w = torch.randn(total, C, *spatial, generator=g, dtype=torch.float64)  # weights the loss: non-uniform dy
    return x, w


def _compare(rank, sizes, case, sync, steps=3):
    bn_cls, spatial, affine, momentum, track = case
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = Net(bn_cls, affine, momentum, track)
    local = copy.deepcopy(ref)
    if sync:
        local = convert_sync_batchnorm(local)
    ddp = nn.parallel.DistributedDataParallel(local)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    errs = {"out": 0.0, "dx": 0.0, "grads": 0.0, "params": 0.0, "stats": 0.0}
    for step in range(steps):
        x, w = _data(step, sizes, spatial)
        x_ref = x.clone().requires_grad_(True)
        y_ref = ref(x_ref)
        (y_ref * w).sum().backward()  # the sum of every slice's loss
        x_loc = x[lo:hi].clone().requires_grad_(True)
        y = ddp(x_loc)
        (y * w[lo:hi]).sum().backward()
        errs["out"] = max(errs["out"], (y - y_ref[lo:hi]).abs().max().item())
        errs["dx"] = max(errs["dx"], (x_loc.grad - x_ref.grad[lo:hi]).abs().max().item())
        for p_ref, p in zip(ref.parameters(), ddp.module.parameters()):
            errs["grads"] = max(errs["grads"], (p.grad * world - p_ref.grad).abs().max().item())
            p.grad.mul_(world)  # step on the reference's gradient scale, so parameters stay comparable
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
        for p_ref, p in zip(ref.parameters(), ddp.module.parameters()):
            errs["params"] = max(errs["params"], (p - p_ref).abs().max().item())
        for b_ref, b in zip(ref.buffers(), ddp.module.buffers()):
            errs["stats"] = max(errs["stats"], (b.double() - b_ref.double()).abs().max().item())
    return errs


def _run_cases(rank, sizes, host_math=True):
    syncbn._HOST_MATH = host_math  # False: the per-channel math in torch ops, as on an accelerator
    return [_compare(rank, sizes, case, sync=True) for case in CASES]


@pytest.mark.processes
@pytest.mark.parametrize("sizes,host_math", [([4, 4], True), ([3, 6], True), ([2, 5, 3], True), ([3, 6], False)],
                         ids=["2-equal", "2-unequal", "3-unequal", "2-unequal-torch-math"])
def test_syncbn_matches_batchnorm_over_the_concatenated_batch(sizes, host_math):
    per_rank = run_ranks(_run_cases, len(sizes), args=(sizes, host_math), timeout=120)
    for rank, results in enumerate(per_rank):
        for case, errs in zip(CASES, results):
            assert all(v <= 1e-9 for v in errs.values()), (rank, case, errs)


def _plain_bn(rank, sizes):
    return _compare(rank, sizes, CASES[2], sync=False, steps=1)


@pytest.mark.processes
def test_plain_batchnorm_under_ddp_does_not_match():
    per_rank = run_ranks(_plain_bn, 2, args=([3, 6],), timeout=60)
    assert all(errs["out"] > 1e-3 for errs in per_rank)  # per-rank batch statistics differ from global ones


def _eval_and_running_stats(rank):
    torch.manual_seed(0)
    bn = SyncBatchNorm(C, dtype=torch.float64)
    x = torch.randn(4 + rank, C, 3, dtype=torch.float64)
    bn(x)  # one synchronised training step
    bn.eval()
    for _ in range(rank + 1):  # ranks call eval forward a different number of times: no collective allowed
        out = bn(x)
    expected = (x - bn.running_mean.view(1, C, 1)) / torch.sqrt(bn.running_var.view(1, C, 1) + bn.eps)
    untracked = SyncBatchNorm(C, track_running_stats=False, dtype=torch.float64).eval()
    local = untracked(x)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # still in step with the other rank
    return ((out - expected).abs().max().item(),
            (local - nn.functional.batch_norm(x, None, None, training=True)).abs().max().item(),
            int(bn.num_batches_tracked), t.item())


@pytest.mark.processes
def test_eval_mode_does_not_sync():
    for eval_err, untracked_err, tracked, total in run_ranks(_eval_and_running_stats, 2, timeout=60):
        assert eval_err < 1e-12 and untracked_err < 1e-12 and tracked == 1 and total == 1.0


def test_single_process_is_plain_batchnorm():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(C, momentum=None)
    sync = convert_sync_batchnorm(copy.deepcopy(bn))
    assert isinstance(sync, SyncBatchNorm)
    x = torch.randn(5, C, 2, 2)
    assert torch.allclose(sync(x), bn(x)) and torch.allclose(sync.running_var, bn.running_var)


def test_convert_and_revert_share_state_and_restore_classes():
    model = nn.Sequential(nn.Conv2d(1, C, 1), nn.BatchNorm2d(C), nn.Sequential(nn.BatchNorm1d(C)))
    weight = model[1].weight
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[2][0], SyncBatchNorm)
    assert converted[1].weight is weight  # shared, not copied: an optimizer built earlier still works
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted[1]) is nn.BatchNorm2d and type(reverted[2][0]) is nn.BatchNorm1d
    assert reverted[1].weight is weight
    torch_sync = revert_sync_batchnorm(nn.SyncBatchNorm(C))
    assert isinstance(torch_sync, nn.modules.batchnorm._BatchNorm) and not isinstance(torch_sync, nn.SyncBatchNorm)
    assert torch_sync(torch.randn(4, C, 2)).shape == (4, C, 2)


def _too_small(rank):
    bn = SyncBatchNorm(C)
    try:
        bn(torch.randn(1 - rank, C))  # one value per channel in total across both ranks
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.processes
def test_one_value_per_channel_in_total_raises_like_torch():
    for message in run_ranks(_too_small, 2, timeout=60):
        assert message.startswith("Expected more than 1 value per channel when training across all ranks")


def _low_precision(rank, dtype, offset, host_math):
    """float32 (with a large mean, where one-pass sums of squares would cancel) and bfloat16 inputs against
    a float64 BatchNorm over the concatenated batch."""
    syncbn._HOST_MATH = host_math
    sizes, spatial = [3, 5], (4, 4)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), C, *spatial, generator=g, dtype=torch.float64) + offset
    w = torch.randn(sum(sizes), C, *spatial, generator=g, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    ref = nn.functional.batch_norm(x_ref, None, None, training=True)
    (ref * w).sum().backward()
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    bn = SyncBatchNorm(C, affine=False, dtype=dtype)
    x_loc = x[lo:hi].to(dtype).requires_grad_(True)
    y = bn(x_loc)
    (y * w[lo:hi].to(dtype)).sum().backward()
    return (y.dtype, (y.double() - ref[lo:hi]).abs().max().item(),
            (x_loc.grad.double() - x_ref.grad[lo:hi]).abs().max().item())


@pytest.mark.processes
@pytest.mark.parametrize("dtype,offset,tol,host_math", [(torch.float32, 100.0, 1e-4, True),
                                                        (torch.float32, 100.0, 1e-4, False),
                                                        (torch.bfloat16, 0.0, 3e-2, True)],
                         ids=["float32-offset", "float32-offset-torch-math", "bfloat16"])
def test_float32_and_bfloat16_inputs(dtype, offset, tol, host_math):
    for out_dtype, out_err, dx_err in run_ranks(_low_precision, 2, args=(dtype, offset, host_math), timeout=60):
        assert out_dtype == dtype and out_err < tol and dx_err < tol, (out_err, dx_err)


@pytest.mark.parametrize("max_bytes", [syncbn._TWO_PASS_MAX_BYTES, 0], ids=["two-pass", "fused-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_statistics_both_algorithms(monkeypatch, max_bytes, dtype):
    monkeypatch.setattr(syncbn, "_TWO_PASS_MAX_BYTES", max_bytes)
    x64 = torch.randn(6, C, 5, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2 + 50
    x = x64.to(dtype)
    mean, var = syncbn._local_stats(x, x.numel() // C)
    ref_var, ref_mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    assert mean.dtype == var.dtype == torch.float32
    assert torch.allclose(mean.double(), ref_mean, rtol=1e-6) and torch.allclose(var.double(), ref_var, rtol=1e-4)
    empty_mean, empty_var = syncbn._local_stats(x[:0], 0)
    assert empty_mean.shape == (C,) and not empty_mean.any() and not empty_var.any()
