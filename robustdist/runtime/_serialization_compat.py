"""The private torch names of serialisation, fenced (``tests/test_private_api.py``): what a pickle of tensors is
made of (torch's rebuild functions and their arguments, legacy tensor classes, torch.save's own writer), which
the opcode scan and the bf16 pickling patch read, and DCP's metadata and reader internals, which the sharded
checkpoint's checks read. Each is listed in :data:`PRIVATE_APIS`, with the torch versions it was verified on; the
canaries (``tests/runtime/test_private_api_canaries.py``) resolve every entry on the installed torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from robustdist.runtime._torch_compat import _VERIFIED, _attr
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.private_api import PrivateAPI

__all__ = ["COPYING_REBUILDS", "DCP_PICKLED_PRIVATE", "FROM_TYPE", "PRIVATE_APIS", "REBUILD_HOOKS_AT",
           "STATEFUL_REBUILDS", "canonical_global", "dcp_storage_info_type", "has_python_state", "has_storage",
           "makes_tensor", "reader_checking_slices", "save_without_record_crcs", "tensor_classes", "torch_save_code"]

# ----------------------------------------------------------------------------------------- tensors in a pickle


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


# -------------------------------------------------------------------------------------------------------- DCP
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


def _probe_dcp_slice() -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return _attr(FileSystemReader, "_slice_file")


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
    PrivateAPI("torch.distributed.checkpoint.filesystem._StorageInfo", "torch",
               "validating DCP metadata before DCP reads it (untrusted checkpoints)", _VERIFIED,
               dcp_storage_info_type),
    PrivateAPI("torch.distributed.checkpoint.FileSystemReader._slice_file", "torch",
               "checking every slice of a sharded data file before DCP unpickles it (untrusted checkpoints)",
               _VERIFIED, _probe_dcp_slice),
)
