"""The private torch names of process groups, modules and tensors, fenced here (``tests/test_private_api.py``); each
other area has a fence of its own: serialisation and DCP (``_serialization_compat``), mixed precision
(``_amp_compat``), the DataLoader (``_data_compat``) and torchelastic's agent, which ``robustdist run`` alone uses
(``_elastic_compat``).

Each access is one small function or class below, listed in :data:`PRIVATE_APIS` with the torch versions the
version matrix ran it on (``docs/status.md``) and, where torch has one in the supported range, the public
replacement. ``tests/runtime/test_private_api_canaries.py`` resolves every entry of every fence on the installed
torch and fails naming the API and the version when a release moves it.

Where a private name is absent, the function says so and the caller degrades (a less specific message, a
slower path, a check skipped with a log line); none of them raises a raw error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from robustdist.runtime.private_api import PrivateAPI

__all__ = ["PRIVATE_APIS", "STATE_DICT_METADATA", "COMPILED_KEY_SEGMENT", "SCHEDULERS_KEY", "batch_norm_base",
           "compiled_inner", "default_store", "inner_schedulers", "innermost_store", "module_buffers", "norm_base",
           "sparse_values", "tensor_version"]

_VERIFIED = "torch 2.8.0, 2.13.0, 2.14.1, 2.15.0"
_MAX_STORE_LAYERS = 8  # a group's store is PrefixStore(<group>, PrefixStore("default_pg", <the store>))

# ------------------------------------------------------------------------------------------- distributed


def default_store() -> Any:
    """The default group's c10d store, or None (no group, or a torch without the private getter)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:  # no default group, or the group has no store
        return None


def innermost_store(store: Any) -> Any:
    """The store under every ``PrefixStore`` layer of ``store`` (``PrefixStore.underlying_store``)."""
    for _ in range(_MAX_STORE_LAYERS):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return store


# ------------------------------------------------------------------------------------- modules and tensors


def sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor's values without coalescing (``Tensor._values``; ``.values()`` requires coalesced)."""
    return grad._values()


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (``Tensor._version``)."""
    return int(t._version)


def module_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A module's own buffer dict, assignable in place (``Module._buffers``)."""
    return module._buffers


def compiled_inner(model: Any) -> Any:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), or None for anything else."""
    if type(model).__name__ != "OptimizedModule":
        return None
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


# The segment torch.compile's wrapper adds to state-dict keys (its attribute holding the wrapped module).
COMPILED_KEY_SEGMENT = "_orig_mod"


# The state-dict key (and attribute) under which SequentialLR and ChainedScheduler keep their inner schedulers.
SCHEDULERS_KEY = "_schedulers"


def inner_schedulers(scheduler: Any) -> list[Any] | None:
    """The schedulers a ``SequentialLR``/``ChainedScheduler`` chains (``._schedulers``), or None for any other."""
    inner = getattr(scheduler, SCHEDULERS_KEY, None)
    return inner if isinstance(inner, list) else None


def _probe_inner_schedulers() -> Any:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    chained = torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.StepLR(opt, 1)])
    return (inner_schedulers(chained) is not None and SCHEDULERS_KEY in chained.state_dict()) or None


def _probe_state_dict_metadata() -> Any:
    return hasattr(torch.nn.Linear(1, 1).state_dict(), STATE_DICT_METADATA) or None


def norm_base() -> type:
    """The base of every BatchNorm and InstanceNorm module (``torch.nn.modules.batchnorm._NormBase``)."""
    return torch.nn.modules.batchnorm._NormBase


def batch_norm_base() -> type:
    """The base of the BatchNorm modules, SyncBatchNorm and the lazy ones (``_BatchNorm``)."""
    return torch.nn.modules.batchnorm._BatchNorm


# A module's state dict carries its per-module versions in this attribute (read by load_state_dict).
STATE_DICT_METADATA = "_metadata"

# ------------------------------------------------------------------------------------------------ registry


def _attr(obj: Any, name: str) -> Any:
    return getattr(obj, name, None)


def _probe_compiled() -> Any:
    # torch.compile() itself may start compile workers (torch 2.8 does): read the wrapper's __init__ instead
    from torch._dynamo.eval_frame import OptimizedModule

    return "_orig_mod" in OptimizedModule.__init__.__code__.co_names or None


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("torch.distributed.distributed_c10d._get_default_store", "torch",
               "naming the ranks that did not arrive at a barrier, and counting restart attempts in the job's "
               "store; without it those messages name fewer ranks", _VERIFIED,
               lambda: _attr(dist.distributed_c10d, "_get_default_store")),
    PrivateAPI("torch.distributed.PrefixStore.underlying_store", "torch",
               "reaching the TCPStore under a group's PrefixStore layers (the watchdog's own connection, the attempt "
               "counter)", _VERIFIED, lambda: _attr(dist.PrefixStore, "underlying_store")),
    PrivateAPI("torch.Tensor._values", "torch", "reading a sparse gradient's values without coalescing",
               _VERIFIED, lambda: _attr(torch.Tensor, "_values"), public="Tensor.values() (needs coalesced)"),
    PrivateAPI("torch.Tensor._version", "torch", "FSDP's meta-device init tells an integer tensor no init wrote",
               _VERIFIED, lambda: _attr(torch.Tensor, "_version")),
    PrivateAPI("torch.nn.Module._buffers", "torch", "moving buffers an init re-created to the compute device",
               _VERIFIED, lambda: _attr(torch.nn.Linear(1, 1), "_buffers")),
    PrivateAPI("torch._dynamo.eval_frame.OptimizedModule._orig_mod", "torch",
               "unwrapping torch.compile's wrapper to find DDP/FSDP inside it", _VERIFIED, _probe_compiled),
    PrivateAPI("torch.nn.modules.batchnorm._NormBase", "torch",
               "the step guard restores norm statistics after a skipped step", _VERIFIED, norm_base),
    PrivateAPI("torch.nn.modules.batchnorm._BatchNorm", "torch",
               "SyncBatchNorm conversion and FSDP's norm handling find every BatchNorm", _VERIFIED, batch_norm_base),
    PrivateAPI("torch.optim.lr_scheduler.SequentialLR/ChainedScheduler._schedulers (and its state-dict key)",
               "torch", "checking a checkpoint's chained-scheduler state against the live inner schedulers before it "
               "is restored (untrusted checkpoints)", _VERIFIED, _probe_inner_schedulers),
    PrivateAPI("the state dict's _metadata attribute (Module.state_dict())", "torch",
               "model_state_dict keeps the per-module version metadata when it strips wrapper prefixes", _VERIFIED,
               _probe_state_dict_metadata),
)
