"""SyncBatchNorm that works on CPU/gloo, where ``torch.nn.SyncBatchNorm`` raises
("SyncBatchNorm expected input tensor to be on GPU").

Semantics are those of one ``BatchNorm`` over the concatenation of every rank's batch: outputs, input
gradients, parameter gradients (after DDP's averaging), ``running_mean``, ``running_var`` (unbiased, from the
global count) and ``num_batches_tracked``, for ``momentum=None`` too. Ranks may hold different batch sizes,
even zero.

Collectives, per training forward and backward (all ranks, same order, like torch's CUDA SyncBatchNorm):

* forward: one ``all_gather`` of each rank's ``(count, mean, M2)``, combined with Chan's parallel formula
  (numerically stable where raw sums of squares cancel);
* backward: one ``all_reduce`` of ``(sum(dy), sum(dy * (x - mean)))``.

Like torch, it does not synchronise in eval mode (running statistics are used), nor when
``track_running_stats=False`` in eval mode (each rank normalises with its own batch), nor when no process
group of more than one rank exists (it is then a plain batch norm).

:func:`convert_sync_batchnorm` converts every ``_BatchNorm`` of a module tree; :func:`revert_sync_batchnorm`
converts back (to the original BatchNorm1d/2d/3d class) for export.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from robustdist.parallel.state_dict import unwrap_model
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import RobustDistError

__all__ = ["SyncBatchNorm", "convert_batchnorm_for", "convert_sync_batchnorm", "revert_sync_batchnorm"]


_BatchNorm = _torch_compat.batch_norm_base()
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
_HOST_MATH = True  # tests turn it off to exercise the device path on CPU


def _on_host(x: torch.Tensor) -> bool:
    """Per-channel statistics of a CPU float tensor are combined in numpy: on vectors this small a numpy
    operation costs a fraction of a torch operation's dispatch (benchmarks/findings.md, P5)."""
    return _HOST_MATH and x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES


def _array(t: torch.Tensor, host: bool) -> Any:
    return t.detach().numpy() if host else t


def _tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """Back from :func:`_array` (a numpy array, on the CPU, or already a tensor) to a tensor of ``dtype``."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a.astype(_NUMPY_DTYPES[dtype], copy=False)) if dtype in _NUMPY_DTYPES \
            else torch.from_numpy(a).to(dtype)
    return a.to(dtype)


_TWO_PASS_MAX_BYTES = 16 * 2**20


def _local_stats(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of this rank's batch.

    Up to 16 MiB of (accumulator-precision) input, by the two-pass algorithm (as accurate as Welford's): on
    the CPU faster than torch's fused ``batch_norm_update_stats``, which updates a Welford state per element.
    Above that the two-pass temporary no longer stays in cache and the fused kernel is faster (see
    benchmarks/findings.md, P5). Low-precision inputs accumulate in float32."""
    channels = x.size(1)
    acc = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    if not count:
        zeros = torch.zeros(channels, dtype=acc, device=x.device)
        return zeros, zeros
    if x.numel() * acc.itemsize > _TWO_PASS_MAX_BYTES:
        return torch.batch_norm_update_stats(x.to(acc), None, None, 0.0)  # its bf16 statistics are bf16
    dims = [0, *range(2, x.dim())]
    mean = x.sum(dims, dtype=acc).div_(count)
    centred = x.to(acc) - mean.view([1, channels] + [1] * (x.dim() - 2))
    return mean, centred.square_().sum(dims).div_(count)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                factor: float, group: Any) -> torch.Tensor:
        channels = x.size(1)
        count = x.numel() // channels if channels else 0
        mean, var = _local_stats(x, count)
        host = _on_host(x)
        # statistics travel and combine in float64: counts stay exact and M2 does not lose precision
        if host:
            buf = np.empty(2 * channels + 1)
            buf[0] = count
            buf[1:channels + 1] = mean.numpy()
            np.multiply(var.numpy(), count, out=buf[channels + 1:])
            packed = torch.from_numpy(buf)
        else:
            packed = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                                mean.double(), var.double() * count])
        gathered = torch.empty((dist.get_world_size(group), packed.numel()), dtype=torch.float64, device=x.device)
        dist.all_gather(list(gathered.unbind(0)), packed, group=group)
        g = _array(gathered, host)
        counts, means, m2s = g[:, :1], g[:, 1:channels + 1], g[:, channels + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training across all ranks, got input "
                             f"size {list(x.shape)} here and {int(total)} value(s) per channel in total")
        g_mean64 = (counts * means).sum(0) / total  # Chan's parallel formula
        g_m2 = (m2s + counts * (means - g_mean64) ** 2).sum(0)
        g_mean, g_var = _tensor(g_mean64, x.dtype), _tensor(g_m2 / total, x.dtype)
        invstd = _tensor((g_m2 / total + eps) ** -0.5, x.dtype)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(_tensor(g_mean64, running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(_tensor(g_m2 / (total - 1), running_var.dtype), alpha=factor)
        # the normalisation itself is torch's fused kernel, fed the global statistics (one pass, one output)
        out = F.batch_norm(x, g_mean, g_var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, g_mean, invstd)
        ctx.group, ctx.has_bias, ctx.total = group, bias is not None, total
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        channels, total = x.size(1), ctx.total
        shape = [1, channels] + [1] * (x.dim() - 2)
        grad_out = grad_out.contiguous()
        # sum(dy) and sum(dy * (x - mean)) per channel in one fused pass: torch's own batch-norm backward with
        # an inverse std of 1 returns exactly these as its weight and bias gradients
        ones = torch.ones(channels, dtype=x.dtype, device=x.device)
        _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_out, x, ones, None, None, mean, ones, True, 0.0, [False, True, True])
        grad_weight = sum_dy_xmu * invstd if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            packed = torch.cat([sum_dy, sum_dy_xmu])
            work = dist.all_reduce(packed, group=ctx.group, async_op=True)
            xmu = x - mean.view(shape)  # does not need the global sums: computed while they travel
            scale = invstd if weight is None else invstd * weight
            work.wait()
            host = _on_host(x)
            p, s, i = _array(packed, host), _array(scale, host), _array(invstd, host)
            # dx = scale * (dy - sum(dy)/N - (x - mean) * invstd^2 * sum(dy * (x - mean))/N)
            #    = scale * dy + xmu_coef * (x - mean) + const, per channel
            xmu_coef = _tensor(-(s * i * i) * p[channels:] / total, x.dtype)
            const = _tensor(-s * p[:channels] / total, x.dtype)
            grad_x = xmu.mul_(xmu_coef.view(shape)).add_(const.view(shape)).addcmul_(grad_out, scale.view(shape))
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the global batch of a process group, on any device (CPU/gloo included).

    Args are those of ``torch.nn.SyncBatchNorm``: ``num_features, eps, momentum, affine,
    track_running_stats, process_group`` (None: the default group).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        self._reverts_to: type[_BatchNorm] | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _needs_sync(self, bn_training: bool) -> bool:
        if not (bn_training and self.training and _dist.is_up()):
            return False
        return dist.get_world_size(self.process_group) > 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None
        if not self._needs_sync(bn_training):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var, self.eps, factor,
                                      self.process_group)


def _copy_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    if src.affine:
        with torch.no_grad():
            dst.weight = src.weight
            dst.bias = src.bias
    dst.running_mean = src.running_mean
    dst.running_var = src.running_var
    dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every ``_BatchNorm`` (not already synchronised) with :class:`SyncBatchNorm`, sharing its
    parameters and buffers. Returns the converted module (a new object only when ``module`` itself is a BN)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
        new._reverts_to = type(module)
        return _copy_state(module, new)
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module


class _BatchNormXd(_BatchNorm):
    """A BatchNorm of any dimensionality, for reverting a SyncBatchNorm whose original class is unknown."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Turn robustdist's (and torch's) SyncBatchNorm back into plain BatchNorm, for export or inference."""
    if isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        cls = getattr(module, "_reverts_to", None) or _BatchNormXd
        new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        return _copy_state(module, new)
    for name, child in module.named_children():
        reverted = revert_sync_batchnorm(child)
        if reverted is not child:
            setattr(module, name, reverted)
    return module


def convert_batchnorm_for(model: nn.Module, device: torch.device) -> nn.Module:
    """Convert every BatchNorm in ``model`` (or its compiled/wrapped inner module) to the SyncBatchNorm that works
    on ``device``: torch's on CUDA, :class:`SyncBatchNorm` elsewhere (torch's raises on CPU). Used by
    ``wrap_ddp`` and ``wrap_fsdp``; returns the model (a new module only when ``model`` itself is a BatchNorm)."""
    inner = unwrap_model(model)
    if device.type == "cuda":
        converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(inner)
    else:
        converted = convert_sync_batchnorm(inner)
    if converted is not inner:  # the model itself was a BatchNorm
        if inner is not model:
            raise RobustDistError("cannot convert a compiled bare BatchNorm in place; expected a model that contains "
                                  "it. Fix: wrap the BatchNorm in an nn.Sequential before torch.compile.")
        return converted
    return model
