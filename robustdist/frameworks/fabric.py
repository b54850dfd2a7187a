"""Lightning Fabric: :func:`robustdist.harden` composes with the model ``fabric.setup`` returned.

Fabric owns the model's wrapping (DDP under ``strategy="ddp"``) and its precision; harden keeps that wrapper as
it is and adds the watchdog, the step guard and atomic checkpoints::

    robustdist.safe_init_process_group()            # under torchrun, before Fabric: a restart can rendezvous again
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    h = robustdist.harden(model, train_loader, cfg, optimizer=optimizer)  # the loader *before* setup_dataloaders

Give harden the plain ``DataLoader``: it shards it with a ``DistributedSampler`` and checkpoints its position,
so ``h.resume`` continues mid-epoch bitwise. A loader ``fabric.setup_dataloaders`` returned is kept as it is
(Fabric sets its sampler's epoch by counting its own iterations, which restart at 0 after a resume), with a
warning that robustdist's checkpoints do not hold its position; ``fabric.setup_dataloaders(h.loader)`` is
refused when it is iterated, for the same reason (:class:`robustdist.data.SafeDataLoader`). Only Fabric's DDP and single-device strategies compose: a
model Fabric sharded (FSDP, DeepSpeed, XLA) is refused, as is ``distributed.strategy: fsdp`` on a Fabric model.

This module is the one place robustdist reads Fabric's private attributes (``_forward_module``, ``_strategy``);
nothing here imports lightning: the objects are recognised by their classes' modules.
"""

from __future__ import annotations

from typing import Any

from robustdist.runtime.errors import ConfigError

__all__ = ["is_fabric_loader", "is_fabric_module", "scaler_of", "verdict"]

_MODULES = ("lightning.fabric", "lightning_fabric")


def _is(obj: Any, name: str) -> bool:
    kind = type(obj)
    return kind.__name__ == name and any(kind.__module__ == m or kind.__module__.startswith(m + ".") for m in _MODULES)


def is_fabric_module(model: Any) -> bool:
    """``model`` is what ``fabric.setup`` returned (a ``_FabricModule``)."""
    return _is(model, "_FabricModule")


def is_fabric_loader(loader: Any) -> bool:
    """``loader`` is what ``fabric.setup_dataloaders`` returned (a ``_FabricDataLoader``)."""
    return _is(loader, "_FabricDataLoader")


def scaler_of(model: Any) -> Any:
    """The ``GradScaler`` of Fabric's precision plugin (``precision="16-mixed"``), or None."""
    strategy = getattr(model, "_strategy", None)
    return getattr(getattr(strategy, "precision", None), "scaler", None)


def verdict(model: Any, strategy: str, rank: int | None) -> None:
    """Raise :class:`ConfigError` unless harden can keep ``model`` (a ``_FabricModule``) as Fabric wrapped it:
    Fabric's DDP, or the bare module on one device, and ``distributed.strategy`` 'ddp'."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from robustdist.runtime import _torch_compat

    def bare(module: Any) -> Any:  # torch.compile before fabric.setup (Lightning's documented order)
        return _torch_compat.compiled_inner(module) or module

    inner, original = bare(getattr(model, "_forward_module", None)), bare(getattr(model, "module", None))
    if strategy == "fsdp":
        raise ConfigError(
            "distributed.strategy is 'fsdp' but the model is one fabric.setup returned: Fabric owns the model's "
            "wrapping, robustdist would shard it a second time; expected strategy 'ddp' (harden then keeps Fabric's "
            "wrapper). Fix: set distributed.strategy: ddp and choose the sharding with Fabric(strategy=...), or "
            "give harden the bare model and drop fabric.setup.", rank=rank)
    sharded = isinstance(inner, nn.Module) and any(type(p).__name__ == "DTensor" for p in inner.parameters())
    if not sharded and (isinstance(inner, DistributedDataParallel)
                        or (isinstance(inner, nn.Module) and inner is original)):
        return
    raise ConfigError(
        f"harden() was given a model Lightning Fabric wrapped in {type(inner).__name__}"
        f"{' with sharded (DTensor) parameters' if sharded else ''} (its strategy "
        f"{type(getattr(model, '_strategy', None)).__name__}); robustdist composes with Fabric's DDP and "
        "single-device strategies only (its watchdog, step guard and checkpoints assume whole parameters on every "
        "rank). Fix: Fabric(strategy='ddp'), or let harden shard the bare model (distributed.strategy: fsdp) "
        "without fabric.setup (docs/porting.md, Fabric).", rank=rank)

