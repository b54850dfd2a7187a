"""``wrap_ddp``: a real ``DistributedDataParallel``, with SyncBatchNorm that works on CPU and a readable
unused-parameter error.

* Single process (no group, or world size 1): the model is moved to its device and returned unwrapped, so a
  script runs unchanged without a launcher.
* ``sync_batchnorm`` ("auto"/True with world size > 1) converts every BatchNorm *before* wrapping: torch's
  ``SyncBatchNorm`` on CUDA, :class:`robustdist.parallel.syncbn.SyncBatchNorm` elsewhere (torch's raises on CPU).
* Wrapping twice is refused. The recommended order with ``torch.compile`` is **wrap, then compile**
  (``torch.compile(wrap_ddp(model))``), so DDP's graph splitting at bucket boundaries keeps communication
  overlapped; a compiled module handed in is wrapped as it is (correct, but less overlap) with a warning.
* With ``find_unused_parameters=False``, DDP's "Expected to have finished reduction in the prior
  iteration" lists parameter *indices*; the returned DDP re-raises it as a :class:`RobustDistError` naming
  the parameters and the two fixes, at no per-step cost.

DDP's own semantics are unchanged: no barrier is needed before ``optimizer.step()`` (backward's all-reduce
is the sync point), and ``state_dict()`` keeps its ``module.`` prefix; use
:func:`robustdist.parallel.state_dict.model_state_dict` for prefix-free keys.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from robustdist.config.schema import DistributedConfig, HardenConfig, section_of
from robustdist.parallel.state_dict import is_compiled
from robustdist.parallel.syncbn import convert_batchnorm_for
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime import exit_drain
from robustdist.runtime.errors import ConfigError, RobustDistError
from robustdist.runtime.log import get_logger, warn
from robustdist.runtime.topology import detect_topology

__all__ = ["HF_TRAINER_FIX", "DistributedDataParallel", "reducer_parameter_names",
           "wrap_ddp"]

log = get_logger(__name__)
_UNFINISHED = "Expected to have finished reduction in the prior iteration"


def reducer_parameter_names(module: nn.Module, ignored: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Parameter names in the order DDP's reducer indexes them (its ``_build_params_for_reducer``)."""
    names, seen = [], set()
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and full not in ignored and param not in seen:
                seen.add(param)
                names.append(full)
    return names


class DistributedDataParallel(_TorchDDP):
    """torch's ``DistributedDataParallel``, plus an unused-parameter error that names the parameters, and a
    refusal of a second data-parallel wrapper around it (see :func:`_outer_wrapper`): the whole stack is searched at
    each forward until the first training forward (grad enabled, training mode) passes it, and after that the few
    frames that call this forward (a wrapper added later calls it from there: a second DDP's ``_run_ddp_forward``,
    the HF Trainer's ``compute_loss``)."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.__dict__.get("_robustdist_outer_checked"):
            torch.compiler.disable(_refuse_outer_wrapper)(self)  # not traced; applied here, not at import
            if self.training and torch.is_grad_enabled():  # checked until the first training forward passes it
                self.__dict__["_robustdist_outer_checked"] = True
        elif not torch.compiler.is_compiling() and _wrapped_from_near(self):
            _refuse_outer_wrapper(self)
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as e:
            if _UNFINISHED not in str(e):
                raise
            raise self._unused_parameter_error(e) from e

    def _unused_parameter_error(self, error: RuntimeError) -> RobustDistError:
        match = re.search(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)", str(error))
        rank = _dist.error_rank()
        if match is None:
            names = "(torch did not list them; set TORCH_DISTRIBUTED_DEBUG=INFO to see them)"
        else:
            table = reducer_parameter_names(self.module, set(self.parameters_to_ignore))
            found = [table[int(i)] if int(i) < len(table) else f"#{i}" for i in match.group(2).split()]
            names = ", ".join(found)
        return RobustDistError(
            f"DDP found parameters that received no gradient in the last backward: {names}; expected every "
            "parameter that requires grad to take part in the loss (find_unused_parameters=False). Fix: pass "
            "find_unused_parameters=True to wrap_ddp (costs a graph traversal every step), or make those "
            "parameters part of the loss (or set requires_grad=False on them).",
            rank=rank,
        )


_FIX_FIRST = ("Fix: remove the later wrapping of h.model, or call the framework first and harden() on what it "
              "returns: accelerator.prepare(model, optimizer, loader), or fabric.setup(model, optimizer) "
              "(docs/porting.md).")
_HF_TRAINER = "transformers' Trainer (Trainer(model=h.model): its Accelerator wraps the model in a second DDP)"
HF_TRAINER_FIX = ("Fix: harden() does not compose with transformers' Trainer, which runs its own loop, DDP, sampler "
                   "and checkpoints (harden's step guard and checkpoints would never run): give Trainer the bare "
                   "model and drop harden(), or write the loop with Accelerate and harden what accelerator.prepare "
                   "returns (docs/porting.md, HF Trainer).")


def _is_hf_trainer(owner: object) -> bool:
    """``owner`` is a ``transformers.Trainer`` (or a subclass: ``Seq2SeqTrainer``, TRL's trainers), by its
    class's MRO, without importing transformers."""
    return any(k.__name__ == "Trainer" and k.__module__ == "transformers.trainer" for k in type(owner).__mro__)


def _outer_wrapper(module: nn.Module, owner: object) -> str | None:
    """What ``owner`` (the ``self`` of a frame above ``module``'s forward) is, when it is a data-parallel wrapper
    other than ``module`` (the second wrapper of a model robustdist already wrapped), or a transformers
    ``Trainer`` (which wraps the model it is given in a DDP of its own)."""
    if owner is module or owner is None:
        return None
    if _is_hf_trainer(owner):
        return _HF_TRAINER
    kind = type(owner)
    if kind.__name__ == "_FabricModule" and kind.__module__.startswith(("lightning.", "lightning_fabric.")):
        return "Lightning Fabric (fabric.setup)"
    if kind.__name__ == "DeepSpeedEngine" and kind.__module__.startswith("deepspeed."):
        return "DeepSpeed (deepspeed.initialize)"
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(owner, (_TorchDDP, FullyShardedDataParallel)):
        return (f"a second {type(owner).__name__} (accelerator.prepare, ray.train.torch.prepare_model or DDP(...) "
                "applied to the model robustdist returned)")
    return None


_NEAR = 12  # frames above forward: nn.Module's call, a second DDP's _run_ddp_forward, Trainer.compute_loss


def _wrapped_from_near(module: nn.Module) -> bool:
    """A wrapper other than ``module`` among the few frames that called its forward (a cheap look, every forward)."""
    frame = inspect.currentframe()
    for _ in range(_NEAR):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and \
                _outer_wrapper(module, frame.f_locals.get("self")) is not None:
            return True
        frame = frame.f_back
    return False


def _refuse_outer_wrapper(module: nn.Module) -> None:
    """At the first forward of robustdist's DDP: if a wrapper called it (another DDP: ``accelerator.prepare(h.model)``,
    ``prepare_model``, ``fabric.setup``), every gradient would be averaged twice and, with that framework's loader,
    the data sharded twice. Every rank runs its first forward, so every rank raises the same error: no hang."""
    frame = inspect.currentframe()
    depth = 0
    found: list[str] = []  # innermost first; a framework's own wrapper (Fabric's) sits above the DDP it made
    while frame is not None and depth < 200:
        if "self" in frame.f_code.co_varnames[:frame.f_code.co_argcount]:
            owner = _outer_wrapper(module, frame.f_locals.get("self"))
            if owner is not None:
                found.append(owner)
        frame = frame.f_back
        depth += 1
    if found:
        named = [f for f in found if not f.startswith("a second ")]
        outer = (named or found)[-1]
        raise ConfigError(
            f"the model robustdist wrapped in DDP (harden or wrap_ddp) was called through {outer}; "
            "expected it to be called directly: two data-parallel wrappers average every gradient twice, and the "
            "framework's loader shards the data a second time. "
            f"{HF_TRAINER_FIX if outer == _HF_TRAINER else _FIX_FIRST}", rank=_dist.error_rank())


def _contains_ddp(model: nn.Module) -> bool:
    return any(isinstance(m, _TorchDDP) for m in model.modules()) or (
        is_compiled(model) and _contains_ddp(_torch_compat.compiled_inner(model)))


def _refuse_sharded(model: nn.Module) -> None:
    """DDP needs whole parameters: refuse a model FSDP2 sharded (``fully_shard`` on it or a submodule; with
    ``reshard_after_forward=False`` its parameters are plain tensors between a forward and the next backward) or
    one tensor parallelism split into DTensors."""
    from robustdist.parallel import fsdp_wrap

    sharded = [name or "the root" for name, m in model.named_modules() if fsdp_wrap.is_fsdp(m)]
    if sharded:
        raise ConfigError(
            f"{type(model).__name__} is sharded by FSDP2 (fully_shard on {', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}); DDP needs whole parameters on every rank, expected a bare "
            "module. Fix: with harden(), set distributed.strategy: fsdp (it keeps the submodules you sharded and "
            "shards the root); else remove the fully_shard calls before wrap_ddp.", rank=_dist.error_rank())
    split = [n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"]
    if split:
        raise ConfigError(
            f"{type(model).__name__} has parameters split across ranks (DTensor: {', '.join(split[:3])}"
            f"{', ...' if len(split) > 3 else ''}: tensor parallelism, parallelize_module); DDP needs whole "
            "parameters on every rank, expected a bare module. Fix: remove the tensor parallelism, or apply "
            "fully_shard yourself over the data-parallel dimension of a 2-D mesh (dp, tp) and harden() the result "
            "with distributed.strategy: fsdp (it is kept as it is).", rank=_dist.error_rank())


def wrap_ddp(model: nn.Module, cfg: DistributedConfig | HardenConfig | None = None, *, device: torch.device | str | int | None = None,
             sync_batchnorm: bool | str | None = None, **ddp_kwargs: Any) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in a real DDP (see the module docstring).

    Args:
        model: a bare module, or a ``torch.compile``'d one.
        cfg: the ``distributed`` section (or a whole HardenConfig); ``find_unused_parameters``,
            ``broadcast_buffers`` and ``sync_batchnorm`` are used. A dict still works, with a DeprecationWarning.
        device: overrides the topology's device.
        sync_batchnorm: overrides ``distributed.sync_batchnorm`` ("auto", True or False).
        ddp_kwargs: passed to DDP, overriding the config.
    """
    if _contains_ddp(model):
        raise ConfigError(
            f"{type(model).__name__} is already wrapped in DistributedDataParallel (by an earlier wrap_ddp, "
            "ray.train.torch.prepare_model, accelerator.prepare or the script's own DDP(...)); expected a bare "
            "module. Fix: wrap it once: remove the other wrapping call, or pass the unwrapped model "
            "(robustdist.unwrap_model(model) gives it back).", rank=_dist.error_rank())
    _refuse_sharded(model)
    config = section_of(cfg, DistributedConfig, "wrap_ddp")
    target = torch.device(device) if device is not None and not isinstance(device, int) else (
        torch.device("cuda", device) if isinstance(device, int) else detect_topology().device)
    distributed = _dist.is_multi()
    if not distributed:
        log.debug("no process group of more than one rank: returning the model on %s, unwrapped", target)
        return model.to(target)
    exit_drain.install()  # DDP's collectives run on gloo workers too (see robustdist.runtime.exit_drain)
    mode = config.sync_batchnorm if sync_batchnorm is None else sync_batchnorm
    if mode not in ("auto", True, False):
        raise RobustDistError(f"sync_batchnorm={mode!r}; expected 'auto', True or False. Fix: pass one of those.")
    if mode in ("auto", True):
        model = convert_batchnorm_for(model, target)
    if is_compiled(model):
        warn("wrap_ddp got a torch.compile'd module: wrapping it as it is works, but compiling after wrapping "
             "(torch.compile(wrap_ddp(model))) lets DDP split the graph at bucket boundaries and overlap "
             "communication. Silence this by compiling after wrap_ddp.", once="compiled-before-ddp")
    model = model.to(target)
    kwargs: dict[str, Any] = {"find_unused_parameters": config.find_unused_parameters}
    if not config.broadcast_buffers and not {"broadcast_buffers", "forward_sync_buffers"} & set(ddp_kwargs):
        # True is DDP's default and is not passed. False keeps its historical meaning (no buffer sync at init nor
        # at forward), which torch >= 2.13 still honours through this deprecated argument only.
        kwargs["broadcast_buffers"] = False
    kwargs.update(ddp_kwargs)
    if target.type == "cuda":
        kwargs.setdefault("device_ids", [target])
    log.info("wrapping in DDP on %s (%s)", target, ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
    with warnings.catch_warnings():
        if "broadcast_buffers" not in ddp_kwargs:  # robustdist passed it on the config's behalf
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        return DistributedDataParallel(model, **kwargs)


_convert_bn = convert_batchnorm_for  # the name robustdist < 0.3 used
