"""The data-parallel wrapper ``distributed.strategy`` names, applied to a bare model: :func:`wrap`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from robustdist.config.schema import HardenConfig
from robustdist.parallel import fsdp
from robustdist.parallel.ddp import wrap_ddp
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import ConfigError
from robustdist.runtime.topology import Topology

__all__ = ["wrap"]


def wrap(model: nn.Module, config: HardenConfig, topo: Topology, *, distributed: bool, rank: int | None,
         optimizer: torch.optim.Optimizer | None, shard_policy: Any, init_weights: Any) -> nn.Module:
    """``model`` under DDP (``strategy: ddp``; as it is in one process with no launcher) or FSDP2 (``strategy:
    fsdp``). ``distributed``: a launcher made this a distributed run; ``rank``: the rank errors name."""
    if config.distributed.strategy == "ddp":
        if shard_policy is not None or init_weights is not None:  # refused the same way with or without a launcher
            raise ConfigError("harden(shard_policy=..., init_weights=...) apply to FSDP, but distributed.strategy is "
                              "'ddp'; expected strategy 'fsdp' with them. Fix: set distributed.strategy: fsdp, or "
                              "drop those arguments.", rank=_dist.error_rank())
        if not distributed and not _dist.is_up():
            return model  # one process, no launcher: the model as it is
        return wrap_ddp(model, config.distributed, device=topo.device)
    if optimizer is not None and (distributed or any(p.is_meta for p in model.parameters())):
        raise ConfigError(
            "harden(..., optimizer=...) with distributed.strategy='fsdp': fully_shard replaces the model's parameters, "
            "so an optimizer built before harden() would update tensors the model no longer uses; expected no "
            "optimizer yet. Fix: h = harden(model, loader, cfg); "
            "h.optimizer = torch.optim.AdamW(h.model.parameters()).",
            rank=rank)
    calibration = fsdp.fsdp_calibrate(topology=topo, strategy=config.fsdp.sharding) if _dist.is_up() else None
    return fsdp.wrap_fsdp(model, config.fsdp, shard_policy=shard_policy, init_weights=init_weights, device=topo.device,
                          sync_batchnorm=config.distributed.sync_batchnorm, calibration=calibration)
