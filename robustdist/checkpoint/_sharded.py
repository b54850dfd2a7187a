"""Sharded (FSDP2 / DTensor) entries go through ``torch.distributed.checkpoint`` (DCP), never hand-rolled.

DCP writes ``__<rank>_<n>.distcp`` per rank and a ``.metadata`` file (rank 0) into ``<staging>/sharded/``;
each rank hashes the files it wrote, so they are covered by the manifest like every other file. On load,
DCP reshards to whatever the live objects look like (another world size, or an unsharded model).

DCP reads ``.metadata`` with plain ``pickle``; before handing it to DCP, robustdist unpickles it with an
allow-list of DCP's own metadata classes and plain types, so a tampered file cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any

import torch
from torch import nn

from robustdist.checkpoint._io import checksum_entry
from robustdist.errors import CheckpointError

# Exactly what DCP's metadata pickles (read off torch 2.13's FileSystemWriter output): its metadata dataclasses,
# storage info, tensor sizes, dtypes/layouts/memory formats, and the checkpoint path.
_SAFE_CLASSES_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                 ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == _SAFE_CLASSES_MODULE and isinstance(obj := super().find_class(module, name), type):
            return obj
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def check_metadata(path: str) -> None:
    try:
        with open(path, "rb") as fh:
            _MetadataUnpickler(io.BytesIO(fh.read())).load()
    except Exception as e:
        raise CheckpointError(f"{path}: refused to load: it holds {e}; expected only DCP metadata. A pickle that "
                              "could run code is never loaded. Fix: load only checkpoints you trust.") from e


def _optimizer_pair(entries: dict[str, Any], value: Any) -> nn.Module:
    modules = [v for v in entries.values() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise CheckpointError(
            f"a sharded optimizer needs exactly one sharded module beside it in the checkpoint state, found "
            f"{len(modules)}; expected one. Fix: save each sharded model and its optimizer in separate checkpoints.")
    return modules[0]


def _state_dicts(entries: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {}
    for name, value in entries.items():
        if isinstance(value, nn.Module):
            out[name] = value.state_dict()
        elif isinstance(value, torch.optim.Optimizer):
            out[name] = get_optimizer_state_dict(_optimizer_pair(entries, value), value)
        else:
            out[name] = value
    return out


def save_sharded(entries: dict[str, Any], path: str, group: Any) -> dict[str, Any]:
    """Write ``entries`` with DCP into ``path``; return this rank's files (``sharded/<name>``) with size/sha."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    dcp.save(_state_dicts(entries), storage_writer=dcp.FileSystemWriter(path), process_group=group,
             no_dist=not dist.is_initialized())
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = [f for f in os.listdir(path) if f.startswith(f"__{rank}_") or (rank == 0 and f == ".metadata")]
    files = {}
    for name in mine:
        files[f"sharded/{name}"] = checksum_entry(os.path.join(path, name))
    return files


def is_sharded_stateful(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer) and any(
        type(t).__name__ == "DTensor" for s in value.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def load_sharded(entries: dict[str, Any], path: str, group: Any) -> None:
    """Load DCP-saved entries into the live objects in ``entries`` (resharding as needed)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    check_metadata(os.path.join(path, ".metadata"))
    templates = _state_dicts(entries)
    distributed = dist.is_initialized()
    with warnings.catch_warnings():  # DCP warns that a single process "assumes" single-process loading: we mean it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(templates, storage_reader=dcp.FileSystemReader(path), process_group=group if distributed else None,
                 no_dist=not distributed)
    for name, value in entries.items():
        if isinstance(value, nn.Module):
            value.load_state_dict(templates[name])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_optimizer_pair(entries, value), value, templates[name])
