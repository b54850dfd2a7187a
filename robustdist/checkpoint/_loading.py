"""``AtomicCheckpointer.load``: agree on a valid step across ranks, verify before deserialising, restore.

Protocol (every rank calls ``load``; after the arrival check):

1. Rank 0 lists the committed step directories, newest first, and broadcasts the list.
   **Collective: broadcast.** (Or the caller names one step, or a ``ray.train.Checkpoint``.)
2. For each candidate, every rank *checks* it without touching any live object: reads and validates the
   manifest, verifies each file it needs (size, then checksum, from the same open file it then
   deserialises), deserialises with ``torch.load(weights_only=True)``, validates what it got against the
   manifest, and reads and validates the DCP metadata of sharded entries. **Collective: all_gather** of
   the problems: a candidate any rank finds wrong is skipped on every rank, with a warning naming the rank,
   the file and the reason.
3. Every rank restores the checked payload into the live objects; sharded entries load through DCP with
   robustdist's confined reader and safe planner (**collective: DCP's own**). **Collective: all_gather** of
   the problems: a restore that failed anywhere falls back to the next candidate too (which restores every
   entry again).
4. The RNG states are restored last.

A candidate that disappears while it is read (a writer rotated it away) is not corrupt: the listing is
retried (up to three times) and then :class:`~robustdist.errors.CheckpointBusyError` says to retry.
Every other problem with the files is a :class:`~robustdist.errors.CheckpointCorruptError`, raised only
when no candidate is valid (or at once for an explicitly requested step).
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from robustdist.checkpoint import _layout, _payload, _schema
from robustdist.checkpoint._safeio import check_torch_zip
from robustdist.checkpoint._schema import weights_only_reason
from robustdist.checkpoint._sharded import load_sharded, read_metadata
from robustdist.errors import CheckpointBusyError, CheckpointCorruptError, CheckpointError
from robustdist.log import user_stacklevel, warn

_RETRIES = 3
# torch's stateful classes whose load_state_dict copies the saved dict into __dict__
_DICT_UPDATERS = (torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def is_ray_checkpoint(obj: Any) -> bool:
    return type(obj).__name__ == "Checkpoint" and hasattr(obj, "as_directory")


@dataclass
class _Checked:
    """What step 2 found for one candidate on this rank."""

    step: int
    step_dir: str
    manifest: dict[str, Any]
    replicated: dict[str, Any]
    mine: dict[str, Any] | None
    dcp_metadata: Any


def torch_load(step_dir: str, name: str, manifest: dict[str, Any], map_location: Any) -> Any:
    """Verify one file against the manifest and deserialise it from the same open file, weights only."""
    path = os.path.join(step_dir, name)
    with _layout.open_verified(step_dir, name, manifest["files"][name]) as fh:
        check_torch_zip(fh, path)
        try:
            return torch.load(fh, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            reason = weights_only_reason(e)
            if "global" in reason.lower() or "class" in reason.lower():
                raise CheckpointCorruptError(
                    f"{path}: refused to load: {reason}. torch.load(weights_only=True) found objects robustdist "
                    "never writes (a pickle that could run code); nothing was executed. Fix: load only checkpoints "
                    "you trust.") from e
            raise CheckpointCorruptError(f"{path}: not a loadable torch file ({reason})") from e
        except Exception as e:  # a checksum-valid file that is not a torch file: EOFError, RuntimeError, ...
            first = (str(e).splitlines() or [""])[0][:300]
            raise CheckpointCorruptError(f"{path}: not a loadable torch file ({type(e).__name__}: {first})") from e


@contextlib.contextmanager
def _candidates(ckpt: Any, step: Any) -> Iterator[list[tuple[int | None, str]]]:
    """``[(step or None for a Ray checkpoint, step directory)]``, newest first, the same on every rank."""
    if is_ray_checkpoint(step):
        with step.as_directory() as path:
            yield [(None, path)]
        return
    if step is not None:
        name = _layout.step_dirs(ckpt.directory).get(step, _layout.step_dirname(step))
        yield [(step, os.path.join(ckpt.directory, name))]
        return
    listed = [(s, name) for s, name in reversed(_layout.step_dirs(ckpt.directory).items())]
    listed = ckpt.collectives.broadcast(listed, "load listing")
    yield [(s, os.path.join(ckpt.directory, name)) for s, name in listed]


def _load_payload(step_dir: str, name: str, manifest: dict[str, Any], map_location: Any) -> Any:
    payload = torch_load(step_dir, name, manifest, map_location)
    _schema.check_size(os.path.join(step_dir, name), payload, _schema.MAX_VALUES + 16)
    return payload


def _check(ckpt: Any, step: int | None, step_dir: str, state: dict[str, Any], map_location: Any) -> _Checked:
    manifest = _layout.read_manifest(step_dir, step)
    kinds: dict[str, str] = manifest.get("entries", {})
    where = f"checkpoint step {manifest['step']}"
    for name in state:
        if name not in kinds:
            raise CheckpointCorruptError(f"state[{name!r}] is not in {where} (it holds {sorted(kinds)}); expected the "
                                         "same entries as when saving. Fix: drop it or load a checkpoint that has it.")
    replicated, mine, dcp_metadata = {}, None, None
    if _layout.REPLICATED in manifest["files"]:
        replicated = _schema.check_replicated(os.path.join(step_dir, _layout.REPLICATED),
                                              _load_payload(step_dir, _layout.REPLICATED, manifest, map_location), kinds)
    own = _layout.rank_file(ckpt.rank)
    if own in manifest["files"]:
        mine = _schema.check_rank_payload(os.path.join(step_dir, own),
                                          _load_payload(step_dir, own, manifest, map_location))
    if any(kinds.get(name) == "sharded" for name in state):
        _layout.verify(step_dir, manifest, [f for f in manifest["files"] if f.startswith(_layout.SHARDED_DIR + "/")])
        dcp_metadata = read_metadata(step_dir, manifest["files"])
    return _Checked(manifest["step"], step_dir, manifest, replicated, mine, dcp_metadata)


def _restore_local(checked: _Checked, state: dict[str, Any], per_rank: dict[str, Any]) -> None:
    kinds = checked.manifest.get("entries", {})
    for name, live in state.items():
        kind = kinds[name]
        if kind == "sharded":
            continue
        if kind in ("module", "stateful") and not hasattr(live, "load_state_dict"):
            raise CheckpointError(f"state[{name!r}] was saved as a {kind} but the live value is a "
                                  f"{type(live).__name__}, which has no load_state_dict")
        if kind == "data" and (isinstance(live, nn.Module) or hasattr(live, "load_state_dict")):
            raise CheckpointError(f"state[{name!r}] was saved as plain data, not as the state of a "
                                  f"{type(live).__name__}")
        where = f"{os.path.join(checked.step_dir, _layout.REPLICATED)} entry {name!r}"
        if isinstance(live, torch.optim.Optimizer):
            _schema.check_optimizer(where, live, checked.replicated[name])
        elif isinstance(live, _DICT_UPDATERS):
            _schema.check_same_keys(where, live, checked.replicated[name])
        _payload.restore_entry(name, live, checked.replicated[name], kind)
    saved = (checked.mine or {}).get("per_rank", {})
    for name, live in per_rank.items():
        if name in saved:
            live.load_state_dict(saved[name])


def _problem_of(e: BaseException) -> str:
    text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    return text[:2000]


def _restore(ckpt: Any, checked: _Checked, state: dict[str, Any], per_rank: dict[str, Any]) -> str | None:
    """Step 3 on this rank: the problem, or None. Sharded entries load on every rank (DCP is collective)."""
    problem = None
    try:
        _restore_local(checked, state, per_rank)
        if checked.mine is not None:
            _payload.restore_rng(checked.mine["rng"])
    except Exception as e:
        problem = _problem_of(e)
    sharded = {name: live for name, live in state.items() if checked.manifest["entries"].get(name) == "sharded"}
    if sharded:
        try:
            load_sharded(sharded, checked.step_dir, checked.dcp_metadata, ckpt.group)
        except Exception as e:
            problem = problem or _problem_of(e)
    return problem


def _agree(ckpt: Any, problem: str | None, gone: bool, what: str) -> tuple[dict[int, str], bool]:
    everyone = ckpt.collectives.all_gather((problem, gone), what)
    return {r: p for r, (p, _) in enumerate(everyone) if p}, any(g for _, g in everyone)


def _finish(ckpt: Any, checked: _Checked) -> Any:
    from robustdist.checkpoint.checkpointer import LoadedCheckpoint

    if checked.mine is None:  # (a saved RNG state was restored with the rest, in _restore)
        warn(f"rank {ckpt.rank} has no saved RNG state in checkpoint step {checked.step} (saved by "
             f"{checked.manifest['world_size']} rank(s), loaded by {ckpt.world_size}); its RNGs are reseeded "
             "deterministically from (step, rank).", stacklevel=user_stacklevel())
        _payload.reseed(checked.step, ckpt.rank)
    return LoadedCheckpoint(step=checked.step, path=checked.step_dir, state=checked.replicated,
                            per_rank=(checked.mine or {}).get("per_rank", {}),
                            metadata=checked.manifest.get("metadata", {}), manifest=checked.manifest)


def _try(ckpt: Any, step: int | None, step_dir: str, state: dict[str, Any], per_rank: dict[str, Any],
         map_location: Any, *, listed: bool) -> tuple[Any, dict[int, str], bool]:
    """``(LoadedCheckpoint or None, problems by rank, whether the candidate vanished while read)``."""
    checked, problem, gone = None, None, False
    try:
        checked = _check(ckpt, step, step_dir, state, map_location)
    except CheckpointError as e:  # a listed candidate that no longer exists was rotated away, not damaged
        problem, gone = _problem_of(e), step is not None and listed and not os.path.lexists(step_dir)
    except Exception as e:  # a check that itself failed on a crafted value: still this candidate's problem
        problem = f"{step_dir}: could not be checked ({_problem_of(e)})"
    bad, gone = _agree(ckpt, problem, gone, "load check")
    if bad or checked is None:
        return None, bad, gone
    bad, _ = _agree(ckpt, _restore(ckpt, checked, state, per_rank), False, "load restore")
    if bad:
        return None, bad, False
    return _finish(ckpt, checked), {}, False


def load_checkpoint(ckpt: Any, step: Any, state: dict[str, Any] | None, per_rank: dict[str, Any] | None,
                    map_location: Any, *, missing_ok: bool = False) -> Any:
    state, per_rank = dict(state or {}), dict(per_rank or {})
    tried: list[str] = []
    for _ in range(_RETRIES):
        vanished = False
        with _candidates(ckpt, step) as candidates:
            if not candidates and missing_ok:
                return None
            for candidate, step_dir in candidates:
                loaded, bad, gone = _try(ckpt, candidate, step_dir, state, per_rank, map_location,
                                         listed=step is None)
                if loaded is not None:
                    return loaded
                shown = candidate if candidate is not None else step_dir
                if gone:
                    vanished = True
                    continue
                reason = "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items()))
                tried.append(f"step {shown}: {reason}")
                if step is not None:
                    raise CheckpointCorruptError(f"checkpoint step {shown} failed verification ({reason}); expected "
                                                 "intact files. Fix: load another step (steps() lists them).",
                                                 rank=ckpt.err_rank, ranks=sorted(bad))
                warn(f"checkpoint step {shown} failed verification ({reason}); falling back to the previous "
                     "committed checkpoint.", stacklevel=user_stacklevel())
        if not vanished:
            break
    else:
        raise CheckpointBusyError(
            f"the checkpoints in {ckpt.directory} were rotated away while being read, {_RETRIES} times; expected a "
            "committed step to stay while it is read. A writer is saving and rotating fast (keep_last is small). "
            "Fix: retry the load, or raise checkpoint.keep_last on the writer.", rank=ckpt.err_rank)
    raise CheckpointCorruptError(
        f"no valid checkpoint in {ckpt.directory} ({'; '.join(tried) or 'no committed checkpoint'}); expected at "
        "least one committed checkpoint whose files match its manifest. Fix: check the directory, or start from "
        "scratch.", rank=ckpt.err_rank)
