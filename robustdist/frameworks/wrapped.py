"""What ``harden`` accepts from another framework: a model Accelerate prepared or Fabric set up is composed with
(kept as it is: the framework owns DDP and the data sharding), a model anything else already wrapped is refused
before anything starts, and a loader the framework prepared is kept with a warning on what robustdist's
checkpoints do not hold."""

from __future__ import annotations

import sys
import weakref
from typing import Any

from torch import nn

from robustdist.config.schema import HardenConfig
from robustdist.frameworks import accelerate as _accelerate
from robustdist.frameworks import fabric as _fabric
from robustdist.parallel import fsdp_wrap
from robustdist.parallel.ddp import HF_TRAINER_FIX
from robustdist.runtime import _torch_compat
from robustdist.runtime.errors import ConfigError
from robustdist.runtime.log import get_logger
from robustdist.runtime.topology import Topology

__all__ = ["FRAMEWORK_LOADER_WARNING", "composes_with", "foreign_wrapper", "framework_loader", "framework_scaler",
           "hardened_holds", "keeps_loader", "refuse_fsdp_under_accelerate", "refuse_rewrap"]

log = get_logger(__name__)

FRAMEWORK_LOADER_WARNING = {
    "accelerate": "the loader is one accelerator.prepare returned: robustdist's checkpoints (h.save) do not hold its "
                  "position. Resume it with accelerator.skip_first_batches(loader, n), or checkpoint with "
                  "robustdist.frameworks.accelerate.save_state (docs/porting.md)",
    "fabric": "the loader is one fabric.setup_dataloaders returned: robustdist's checkpoints (h.save) do not hold its "
              "position, and Fabric sets its epoch from its own count of iterations, which restarts at 0 after a "
              "resume. Give harden the plain DataLoader instead: harden shards it and h.resume continues it "
              "mid-epoch (docs/porting.md, Fabric)",
}


_HELD: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[Any]] = weakref.WeakKeyDictionary()
"""Every model harden() was given or returned, to the ``Hardened`` that holds it (while both live)."""


def hardened_holds(hardened: Any, *models: nn.Module) -> None:
    """Record that ``hardened`` holds ``models`` (the one harden() was given, and the one it returned)."""
    for module in models:
        _HELD[module] = weakref.ref(hardened)


def refuse_rewrap(model: Any, topo: Topology, config: HardenConfig) -> str | None:
    """A model robustdist hardened (and has not closed), or one another wrapper already wrapped, is refused before
    anything starts: a second DDP, a second checkpointer and a second watchdog on one model train wrongly, not
    loudly. Returns the framework harden composes with (:func:`composes_with`), once its model and ``config``
    suit that framework (:func:`refuse_fsdp_under_accelerate`, :func:`robustdist.frameworks.fabric.verdict`)."""
    rank = topo.rank if topo.is_distributed else None
    inner = _torch_compat.compiled_inner(model)  # torch.compile(m) of a model harden holds is that model too
    for candidate in (model, inner):
        earlier = _HELD.get(candidate) if isinstance(candidate, nn.Module) else None
        holder = earlier() if earlier is not None else None
        if holder is None:
            continue
        if not holder.closed:
            raise ConfigError(
                f"harden() was given {type(model).__name__}, which an earlier harden() call hardened (the model it "
                "was given or the one it returned) and is still open; expected the bare model, hardened once. Fix: "
                "keep the first result (h.model, h.loader) and remove the second harden() call, or h.close() the "
                "first before hardening the model again.", rank=rank)
        if candidate is holder.model and foreign_wrapper(candidate) is not None \
                and not _fabric.is_fabric_module(candidate):  # Fabric's wrapper is the model harden was given
            raise ConfigError(
                f"harden() was given the {type(candidate).__name__} a closed harden() call returned (its wrapper); "
                "expected the bare model. Fix: pass robustdist.unwrap_model(h.model), or the model you first "
                "gave harden().", rank=rank)
    framework = composes_with(model, rank)
    if framework == "accelerate":
        refuse_fsdp_under_accelerate(config, topo)
    elif framework == "fabric":
        _fabric.verdict(model, config.distributed.strategy, rank)
    return framework


def framework_loader(framework: str | None, loader: Any) -> bool:
    """``loader`` is one the framework in charge prepared (harden keeps it as it is)."""
    if framework == "accelerate":
        return _accelerate.is_prepared_loader(loader)
    return framework == "fabric" and _fabric.is_fabric_loader(loader)


def keeps_loader(framework: str | None, loader: Any, *, checkpointing: bool) -> bool:
    """Whether harden keeps ``loader`` as it is: none, or one the framework prepared (with a warning, when
    ``checkpointing``, that robustdist's checkpoints do not hold its position)."""
    if loader is None or not framework_loader(framework, loader):
        return loader is None
    if checkpointing:
        log.warning("%s", FRAMEWORK_LOADER_WARNING[str(framework)])
    return True


def framework_scaler(framework: str | None, model: Any, optimizer: Any) -> Any:
    """The GradScaler the framework in charge made (Accelerate's for ``optimizer``, Fabric's for ``model``), or
    None."""
    if framework == "accelerate":
        return _accelerate.prepared_scaler(optimizer)
    return _fabric.scaler_of(model) if framework == "fabric" else None


def composes_with(model: Any, rank: int | None) -> str | None:
    """The framework harden composes with: ``"accelerate"`` when an Accelerator is in charge (see
    :func:`_accelerate_verdict`), ``"fabric"`` for a model ``fabric.setup`` returned, else None; a model another
    wrapper already wrapped is refused (a second DDP would average every gradient twice)."""
    wrapper = foreign_wrapper(model)
    processes = _accelerate.in_charge()
    if processes is not None:
        return "accelerate" if _accelerate_verdict(model, wrapper, processes, rank) else None
    if _fabric.is_fabric_module(model):
        return "fabric"
    if wrapper is not None:
        raise ConfigError(
            f"harden() was given a model already wrapped by {wrapper}; expected the bare model: harden() wraps it "
            "itself (DDP or FSDP), so a second wrapper would average every gradient twice or shard the data twice. "
            "Fix: remove that wrapping call (ray.train.torch.prepare_model, accelerator.prepare or DDP(...)) and "
            "pass the bare module (robustdist.unwrap_model(model) gives it back); see docs/porting.md.", rank=rank)
    return None


def _accelerate_verdict(model: Any, wrapper: str | None, processes: int, rank: int | None) -> bool:
    """An Accelerator exists in this process: it owns DDP and the data sharding, and harden composes with it (keeps
    the model as prepared, adds the watchdog, step guard and checkpoints). A bare model under several processes
    has not been prepared yet (prepare wraps it in DDP there), and a model another framework wrapped or FSDP2
    sharded (Accelerate's FSDP plugin) is refused."""
    if isinstance(model, nn.Module) and (any(fsdp_wrap.is_fsdp(m) for m in model.modules()) or
                                         any(type(p).__name__ == "DTensor" for p in model.parameters())):
        raise ConfigError(
            f"harden() was given a {fsdp_wrap.class_name(model)} sharded by FSDP2 (fully_shard: Accelerate's FSDP "
            "plugin, or the script's own) or split by tensor parallelism (DTensor parameters) while an Accelerator "
            "is in charge of this process; robustdist composes "
            "with Accelerate's DDP and single-process paths only (its step guard, watchdog and checkpoints assume "
            "whole parameters on every rank). Expected the model accelerator.prepare returned without an FSDP "
            "plugin. Fix: drop the FSDP plugin (Accelerate then uses DDP), or give harden() the bare model with "
            "distributed.strategy: fsdp and no Accelerator (docs/porting.md, Accelerate).", rank=rank)
    if wrapper is None:
        if processes > 1 and "transformers.trainer" in sys.modules:
            raise ConfigError(
                f"harden() was given a bare {type(model).__name__} while an Accelerator of {processes} processes is "
                "in charge of this process and transformers' Trainer is loaded (a Trainer makes its Accelerator when "
                "it is built): a Trainer wraps the model it holds in its own DDP and shards its own loader, so "
                "harden's DDP would be a second one. Expected harden() without a Trainer. "
                f"{HF_TRAINER_FIX} If this Accelerator is your own, not a Trainer's: "
                "accelerator.prepare(model, optimizer, loader) first, then harden() what it returns.", rank=rank)
        if processes > 1:
            raise ConfigError(
                f"harden() was given a bare {type(model).__name__} while an Accelerator of {processes} processes is "
                "in charge of this process: accelerator.prepare would then wrap harden's DDP in a second one and "
                "shard its loader again (each rank trains on half its data). Expected the model accelerator.prepare "
                "returned. Fix: model, optimizer, loader = accelerator.prepare(model, optimizer, loader) first, then "
                "h = harden(model, loader, cfg, optimizer=optimizer): harden keeps Accelerate's DDP and sampler and "
                "adds the watchdog, the step guard and checkpoints (docs/porting.md, Accelerate).", rank=rank)
        return True
    if wrapper.startswith(("DistributedDataParallel", "Accelerate")):
        return True
    raise ConfigError(
        f"harden() was given a model wrapped by {wrapper} while an Accelerator is in charge of this process; "
        "expected the model accelerator.prepare returned (DDP, or the bare model on one process). Fix: prepare it "
        "with Accelerate alone (docs/porting.md, Accelerate).", rank=rank)


def refuse_fsdp_under_accelerate(config: HardenConfig, topo: Topology) -> None:
    if config.distributed.strategy == "fsdp":
        raise ConfigError(
            "distributed.strategy is 'fsdp' while an Accelerator is in charge of this process: Accelerate owns the "
            "model's wrapping (its FSDP plugin), robustdist would shard it a second time; expected strategy 'ddp' "
            "(harden then keeps what Accelerate prepared). Fix: set distributed.strategy: ddp, or drop Accelerate "
            "and let harden shard the model.", rank=topo.rank if topo.is_distributed else None)


def foreign_wrapper(model: Any) -> str | None:
    """Who wrapped ``model`` already, in words, or None for a bare module."""
    kind = type(model)
    if kind.__module__.startswith(("lightning.fabric", "lightning_fabric")) and kind.__name__ == "_FabricModule":
        return "Lightning Fabric (fabric.setup)"
    if kind.__module__.startswith("deepspeed") and kind.__name__ == "DeepSpeedEngine":
        return "DeepSpeed (deepspeed.initialize)"
    if not isinstance(model, nn.Module):
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for candidate in (model, _torch_compat.compiled_inner(model)):
        if isinstance(candidate, DistributedDataParallel):
            return ("DistributedDataParallel (ray.train.torch.prepare_model, accelerator.prepare under a launcher, "
                    "or the script's own DDP(...))")
        if isinstance(candidate, FullyShardedDataParallel):
            return "FSDP1 (FullyShardedDataParallel(...), or accelerator.prepare with an FSDP plugin)"
    if "_original_forward" in vars(model):
        return "Accelerate (accelerator.prepare: its mixed-precision forward)"
    return None
