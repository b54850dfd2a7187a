"""The private torch names of mixed precision, fenced (``tests/test_private_api.py``): GradScaler's fused finite check
and its per-optimizer stage, which the step guard uses. Each is listed in :data:`PRIVATE_APIS`, with the torch
versions it was verified on; the canaries (``tests/runtime/test_private_api_canaries.py``) resolve every entry on the
installed torch.
"""

from __future__ import annotations

from typing import Any

import torch

from robustdist.runtime._torch_compat import _VERIFIED, _attr
from robustdist.runtime.private_api import PrivateAPI

__all__ = ["PRIVATE_APIS", "non_finite_check_and_unscale_", "scaler_unscaled"]


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> bool:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler's fused check); False where this torch
    has no such op, so the caller takes its slower public path."""
    op = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if op is None:
        return False
    op(grads, found, inv_scale)
    return True


def scaler_unscaled(scaler: Any, optimizer: Any) -> bool | None:
    """Whether ``scaler.unscale_(optimizer)`` already ran since the last ``update()``
    (``GradScaler._per_optimizer_states[id(optimizer)]["stage"]``); None where the scaler does not say."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return None
    entry = states.get(id(optimizer))  # .get: the defaultdict must not grow an entry here
    if entry is None:
        return False
    stage = entry.get("stage") if isinstance(entry, dict) else None
    return None if stage is None else getattr(stage, "name", None) == "UNSCALED"


def _probe_scaler_stage() -> Any:
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(param.sum()).backward()
    before = scaler_unscaled(scaler, opt)
    scaler.unscale_(opt)
    return (before is False and scaler_unscaled(scaler, opt) is True) or None


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("torch._amp_foreach_non_finite_check_and_unscale_", "torch",
               "the step guard's fused finite check; without it a slower per-dtype sum is used", _VERIFIED,
               lambda: _attr(torch, "_amp_foreach_non_finite_check_and_unscale_")),
    PrivateAPI("torch.amp.GradScaler._per_optimizer_states[id(optimizer)]['stage']", "torch",
               "the step guard's skip/rollback records the bad step with the scaler only if the loop did not call "
               "unscale_ already; without it, unscale_'s own refusal (a RuntimeError) is taken as the answer",
               _VERIFIED, _probe_scaler_stage),
)
