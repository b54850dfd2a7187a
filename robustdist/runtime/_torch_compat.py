"""Every private torch name robustdist uses, fenced here (and nowhere else: ``tests/test_private_api.py``), but
torchelastic's agent's, which ``robustdist run`` alone uses (``_elastic_compat``), and the DataLoader's
(``_data_compat``).

Each access is one small function or class below, listed in :data:`PRIVATE_APIS` with the torch versions the
version matrix ran it on (``docs/status.md``) and, where torch has one in the supported range, the public
replacement. ``tests/runtime/test_private_api_canaries.py`` resolves every entry on the installed torch and
fails naming the API and the version when a release moves it.

Where a private name is absent, the function says so and the caller degrades (a less specific message, a
slower path, a check skipped with a log line); none of them raises a raw error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.private_api import PrivateAPI

__all__ = ["PRIVATE_APIS", "DCP_PICKLED_PRIVATE", "STATE_DICT_METADATA", "COMPILED_KEY_SEGMENT", "SCHEDULERS_KEY",
           "inner_schedulers", "scaler_unscaled", "batch_norm_base", "compiled_inner",
           "dcp_storage_info_type", "default_store", "has_python_state", "has_storage", "innermost_store",
           "non_finite_check_and_unscale_", "norm_base", "reader_checking_slices",
           "sparse_values", "tensor_version", "torch_save_code", "module_buffers"]

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


# -------------------------------------------------------------------------------------------- tensors


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has a storage (``torch._C._has_storage``); True where torch lacks the probe."""
    probe = getattr(torch._C, "_has_storage", None)
    return True if probe is None else bool(probe(t))


def has_python_state(t: torch.Tensor) -> bool:
    """Whether ``t`` carries Python attributes that a pickle would keep (``torch._utils._get_obj_state``);
    conservatively True where torch lacks the helper."""
    getter = getattr(torch._utils, "_get_obj_state", None)
    return True if getter is None else bool(getter(t))


@functools.cache
def torch_save_code() -> frozenset[Any]:
    """The code objects of ``torch.save``'s pickling functions (``torch.serialization._save``,
    ``_legacy_save``): a reducer called from them must leave torch's own format alone."""
    import torch.serialization as ser

    return frozenset(f.__code__ for f in (getattr(ser, "_save", None), getattr(ser, "_legacy_save", None))
                     if f is not None)


def save_without_record_crcs(obj: Any, buffer: Any) -> None:
    """``torch.save(obj, buffer)`` without the CRC-32 of each zip record (most of the save's time for large tensors),
    for a caller that checksums the whole buffer itself. torch's reader does not check them (a file saved with
    ``torch.utils.serialization.config.save.compute_crc32 = False`` loads); that global setting is not touched: the
    writer is made here. Where this torch's writer or ``_save`` differ, plain ``torch.save``."""
    import pickle

    import torch.serialization as ser

    align = getattr(ser, "_get_storage_alignment", None)
    try:
        writer = torch._C.PyTorchFileWriter(buffer, False, align()) if align is not None and _save_args() else None
    except TypeError:  # another constructor
        writer = None
    if writer is None:
        torch.save(obj, buffer)
        return
    ser._save(obj, writer, pickle, ser.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    buffer.flush()


@functools.cache
def _save_args() -> bool:
    """Whether ``torch.serialization._save`` takes ``(obj, zip_file, pickle_module, pickle_protocol,
    _disable_byteorder_record)``, as torch 2.13's does (any other: plain torch.save)."""
    import inspect

    import torch.serialization as ser

    try:
        names = list(inspect.signature(ser._save).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return names == ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> bool:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler's fused check); False where this torch
    has no such op, so the caller takes its slower public path."""
    op = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if op is None:
        return False
    op(grads, found, inv_scale)
    return True


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

# -------------------------------------------------------------------------------------------------- DCP

# The private classes and functions DCP's metadata pickles (read off torch 2.13's FileSystemWriter output).
DCP_PICKLED_PRIVATE = frozenset({("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                 ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                                 ("torch.serialization", "_get_layout")})


def dcp_storage_info_type() -> type:
    from torch.distributed.checkpoint import filesystem

    return filesystem._StorageInfo


def reader_checking_slices(base: type, check: Callable[[Any, Any, Any], None]) -> type:
    """A subclass of DCP's ``FileSystemReader`` ``base`` that calls ``check(reader, file, storage_info)`` on every
    slice of a data file before DCP reads it (``FileSystemReader._slice_file``)."""

    if getattr(base, "_slice_file", None) is None:
        raise CheckpointError(
            f"this torch ({torch.__version__}) has no FileSystemReader._slice_file, where robustdist checks each "
            "slice of a sharded data file before DCP unpickles it; refused rather than loading unchecked. Fix: use "
            "a torch the version matrix tested (robustdist doctor lists them).")

    class CheckingReader(base):  # type: ignore[misc, valid-type]
        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            check(self, file, sinfo)
            return super()._slice_file(file, sinfo)

    return CheckingReader


# ----------------------------------------------------------------------------------------------- registry


def _attr(obj: Any, name: str) -> Any:
    return getattr(obj, name, None)


REBUILD_HOOKS_AT: dict[str, int] = {
    "torch._utils _rebuild_tensor_v2": 5, "torch._utils _rebuild_tensor_v3": 5, "torch._utils _rebuild_qtensor": 6,
    "torch._utils _rebuild_parameter": 2, "torch._utils _rebuild_parameter_with_state": 2,
}
"""The calls torch.save writes to rebuild a tensor that take its backward hooks (pickle's ``module name``), and the
argument's position: torch.save always writes an empty ``OrderedDict()`` there."""


FROM_TYPE = "torch._tensor _rebuild_from_type_v2"
"""``_rebuild_from_type_v2(func, new_type, args, state)``: calls ``func(*args)`` (a rebuild function), for a tensor
with Python attributes or of a subclass."""
COPYING_REBUILDS = frozenset({"torch._utils _rebuild_device_tensor_from_cpu_tensor",
                              "torch._utils _rebuild_device_tensor_from_numpy"})
"""Rebuild calls that copy their data into a new tensor (``data.to(dtype)``): an expanded view of one byte passed to
one becomes gigabytes. torch.save writes them only for tensors of devices with no storage (XLA and the like)."""


STATEFUL_REBUILDS = frozenset({"torch._utils _rebuild_parameter_with_state", FROM_TYPE})
"""Rebuild calls that set a tensor's Python attributes from a state dict, one by one (``_backward_hooks`` and
``grad`` included): torch.save writes them only for a parameter or tensor with attributes, or a subclass."""


@functools.lru_cache(maxsize=1)
def tensor_classes() -> frozenset[str]:
    """torch's legacy tensor classes (``torch DoubleTensor``, ...) as a pickle names them: the weights-only unpickler
    lets a pickle call one, and ``DoubleTensor(2**26)`` is 512 MiB from a few bytes."""
    return frozenset(f"{c.__module__} {c.__name__}" for c in getattr(torch, "_tensor_classes", ()))


def makes_tensor(callable_: str) -> bool:
    """Whether a pickle's callable (``module name``) is one of torch's tensor rebuild functions."""
    return callable_.startswith("torch._utils ") or callable_ == FROM_TYPE


def canonical_global(arg: str) -> str:
    """A GLOBAL's ``module name`` as torch's weights-only unpickler resolves it: Python 2 names (``__builtin__``,
    ``copy_reg``, ...) are mapped through torch's own tables first, so ``__builtin__ bytearray`` is
    ``builtins bytearray``."""
    module, _, name = arg.partition(" ")
    mapped = torch._utils.NAME_MAPPING.get((module, name))
    if mapped is not None:
        module, name = mapped
    else:
        module = torch._utils.IMPORT_MAPPING.get(module, module)
    return f"{module} {name}"


def _probe_rebuild_hooks() -> Any:
    import inspect

    for name, at in REBUILD_HOOKS_AT.items():
        params = list(inspect.signature(getattr(torch._utils, name.split()[1])).parameters)
        if params[at] != "backward_hooks":
            return None
    return True


def _probe_dcp_slice() -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return _attr(FileSystemReader, "_slice_file")


def _probe_compiled() -> Any:
    # torch.compile() itself may start compile workers (torch 2.8 does): read the wrapper's __init__ instead
    from torch._dynamo.eval_frame import OptimizedModule

    return "_orig_mod" in OptimizedModule.__init__.__code__.co_names or None


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("torch._tensor_classes", "torch",
               "the opcode scan refuses a payload calling a legacy tensor class (DoubleTensor(2**26): 512 MiB from a "
               "few bytes); without it those calls are charged as plain objects", _VERIFIED,
               lambda: _attr(torch, "_tensor_classes") or None),
    PrivateAPI("torch._utils.IMPORT_MAPPING, NAME_MAPPING", "torch",
               "the opcode scan reads a pickle's globals as torch's weights-only unpickler maps them (__builtin__ "
               "is builtins), so an old spelling cannot pass a refused call", _VERIFIED,
               lambda: (_attr(torch._utils, "IMPORT_MAPPING") is not None
                        and _attr(torch._utils, "NAME_MAPPING") is not None) or None),
    PrivateAPI("torch._utils._rebuild_tensor_v2/_v3, _rebuild_qtensor, _rebuild_parameter(_with_state), "
               "_rebuild_device_tensor_from_cpu_tensor/_numpy, torch._tensor._rebuild_from_type_v2", "torch",
               "the opcode scan before loading a checkpoint charges what each tensor a pickle rebuilds costs and "
               "requires its backward hooks to be the empty OrderedDict torch.save writes; a renamed function is "
               "charged as a plain object", _VERIFIED, _probe_rebuild_hooks),
    PrivateAPI("torch.distributed.distributed_c10d._get_default_store", "torch",
               "naming the ranks that did not arrive at a barrier, and counting restart attempts in the job's "
               "store; without it those messages name fewer ranks", _VERIFIED,
               lambda: _attr(dist.distributed_c10d, "_get_default_store")),
    PrivateAPI("torch.distributed.PrefixStore.underlying_store", "torch",
               "reaching the TCPStore under a group's PrefixStore layers (the watchdog's own connection, the attempt "
               "counter)", _VERIFIED, lambda: _attr(dist.PrefixStore, "underlying_store")),
    PrivateAPI("torch._C._has_storage", "torch", "the bf16 pickling patch skips tensors with no storage",
               _VERIFIED, lambda: _attr(torch._C, "_has_storage")),
    PrivateAPI("torch._utils._get_obj_state", "torch",
               "the bf16 pickling patch leaves tensors with Python attributes to torch", _VERIFIED,
               lambda: _attr(torch._utils, "_get_obj_state")),
    PrivateAPI("torch.serialization._save", "torch",
               "the bf16 pickling patch leaves torch.save's own format untouched", _VERIFIED,
               lambda: _attr(torch.serialization, "_save")),
    PrivateAPI("torch._C.PyTorchFileWriter(buffer, compute_crc32, alignment), torch.serialization._save/"
               "_get_storage_alignment", "torch",
               "the in-memory checkpoint tier serialises without the zip records' CRC-32s (it checksums each blob); "
               "without them torch.save computes them", _VERIFIED,
               lambda: _attr(torch.serialization, "_get_storage_alignment") and _attr(torch.serialization, "_save")),
    PrivateAPI("torch._amp_foreach_non_finite_check_and_unscale_", "torch",
               "the step guard's fused finite check; without it a slower per-dtype sum is used", _VERIFIED,
               lambda: _attr(torch, "_amp_foreach_non_finite_check_and_unscale_")),
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
    PrivateAPI("torch.amp.GradScaler._per_optimizer_states[id(optimizer)]['stage']", "torch",
               "the step guard's skip/rollback records the bad step with the scaler only if the loop did not call "
               "unscale_ already; without it, unscale_'s own refusal (a RuntimeError) is taken as the answer",
               _VERIFIED, _probe_scaler_stage),
    PrivateAPI("torch.optim.lr_scheduler.SequentialLR/ChainedScheduler._schedulers (and its state-dict key)",
               "torch", "checking a checkpoint's chained-scheduler state against the live inner schedulers before it "
               "is restored (untrusted checkpoints)", _VERIFIED, _probe_inner_schedulers),
    PrivateAPI("the state dict's _metadata attribute (Module.state_dict())", "torch",
               "model_state_dict keeps the per-module version metadata when it strips wrapper prefixes", _VERIFIED,
               _probe_state_dict_metadata),
    PrivateAPI("torch.distributed.checkpoint.filesystem._StorageInfo", "torch",
               "validating DCP metadata before DCP reads it (untrusted checkpoints)", _VERIFIED,
               dcp_storage_info_type),
    PrivateAPI("torch.distributed.checkpoint.FileSystemReader._slice_file", "torch",
               "checking every slice of a sharded data file before DCP unpickles it (untrusted checkpoints)",
               _VERIFIED, _probe_dcp_slice),
)
