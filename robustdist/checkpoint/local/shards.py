"""This rank's local shards of the sharded (FSDP2) entries, as the in-memory tier saves and restores them: plain CPU
tensors taken from each DTensor's local part, and copied back into the live DTensors' local parts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from robustdist.checkpoint import _payload
from robustdist.checkpoint._sharded import _optimizer_pair, _state_dicts
from robustdist.runtime.errors import CheckpointError

__all__ = ["local_shards", "restore_shards"]


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def _to_local(value: Any, staging: dict[tuple[Any, ...], torch.Tensor], key: tuple[Any, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if _is_dtensor(value) else value
        return _payload.snapshot(local, clone=True, staging=staging, key=key)
    if isinstance(value, dict):
        return {k: _to_local(v, staging, (*key, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local(v, staging, (*key, i)) for i, v in enumerate(value))
    return value


def local_shards(sharded: dict[str, Any], staging: dict[tuple[Any, ...], torch.Tensor]) -> dict[str, Any]:
    """This rank's local shards of the sharded (FSDP2) entries, as plain CPU tensors and data."""
    if not sharded:
        return {}
    out = {}
    for name, sd in _state_dicts(sharded).items():
        out[name] = _payload.plain(_to_local(sd, staging, ("s", name)), f"state[{name!r}] (local shards)")
    return out


def _fill(template: Any, saved: Any, where: str) -> Any:
    """``template`` (a live state dict with DTensors) with every local shard and value taken from ``saved``."""
    if isinstance(template, torch.Tensor):
        local = template.to_local() if _is_dtensor(template) else template
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            shown = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointError(f"{where}: saved shard {shown} does not fit the live shard {tuple(local.shape)} "
                                  f"{local.dtype} (another world size or model?)")
        with torch.no_grad():
            local.copy_(saved)
        return template
    if isinstance(template, dict):
        if not isinstance(saved, dict) or set(saved) != set(template):
            raise CheckpointError(f"{where}: saved keys differ from the live object's")
        return type(template)((k, _fill(template[k], saved[k], f"{where}.{k}")) for k in template)
    if isinstance(template, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(template):
            raise CheckpointError(f"{where}: saved list differs in length from the live object's")
        return type(template)(_fill(t, s, f"{where}[{i}]") for i, (t, s) in enumerate(zip(template, saved)))
    return saved


def restore_shards(entries: dict[str, Any], shards: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    templates = _state_dicts(entries)
    for name, value in entries.items():
        if name not in shards:
            raise CheckpointError(f"state[{name!r}]: no local shards saved for it")
        filled = _fill(templates[name], shards[name], f"state[{name!r}]")
        if isinstance(value, nn.Module):
            value.load_state_dict(filled)
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_optimizer_pair(entries, value), value, filled)
