"""``AtomicCheckpointer.load``: agree on a valid step across ranks, verify before deserialising, restore."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from robustdist.checkpoint import _layout, _payload
from robustdist.checkpoint._sharded import load_sharded
from robustdist.errors import CheckpointCorruptError, CheckpointError
from robustdist.log import warn


def _is_ray_checkpoint(obj: Any) -> bool:
    return type(obj).__name__ == "Checkpoint" and hasattr(obj, "as_directory")


@contextlib.contextmanager
def _source(ckpt: Any, step: Any) -> Iterator[tuple[str | None, list[int]]]:
    """``(explicit step dir or None, candidate steps newest first)``, agreed by every rank."""
    if _is_ray_checkpoint(step):
        with step.as_directory() as path:
            manifest_step = _layout.read_manifest(path)["step"]
            yield path, [int(manifest_step)]
        return
    if step is not None:
        yield None, [int(step)]
        return
    candidates = [list(reversed(_layout.step_dirs(ckpt.directory)))]
    if ckpt.distributed:
        dist.broadcast_object_list(candidates, src=0, group=ckpt.group)
    yield None, candidates[0]


def _problem(step_dir: str, rank: int) -> str | None:
    try:
        manifest = _layout.read_manifest(step_dir)
        _layout.verify(step_dir, manifest, _layout.files_for_rank(manifest, rank))
    except CheckpointCorruptError as e:
        return str(e)
    return None


def _agree(ckpt: Any, problem: str | None) -> dict[int, str]:
    if not ckpt.distributed:
        return {0: problem} if problem else {}
    everyone: list[Any] = [None] * ckpt.world_size
    dist.all_gather_object(everyone, problem, group=ckpt.group)
    return {r: p for r, p in enumerate(everyone) if p}


def torch_load(path: str, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
        raise CheckpointError(
            f"{path}: refused to load: {str(e).splitlines()[0]}. torch.load(weights_only=True) found objects robustdist "
            "never writes (a pickle that could run code); nothing was executed. Fix: load only checkpoints you trust.",
        ) from e


def load_checkpoint(ckpt: Any, step: Any, state: dict[str, Any] | None, map_location: Any) -> Any:
    from robustdist.checkpoint.checkpointer import LoadedCheckpoint

    with _source(ckpt, step) as (explicit, candidates):
        chosen, step_dir = None, None
        for candidate in candidates:
            step_dir = explicit or os.path.join(ckpt.directory, _layout.step_dirname(candidate))
            bad = _agree(ckpt, _problem(step_dir, ckpt.rank))
            if not bad:
                chosen = candidate
                break
            reason = "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items()))
            if step is not None:
                raise CheckpointCorruptError(f"checkpoint step {candidate} failed verification ({reason}); expected "
                                             "intact files. Fix: load another step (steps() lists them).",
                                             rank=ckpt.err_rank, ranks=sorted(bad))
            warn(f"checkpoint step {candidate} failed verification ({reason}); falling back to the previous "
                 "committed checkpoint.", stacklevel=4)
        if chosen is None:
            raise CheckpointCorruptError(
                f"no valid checkpoint in {ckpt.directory} (tried steps {candidates}); expected at least one committed "
                "checkpoint whose files match its manifest. Fix: check the directory, or start from scratch.",
                rank=ckpt.err_rank)
        return _read(ckpt, chosen, step_dir, state, map_location, LoadedCheckpoint)


def _read(ckpt: Any, step: int, step_dir: str, state: dict[str, Any] | None, map_location: Any, result: Any) -> Any:
    manifest = _layout.read_manifest(step_dir)
    files = manifest["files"]
    replicated = torch_load(os.path.join(step_dir, _layout.REPLICATED), map_location) if _layout.REPLICATED in files \
        else {}
    own = _layout.rank_file(ckpt.rank)
    mine = torch_load(os.path.join(step_dir, own), map_location) if own in files else None
    kinds: dict[str, str] = manifest.get("entries", {})
    if state:
        sharded = {}
        for name, live in state.items():
            kind = kinds.get(name)
            if kind is None:
                raise CheckpointError(f"state[{name!r}] is not in checkpoint step {step} (it holds "
                                      f"{sorted(kinds)}); expected the same entries as when saving. Fix: drop it or "
                                      "load a checkpoint that has it.", rank=ckpt.err_rank)
            if kind == "sharded":
                sharded[name] = live
            else:
                _payload.restore_entry(name, live, replicated[name], kind)
        if sharded:
            load_sharded(sharded, os.path.join(step_dir, _layout.SHARDED_DIR), ckpt.group)
        if mine is not None:
            _payload.restore_rng(mine["rng"])
        else:
            warn(f"rank {ckpt.rank} has no saved RNG state in checkpoint step {step} (saved by {manifest['world_size']} "
                 f"rank(s), loaded by {ckpt.world_size}); its RNGs are reseeded deterministically from (step, rank).",
                 stacklevel=5)
            _payload.reseed(step, ckpt.rank)
    return result(step=step, path=step_dir, state=replicated, per_rank=(mine or {}).get("per_rank", {}),
                  metadata=manifest.get("metadata", {}), manifest=manifest)
