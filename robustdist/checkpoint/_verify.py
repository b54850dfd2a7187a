"""``verify_all``: the verdict ``load()`` would give each committed step, short of restoring into live objects.

``robustdist verify-checkpoint`` and :func:`verify_all` run, for every step, the checks a load runs before it
touches a live object: the manifest, every file's size and CRC-32, each torch file's zip structure and pickle
scan, the ``weights_only`` load itself, the payload schema (entries, RNG states that a generator accepts,
expanded tensor views in plain data and in object state), and for a sharded step the DCP metadata and every
slice of every data file (each a torch zip, each non-tensor item loaded ``weights_only``). A step is "corrupt"
exactly where a load would fall back past it, with the reason the load gives; "another torch" where a load stops
at it, naming the torch that wrote it (:class:`~robustdist.runtime.errors.CheckpointVersionError`). What only a live
object can decide (a model of another shape, a scheduler key the live one lacks) is not corruption and is not
checked.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any

import torch

from robustdist.checkpoint import _layout, _live, _schema
from robustdist.checkpoint._layout import DCP_METADATA, REPLICATED, SHARDED_DIR
from robustdist.checkpoint._loading import dcp_metadata_of, torch_load
from robustdist.checkpoint._safeio import check_torch_zip, open_in
from robustdist.checkpoint._schema import weights_only_reason
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, CheckpointVersionError

__all__ = ["verify_all", "verify_step"]

_RANK_FILE = re.compile(r"rank_\d{5,}\.pt")


def verify_all(directory: str) -> list[dict[str, Any]]:
    """One row per step directory: step, files, bytes, status ("ok", "corrupt", "another torch") and reason."""
    rows = []
    for step, name in _layout.step_dirs(directory).items():
        try:
            manifest = verify_step(os.path.join(directory, name), step)
        except (CheckpointError, OSError, MemoryError, RecursionError) as e:
            reason = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {str(e)[:300]}"
            status = "another torch" if isinstance(e, CheckpointVersionError) else "corrupt"
            rows.append({"step": step, "files": None, "bytes": None, "status": status, "reason": reason})
            continue
        files = manifest["files"]
        rows.append({"step": step, "files": len(files), "bytes": sum(f["size"] for f in files.values()),
                     "status": "ok", "reason": ""})
    return rows


def verify_step(step_dir: str, step: int | None = None) -> dict[str, Any]:
    """Every check of a load short of the live objects (module docstring); the manifest, or
    :class:`CheckpointCorruptError` naming the file and the problem."""
    manifest = _layout.read_manifest(step_dir, step)
    files: dict[str, Any] = manifest["files"]
    _layout.verify(step_dir, manifest, files)
    kinds: dict[str, str] = manifest.get("entries", {})
    for name in sorted(files):
        if name != REPLICATED and not _RANK_FILE.fullmatch(name):
            continue
        path = os.path.join(step_dir, name)
        payload = torch_load(step_dir, name, manifest, "cpu")
        _schema.check_size(path, payload, _schema.MAX_PAYLOAD_VALUES)
        if name == REPLICATED:
            _schema.check_replicated(path, payload, kinds)
            for entry, kind in kinds.items():
                if kind == "stateful":
                    _refuse_state_views(path, entry, payload[entry])
                elif kind == "module":
                    _refuse_module_tensors(path, entry, payload[entry])
        else:
            _schema.check_rank_payload(path, payload)
            for entry, value in payload["per_rank"].items():
                _refuse_state_views(path, f"per_rank {entry}", value)
    if DCP_METADATA in files:
        _verify_items(step_dir, dcp_metadata_of(step_dir, manifest))
    return manifest


def _refuse_state_views(path: str, entry: str, value: Any) -> None:
    """What load refuses in an object's state whatever the live object: an expanded view anywhere (casting or
    copying it would materialise it); and in an optimizer's per-parameter state, any tensor that is not dense
    (a quantized, nested, sparse or meta tensor), as the live optimizer check does."""
    found = _schema.expanded_view(value)
    if found is not None:
        where, t = found
        raise CheckpointCorruptError(f"{path}: entry {entry!r}{where} holds an expanded tensor view (shape "
                                     f"{tuple(t.shape)[:8]}, strides {t.stride()[:8]}); expected densely stored state")
    if not (isinstance(value, dict) and isinstance(value.get("state"), dict) and "param_groups" in value):
        return
    stack: list[tuple[str, Any]] = [("['state']", value["state"])]
    while stack:
        where, item = stack.pop()
        if isinstance(item, torch.Tensor):
            problem = _live.tensor_problem(item, "optimizer state")
            if problem:
                raise CheckpointCorruptError(f"{path}: entry {entry!r}{where} {problem}")
        elif isinstance(item, dict):
            stack.extend((f"{where}[{k!r:.40}]", v) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))


def _refuse_module_tensors(path: str, entry: str, state: dict[str, Any]) -> None:
    """What ``load_model_state_dict``'s checks refuse for any ordinary (dense) live module: a meta, nested or
    non-strided (sparse) saved tensor. (A quantized one fits a quantized live module only: a live check.)"""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and (t.is_nested or t.device.type == "meta" or t.layout != torch.strided):
            raise CheckpointCorruptError(f"{path}: entry {entry!r} holds the tensor {name!r:.80}, a {t.layout} "
                                         f"{t.device.type}{' nested' if t.is_nested else ''} tensor; a module's "
                                         "state loads only dense tensors")


def _verify_items(step_dir: str, metadata: Any) -> None:
    """What robustdist's DCP reader and planner check for each item as they load it: every slice a torch zip
    (scanned), every non-tensor item a ``weights_only`` load."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in metadata.storage_data.items():
        rel = f"{SHARDED_DIR}/{info.relative_path}"
        where = f"{os.path.join(step_dir, rel)} at byte {info.offset}"
        with open_in(step_dir, rel) as fh:
            check_torch_zip(fh, where, offset=info.offset, length=info.length)
            if type(metadata.state_dict_metadata.get(index.fqn)) is not BytesStorageMetadata:
                continue
            fh.seek(info.offset)
            data = fh.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(
                f"the sharded item {index.fqn!r} holds objects robustdist never writes ({weights_only_reason(e)}); "
                "load refuses it, nothing was executed") from None
