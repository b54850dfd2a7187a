"""Is the loss finite, and is every gradient? The per-step read behind :class:`~robustdist.health.StepGuard`.

:func:`check` answers both for the guard's ``"gradients"`` agreement, by one of two methods that agree on
every input whose gradient sums stay in range (see ``per_tensor``):

* ``"per_tensor"`` (the default when the gradients are on the CPU): each gradient is summed to one Python
  float (16-bit types accumulate in float32); a NaN or an Inf anywhere makes the total non-finite
  (``inf + -inf`` is NaN). One host read per tensor costs nothing on the CPU, and it allocates no
  temporaries. A sum can also overflow on huge *finite* gradients (a total beyond about 3e38), which this
  method counts as non-finite: an overflow by another name.
* ``"fused"`` (the default on accelerators): the check ``torch.amp.GradScaler`` runs every step,
  ``torch._amp_foreach_non_finite_check_and_unscale_``, once per (device, dtype) group with an inverse scale
  of exactly 1.0. On CUDA each group is one multi-tensor kernel that sets one float flag on the device when
  any element is NaN or Inf, so the answer is exact (no sum to overflow). The flags, and the loss's own flag
  when the loss is a tensor on the same device, are read back with one ``tolist()``: one host sync per step,
  whatever the number of tensors and dtypes (the loss's ``item()`` would otherwise be a second one).

Sparse gradients are checked through their values and complex ones through their real view, by both methods.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from robustdist.runtime import _amp_compat, _torch_compat
from robustdist.runtime.errors import ConfigError

METHODS = ("per_tensor", "fused")


def check(loss: Any, params: list[torch.Tensor], *, method: str | None = None) -> tuple[bool, bool]:
    """``(loss is finite, every gradient is finite)``; ``method`` is ``"per_tensor"``, ``"fused"`` or None (by
    the gradients' device, see the module docstring). Raises ``ConfigError`` when no parameter has a gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise ConfigError("step_guard found no gradients on the model; expected it to be called after backward() and "
                          "before optimizer.step() (and before zero_grad()). Fix: move the call.")
    if method is None:  # "per_tensor" would read each accelerator gradient to the host: any of them rules it out
        method = "per_tensor" if all(g.is_cpu for g in grads) else "fused"
    if method == "per_tensor":  # on the CPU faster than "fused", which also writes every gradient back
        return finite_loss(loss), math.isfinite(_per_tensor_total(grads))
    if method != "fused":
        raise ConfigError(f"method={method!r}; expected one of {METHODS} or None. Fix: pass one of those.")
    flag = _fused_flag([_plain(g) for g in grads])
    if isinstance(loss, torch.Tensor) and loss.device == flag.device:
        loss_bad = torch.logical_not(torch.isfinite(loss.detach()).all()).to(torch.float32).reshape(1)
        grads_bad, bad_loss = torch.cat([flag, loss_bad]).tolist()  # the one host sync
        return not bad_loss, not grads_bad
    return finite_loss(loss), not flag.item()


def grads_finite(params: list[torch.Tensor], *, method: str | None = None) -> bool:
    """True when every gradient is finite (:func:`check` without a loss)."""
    return check(0.0, params, method=method)[1]


def tensors_finite(grads: list[torch.Tensor]) -> bool:
    """True when every element of these gradient tensors is finite (by the method :func:`check` picks for their
    device); True for none."""
    if not grads:
        return True
    if all(g.is_cpu for g in grads):
        return math.isfinite(_per_tensor_total(grads))
    return not _fused_flag([_plain(g) for g in grads]).item()


def _fused_flag(grads: list[torch.Tensor]) -> torch.Tensor:
    """A one-element float32 tensor on the first gradient's device: nonzero when some element is NaN or Inf.
    Only device work: the caller reads it back."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    found: dict[torch.device, torch.Tensor] = {}
    unit: dict[torch.device, torch.Tensor] = {}
    for (device, dtype), group in groups.items():
        if device not in found:
            found[device] = torch.zeros(1, dtype=torch.float32, device=device)
            unit[device] = torch.ones(1, dtype=torch.float32, device=device)
        if device.type not in _FUSED_DEVICES:  # a kernel not checked here (MPS's early one resets the flag per
            found[device].add_(_sum_flag(group, dtype))  # call and reads inv_scale on the host): the sums
            continue
        group_found = torch.zeros(1, dtype=torch.float32, device=device)  # its own flag: no call can clear another's
        # The op is in place (it "unscales" by multiplying with inv_scale), yet it leaves every gradient bit for
        # bit as it was: each of its kernels (CPU, CUDA, XPU) returns the input untouched when inv_scale is
        # exactly 1.0 (`inv_scale == 1.f ? val : val * inv_scale`), and the round trip through its float math
        # type is exact for every value of a narrower type. A test checks it. Read-only ways cost more:
        # torch._foreach_norm(grads, inf) takes a per-tensor slow path on the CPU, and an isfinite() per tensor
        # allocates a bool tensor per gradient.
        try:
            fused = _amp_compat.non_finite_check_and_unscale_(group, group_found, unit[device])
        except RuntimeError:  # no kernel for this dtype, or overlapping elements (NotImplementedError is one)
            fused = False
        if not fused:  # no such op in this torch, or it refused the group  # no such op (another torch), no kernel for this dtype, or
            group_found = _sum_flag(group, dtype)  # overlapping elements (NotImplementedError is a RuntimeError)
        found[device].add_(group_found)
    flags = list(found.values())
    first = flags[0]
    for other in flags[1:]:  # gradients on several devices (pipeline stages in one process): one read still
        first = first + other.to(first.device)
    return first


_FUSED_DEVICES = ("cuda", "xpu", "cpu")  # whose kernels leave the flag of earlier calls alone (upstream source read)


def _sum_flag(group: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    total = torch.stack([g.sum(dtype=_accumulator(dtype)) for g in group]).sum()
    return torch.logical_not(torch.isfinite(total)).to(torch.float32).reshape(1)


def _per_tensor_total(grads: list[torch.Tensor]) -> float:
    """The sum of every gradient's sum, in order. This runs every step: a dense float32/float64 gradient (the
    common case) takes the short path, with no per-tensor Python beyond the sum and its read (on a 50 ms step
    of a 1M-parameter model, the per-tensor helpers cost about 0.4% of the step)."""
    total = 0.0
    for g in grads:
        if g.dtype in _NATIVE and g.layout == torch.strided:
            total += g.sum().item()
        else:
            g = _plain(g)
            total += g.sum(dtype=_accumulator(g.dtype)).item()
    return total


_NATIVE = (torch.float32, torch.float64)  # summed in their own type; real, so _plain() would return them as is


def _plain(grad: torch.Tensor) -> torch.Tensor:
    """A dense, real tensor holding every value of ``grad`` (no copy)."""
    if grad.layout != torch.strided:
        grad = _torch_compat.sparse_values(grad) if grad.is_sparse else grad.values()
    return torch.view_as_real(grad) if grad.is_complex() else grad


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def finite_loss(loss: Any) -> bool:
    """True when ``loss`` (a tensor of any shape, or a number) holds only finite values."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() == 1:
            return math.isfinite(loss.item())
        return bool(torch.isfinite(loss.detach()).all())
    return finite_number(loss)


def finite_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def loss_value(loss: Any) -> Any:
    """The loss as a Python number (a tensor's single value, or the sum of a larger one), for messages and
    gathers; anything else as it is."""
    if isinstance(loss, torch.Tensor):
        t = loss.detach()
        return t.item() if t.numel() == 1 else t.float().sum().item()
    return loss


def local_part(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (a DTensor's local shard: reading it needs no collective)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad
