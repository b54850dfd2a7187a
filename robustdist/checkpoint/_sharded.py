"""Sharded (FSDP2 / DTensor) entries go through ``torch.distributed.checkpoint`` (DCP), never hand-rolled.

DCP writes ``__<rank>_<n>.distcp`` per rank and a ``.metadata`` file (rank 0) into ``<staging>/sharded/``;
each rank hashes the files it wrote, so they are covered by the manifest like every other file. On load,
DCP reshards to whatever the live objects look like (another world size, or an unsharded model).

Trust boundary (DCP's own reader trusts its files: it reads ``.metadata`` with plain ``pickle`` and every
non-tensor item with ``torch.load(weights_only=False)``, either of which runs code from a crafted file):

* ``.metadata`` is read once, confined and size-checked, and unpickled by :class:`_MetadataUnpickler`, which
  resolves only exact ``(module, name)`` pairs from an allow-list of DCP's metadata classes, ``torch.Size``,
  dtypes and layouts: no dotted attribute paths (``Metadata.__init__.__class__``), nothing else.
* The result is validated: every storage entry names a ``__<r>_<n>.distcp`` file the manifest lists (so
  verified by checksum), with an offset and length inside it, and no stream transforms.
* The reader hands DCP that validated metadata and opens data files only through
  :func:`robustdist.checkpoint._safeio.open_in` (confined, regular files, no links).
* The planner loads non-tensor items with ``torch.load(weights_only=True)``; tensors are loaded by DCP
  with ``weights_only=True`` already.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import re
import warnings
from typing import Any

import torch
from torch import nn

from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._io import checksum_entry
from robustdist.checkpoint._pickle_scan import scan
from robustdist.checkpoint._safeio import check_torch_zip, open_in, read_in
from robustdist.checkpoint._schema import (
    DCP_METADATA,
    MAX_DCP_METADATA_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PICKLE_TREE,
    SHARDED_DIR,
    is_int,
    weights_only_reason,
)
from robustdist.runtime import _serialization_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError

_DCP_META = "torch.distributed.checkpoint.metadata"
# Exactly what DCP's metadata pickles (read off torch 2.13's FileSystemWriter output).
_SAFE_GLOBALS = frozenset({
    *((_DCP_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                               "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata")),
    *_serialization_compat.DCP_PICKLED_PRIVATE, ("torch", "Size"), ("collections", "OrderedDict"),
})
# DCP records the checkpoint path (storage_meta.checkpoint_id) as a PosixPath; it is read back as a bounded str
# (pathlib splits every argument eagerly: one long memoised string passed many times is a memory bomb)
_PATH_GLOBALS = frozenset({("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
                           ("pathlib._local", "PurePosixPath")})


_MAX_PATHS = 4  # DCP writes one (storage_meta.checkpoint_id)


def _path_standin(*parts: Any) -> str:
    if len(parts) > 256 or not all(isinstance(p, str) for p in parts) or sum(map(len, parts)) > 4096:
        raise pickle.UnpicklingError("a path in DCP metadata is not a short list of strings")
    return "/".join(parts)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


class _MetadataUnpickler(pickle.Unpickler):
    paths = 0

    def _path(self, *parts: Any) -> str:
        # each call makes a string of up to 4 KiB from a few bytes of pickle (REDUCE on memoised parts): counted
        self.paths += 1
        if self.paths > _MAX_PATHS:
            raise pickle.UnpicklingError(f"DCP metadata holds more than {_MAX_PATHS} paths; DCP writes one")
        return _path_standin(*parts)

    @staticmethod
    def _ordered_dict(*args: Any, **kwargs: Any) -> Any:
        # DCP's pickle calls OrderedDict() and then adds the items; called with a memoised dict, each call of a few
        # bytes would copy all of it
        if args or kwargs:
            raise pickle.UnpicklingError("collections.OrderedDict is called with arguments (a copy of them); DCP "
                                         "calls it with none")
        return collections.OrderedDict()

    def find_class(self, module: str, name: str) -> Any:
        if not _NAME.fullmatch(name):  # a dotted path reaches attributes of attributes: never
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        if (module, name) == ("collections", "OrderedDict"):
            return self._ordered_dict
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in _PATH_GLOBALS:
            return self._path
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def _refused(path: str, e: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: refused to load: it holds {str(e)[:300]}; expected only DCP metadata. "
                                  "A pickle that could run code is never loaded. Fix: load only checkpoints you trust.")


def unpickle_metadata(data: bytes, path: str) -> Any:
    """Unpickle DCP metadata bytes with the allow-list; CheckpointCorruptError for anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    scan(data, path, MAX_PICKLE_TREE)  # bounded cost before any object is built; no sets
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # UnpicklingError, and whatever a crafted stream makes the allowed classes raise
        raise _refused(path, e) from e
    if type(metadata) is not Metadata:
        raise CheckpointCorruptError(f"{path}: holds a {type(metadata).__name__}; expected DCP Metadata")
    return metadata


def _check_storage(path: str, metadata: Any, files: dict[str, Any]) -> None:
    storage_info = _serialization_compat.dcp_storage_info_type()
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointCorruptError(f"{path}: storage_data or state_dict_metadata is not a dict")
    for info in storage.values():
        if type(info) is not storage_info:
            raise CheckpointCorruptError(f"{path}: a storage entry is a {type(info).__name__}; expected "
                                         f"{storage_info.__name__}")
        rel = info.relative_path
        entry = files.get(f"{SHARDED_DIR}/{rel}") if isinstance(rel, str) and _DATA_FILE.fullmatch(rel) else None
        if entry is None:
            raise CheckpointCorruptError(f"{path}: a storage entry points at {rel!r:.100}, which is not a data file "
                                         "the manifest lists; refused (nothing outside the checkpoint is read)")
        if not (is_int(info.offset) and is_int(info.length) and info.offset + info.length <= entry["size"]):
            raise CheckpointCorruptError(f"{path}: a storage entry reads bytes {info.offset!r:.30}+{info.length!r:.30} "
                                         f"of {rel}, which has {entry['size']}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointCorruptError(f"{path}: a storage entry asks for stream transforms "
                                         f"{info.transform_descriptors!r:.100}; robustdist writes none")


def _check_ranges(path: str, storage: dict[Any, Any]) -> None:
    """Storage entries never share bytes: every byte of a data file is read at most once."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for info in storage.values():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    for rel, ranges in by_file.items():
        ranges.sort()
        for (_, end), (start, _) in zip(ranges, ranges[1:]):
            if start < end:
                raise CheckpointCorruptError(f"{path}: two storage entries overlap in {rel} (bytes {start}..{end}); "
                                             "expected each byte read once")


def _check_chunks(path: str, metadata: Any) -> int:
    """Each tensor's chunks lie inside it and add up to exactly its volume; returns how many items DCP reads."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    items = 0
    for fqn, entry in metadata.state_dict_metadata.items():
        items += 1
        if type(entry) is BytesStorageMetadata:
            continue
        size = getattr(entry, "size", None)
        if type(entry) is not TensorStorageMetadata or type(size) is not torch.Size \
                or not all(is_int(d, 0, 1 << 48) for d in size) or not isinstance(entry.chunks, list):
            raise CheckpointCorruptError(f"{path}: the entry for {fqn!r:.80} is not tensor or bytes metadata")
        volume = 0
        for chunk in entry.chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (type(offsets) is torch.Size and type(sizes) is torch.Size and len(offsets) == len(sizes) == len(size)
                    and all(is_int(o) and is_int(n) and o + n <= d for o, n, d in zip(offsets, sizes, size))):
                raise CheckpointCorruptError(f"{path}: a chunk of {fqn!r:.80} lies outside the tensor's size {tuple(size)}")
            volume += math.prod(sizes)
        if volume != math.prod(size) or len(entry.chunks) > max(1, math.prod(size)):
            raise CheckpointCorruptError(f"{path}: the chunks of {fqn!r:.80} cover {volume} elements of a tensor of "
                                         f"{math.prod(size)}; expected them to tile it exactly")
        items += len(entry.chunks) - 1
    return items


def read_metadata(step_dir: str, files: dict[str, Any]) -> Any:
    """The validated DCP metadata of a step (its file already verified against the manifest).

    Its size is bounded by the data it describes (at most 1 MiB plus half the ``.distcp`` bytes, and 64 MiB):
    metadata is a small fraction of a real checkpoint, and unpickling costs memory in proportion to it."""
    path = os.path.join(step_dir, DCP_METADATA)
    data_bytes = sum(e["size"] for name, e in files.items() if name.endswith(".distcp"))
    limit = min(MAX_DCP_METADATA_BYTES, (1 << 20) + data_bytes // 2)
    metadata = unpickle_metadata(read_in(step_dir, DCP_METADATA, max_size=limit), path)
    _check_storage(path, metadata, files)
    if len(metadata.storage_data) > _check_chunks(path, metadata):
        raise CheckpointCorruptError(f"{path}: lists more storage entries than the tensors' chunks and items")
    _check_ranges(path, metadata.storage_data)
    return metadata


def check_metadata(path: str) -> None:
    """Refuse a DCP ``.metadata`` file that holds anything but DCP's metadata (used by tests and tools)."""
    directory, name = os.path.split(path)
    unpickle_metadata(read_in(directory, name, max_size=MAX_MANIFEST_BYTES), path)


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
    import torch.distributed.checkpoint as dcp

    staging, sharded = os.path.split(path)
    # made here without following a link (the staging directory too, where this rank's node does not see rank
    # 0's: the commit then names the files rank 0 cannot see); DCP's writer then writes into it by path
    with Confined(os.path.dirname(staging)) as directory, \
            directory.sub(os.path.basename(staging), create=True) as folder:
        folder.sub(sharded, create=True).close()
    dcp.save(_state_dicts(entries), storage_writer=dcp.FileSystemWriter(path), process_group=group,
             no_dist=not _dist.is_up())
    rank = _dist.rank(group)
    mine = [f for f in os.listdir(path) if f.startswith(f"__{rank}_") or (rank == 0 and f == ".metadata")]
    files = {}
    for name in mine:
        files[f"sharded/{name}"] = checksum_entry(os.path.join(path, name))
    return files


def is_sharded_stateful(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer) and any(
        type(t).__name__ == "DTensor" for s in value.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def _first_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    return (text.strip().splitlines() or [type(e).__name__])[0][:500]


def _safe_classes() -> tuple[type, type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ConfinedFileSystem(FileSystem):
        """DCP's file access, through :func:`open_in`: reads only, confined to the step directory."""

        def __init__(self, step_dir: str):
            super().__init__()
            self.step_dir = step_dir

        def create_stream(self, path: Any, mode: str) -> Any:
            if mode != "rb":
                raise CheckpointError(f"robustdist's checkpoint reader only reads; DCP asked to open {path} as {mode!r}")
            return open_in(self.step_dir, os.path.relpath(os.fspath(path), self.step_dir))

    def check_slice(reader: Any, file: Any, sinfo: Any) -> None:
        check_torch_zip(file, f"{os.path.join(reader.path, sinfo.relative_path)} at byte {sinfo.offset}",
                        offset=sinfo.offset, length=sinfo.length)

    class SafeReader(_serialization_compat.reader_checking_slices(FileSystemReader, check_slice)):  # type: ignore[misc]
        """A FileSystemReader that returns already-validated metadata, reads through ConfinedFileSystem and checks
        every slice of a data file before DCP unpickles it."""

        def __init__(self, step_dir: str, metadata: Any):
            super().__init__(os.path.join(step_dir, SHARDED_DIR))
            self.fs = ConfinedFileSystem(step_dir)
            self._validated = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(self._validated, "storage_meta", None) is None:
                self._validated.storage_meta = StorageMeta()
            self._validated.storage_meta.load_id = self.load_id
            return self._validated

    class SafePlanner(DefaultLoadPlanner):
        """Non-tensor items load with ``weights_only=True`` (DCP's default planner unpickles them in full)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:
                raise CheckpointCorruptError(
                    f"the sharded item {read_item.dest_index.fqn!r} holds objects robustdist never writes "
                    f"({weights_only_reason(e)}); refused, nothing was executed. Fix: load only checkpoints "
                    "you trust.") from e
            plain = io.BytesIO()
            torch.save(obj, plain)  # re-serialised from weights_only types only: safe for the parent's torch.load
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return ConfinedFileSystem, SafeReader, SafePlanner


def load_sharded(entries: dict[str, Any], step_dir: str, metadata: Any, group: Any) -> None:
    """Load DCP-saved entries into the live objects in ``entries`` (resharding as needed), from validated
    ``metadata`` (:func:`read_metadata`), reading only inside ``step_dir``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    _, reader_cls, planner_cls = _safe_classes()
    templates = _state_dicts(entries)
    distributed = _dist.is_up()
    with warnings.catch_warnings():  # DCP warns that a single process "assumes" single-process loading: we mean it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp.load(templates, storage_reader=reader_cls(step_dir, metadata), planner=planner_cls(),
                     process_group=group if distributed else None, no_dist=not distributed)
        except CheckpointException as e:  # a BaseException in torch: make it an error with the cause first
            causes = "; ".join(f"rank {r}: {_first_line(exc)}" for r, (exc, _) in sorted(e.failures.items()))
            raise CheckpointCorruptError(f"{os.path.join(step_dir, SHARDED_DIR)}: DCP could not load it ({causes})") \
                from e
    for name, value in entries.items():
        if isinstance(value, nn.Module):
            value.load_state_dict(templates[name])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_optimizer_pair(entries, value), value, templates[name])
