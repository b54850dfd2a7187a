"""The load protocol of ``AtomicCheckpointer.load``: agree on a valid step across ranks, verify before
deserialising, restore. This module knows the checkpointer only through a :class:`._types.Context`.

Every rank calls ``load``; with no multi-rank group every collective below is a no-op.

0. Every rank *arrives* (:mod:`._collective`, in ``AtomicCheckpointer.load``), as for ``save``.
   **Store only, no collective.** Until it has passed once, every rank then checks that it sees the same
   directory as rank 0 (:mod:`._shared`; **collective: two all_gathers**), so ranks on different nodes never
   read different directories.
1. Rank 0's listing of the step directories (committed, damaged or links alike), newest first, is broadcast.
   **Collective: broadcast.** (Or the caller names one step, or a ``ray.train.Checkpoint``: no listing.)
2. For each candidate, every rank *checks* it without touching any live object: reads and validates the
   manifest, verifies each file it needs (size, then checksum, from the same open file it then
   deserialises), deserialises with ``torch.load(weights_only=True)``, validates what it got against the
   manifest, reads and validates the DCP metadata of sharded entries, and checks each entry against the live
   object it goes into (:mod:`._live`: a module's keys, shapes and dtypes; an optimizer's layout, groups and
   state; a scheduler's or scaler's keys and value kinds). **Collective: all_gather** of the problems (and of
   whether the rank restores any object step 2 cannot check): a candidate any rank finds wrong is skipped on
   every rank, with a warning naming the rank, the file and the reason.
3. Every rank restores the checked payload into the live objects (:mod:`._restore`):

   a. only if some rank restores an object step 2 cannot check (a user's stateful object or data loader, a
      module with ``_extra_state``, a sharded entry): every rank copies the live state of those objects and
      of its sharded entries, restores them, and the sharded entries through DCP with robustdist's confined
      reader and safe planner (**collective: DCP's own**). **Collective: all_gather** of the problems.
   b. if nothing failed: every rank restores the entries step 2 checked (modules, optimizers, schedulers,
      grad scalers: this cannot fail). **Collective: all_gather** of the problems.

   A restore that failed anywhere puts the copies of 3a back on every rank (so a failed candidate leaves
   the live objects as they were) and falls back to the next candidate.
4. Only now each rank restores its saved RNG state (checked on scratch generators in step 2); a rank with none
   (the job grew since the save) warns and reseeds its RNGs from ``(step, rank)``. ``AtomicCheckpointer``
   then protects the loaded step from rotation.

A candidate that disappears while it is read (a writer rotated it away) is not corrupt: the listing is
retried (up to three times) and then :class:`~robustdist.runtime.errors.CheckpointBusyError` says to retry.
A candidate that does not fit the live objects (another model, optimizer or set of entries) is skipped too,
but it is not corrupt: when no candidate loads, a :class:`~robustdist.runtime.errors.CheckpointError` says so.
Every other problem with the files is a :class:`~robustdist.runtime.errors.CheckpointCorruptError`, raised only
when no candidate is valid (or at once for an explicitly requested step); the steps whose files were
corrupt are reported to ``AtomicCheckpointer``, which stops counting them as newer committed steps (see
:mod:`._protocol`, step 1). When ``load()`` raises, the live objects are as they were (unless a restore of 3b
failed anyway, which its error names). The trust model (what is read
from an untrusted directory, and how) is in ``docs/security.md`` and in :mod:`._safeio`, :mod:`._schema`,
:mod:`._live` and :mod:`._sharded`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from robustdist.checkpoint import _layout, _live, _payload, _restore, _schema
from robustdist.checkpoint._safeio import check_torch_zip
from robustdist.checkpoint._schema import weights_only_reason
from robustdist.checkpoint._sharded import read_metadata
from robustdist.checkpoint._types import Context, LoadedCheckpoint
from robustdist.runtime.errors import (CheckpointBusyError, CheckpointCorruptError, CheckpointError,
                                      CheckpointVersionError)
from robustdist.runtime.log import user_stacklevel, warn

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.serialization import MAP_LOCATION

__all__ = ["check_entries", "is_ray_checkpoint", "load_checkpoint", "torch_load"]

_RETRIES = 3


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
    dcp_metadata: Metadata | None
    plan: _restore.Plan


def dcp_metadata_of(step_dir: str, manifest: dict[str, Any]) -> Any:
    """The step's DCP metadata (:func:`read_metadata`); one naming a ``torch.<dtype>`` only the torch that wrote it
    has (the manifest says which) is a :class:`CheckpointVersionError`."""
    try:
        return read_metadata(step_dir, manifest["files"])
    except CheckpointCorruptError as e:
        version = _schema.another_torchs(e, manifest.get("torch"))
        if version is None:
            raise
        raise CheckpointVersionError(f"{os.path.join(step_dir, _layout.SHARDED_DIR)}: this torch cannot load it: "
                                     f"{version}.") from e


def torch_load(step_dir: str, name: str, manifest: dict[str, Any], map_location: MAP_LOCATION) -> Any:
    """Verify one file against the manifest and deserialise it from the same open file, weights only."""
    path = os.path.join(step_dir, name)
    with _layout.open_verified(step_dir, name, manifest["files"][name]) as fh:
        check_torch_zip(fh, path, values=_schema.MAX_PAYLOAD_VALUES, payload=True)
        try:
            return torch.load(fh, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            reason = weights_only_reason(e)
            version = _schema.another_torchs(e, manifest.get("torch"))
            if version is not None:
                raise CheckpointVersionError(f"{path}: this torch cannot load it: {version}.") from e
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
def _candidates(ctx: Context, step: Any) -> Iterator[list[tuple[int | None, str]]]:
    """``[(step or None for a Ray checkpoint, step directory)]``, newest first, the same on every rank."""
    if is_ray_checkpoint(step):
        with step.as_directory() as path:
            yield [(None, path)]
        return
    if step is not None:
        name = _layout.step_dirs(ctx.directory).get(step, _layout.step_dirname(step))
        yield [(step, os.path.join(ctx.directory, name))]
        return
    listed = [(s, name) for s, name in reversed(_layout.step_dirs(ctx.directory).items())]
    listed = ctx.collectives.broadcast(listed, "load listing")
    yield [(s, os.path.join(ctx.directory, name)) for s, name in listed]


def _load_payload(step_dir: str, name: str, manifest: dict[str, Any], map_location: MAP_LOCATION) -> Any:
    payload = torch_load(step_dir, name, manifest, map_location)
    _schema.check_size(os.path.join(step_dir, name), payload, _schema.MAX_PAYLOAD_VALUES)
    return payload


def _check_entries(step_dir: str, kinds: dict[str, str], replicated: dict[str, Any], state: dict[str, Any],
                   saved_per_rank: dict[str, Any], per_rank: dict[str, Any]) -> None:
    """Each saved entry against the live object it is restored into, touching none (:mod:`._live`)."""
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
        if kind == "stateful":
            _refuse_views(f"{os.path.join(step_dir, _layout.REPLICATED)} entry {name!r}", replicated[name])
        _check_live(f"{os.path.join(step_dir, _layout.REPLICATED)} entry {name!r}", live, replicated[name], kind)
    for name, live in per_rank.items():
        if name in saved_per_rank:
            if not hasattr(live, "load_state_dict"):
                raise CheckpointError(f"per_rank[{name!r}] is a {type(live).__name__}, which has no load_state_dict")
            kind = "module" if isinstance(live, nn.Module) else "stateful"
            if kind == "stateful":
                _refuse_views(f"{step_dir} per-rank entry {name!r}", saved_per_rank[name])
            _check_live(f"{step_dir} per-rank entry {name!r}", live, saved_per_rank[name], kind)


def _refuse_views(where: str, saved: Any) -> None:
    """An expanded tensor view in an object's saved state: its ``load_state_dict`` (a user's object, unchecked
    beyond this) would hold a few bytes that any use materialises into gigabytes. Corrupt whatever the object."""
    found = _schema.expanded_view(saved)
    if found is not None:
        path, t = found
        raise CheckpointCorruptError(f"{where}{path} holds an expanded tensor view (shape {tuple(t.shape)[:8]}, "
                                     f"strides {t.stride()[:8]}); expected densely stored state")


check_entries = _check_entries
"""Each saved entry against the live object it is restored into (the in-memory tier checks the same way)."""


def _check_live(where: str, live: Any, saved: Any, kind: str) -> None:
    if kind == "module" and not isinstance(live, nn.Module):
        raise CheckpointError(f"{where} was saved as a module's state; the live value is a {type(live).__name__}")
    if isinstance(live, nn.Module):
        if kind != "module" or not isinstance(saved, dict):
            raise CheckpointError(f"{where} was saved as a {kind}, not as a module's state; the live value is a "
                                  f"{type(live).__name__}")
        _live.check_module(where, live, saved)
    elif isinstance(live, torch.optim.Optimizer):
        _live.check_optimizer(where, live, saved)
    elif isinstance(live, _live.DICT_UPDATERS) and not _payload.scaler_skips(live, saved):
        _live.check_same_keys(where, live, saved)


def _check(rank: int, step: int | None, step_dir: str, state: dict[str, Any], per_rank: dict[str, Any],
           map_location: MAP_LOCATION, max_file: int | None = None) -> _Checked:
    manifest = _layout.read_manifest(step_dir, step)
    kinds: dict[str, str] = manifest.get("entries", {})
    where = f"checkpoint step {manifest['step']}"
    state = _restore.present(state, kinds, where)
    replicated, mine, dcp_metadata = {}, None, None
    if _layout.REPLICATED in manifest["files"]:
        live = [v for name, v in state.items() if kinds.get(name) != "sharded"]
        _live.check_file_size(os.path.join(step_dir, _layout.REPLICATED),
                              manifest["files"][_layout.REPLICATED]["size"], live, max_file)
        payload = _load_payload(step_dir, _layout.REPLICATED, manifest, map_location)
        replicated = _schema.check_replicated(os.path.join(step_dir, _layout.REPLICATED), payload, kinds)
    own = _layout.rank_file(rank)
    if own in manifest["files"]:
        _live.check_file_size(os.path.join(step_dir, own), manifest["files"][own]["size"], list(per_rank.values()),
                              max_file)
        mine = _schema.check_rank_payload(os.path.join(step_dir, own),
                                          _load_payload(step_dir, own, manifest, map_location))
    if any(kinds.get(name) == "sharded" for name in state):
        _layout.verify(step_dir, manifest, [f for f in manifest["files"] if f.startswith(_layout.SHARDED_DIR + "/")])
        dcp_metadata = dcp_metadata_of(step_dir, manifest)
    saved_per_rank = (mine or {}).get("per_rank", {})
    _check_entries(step_dir, kinds, replicated, state, saved_per_rank, per_rank)
    plan = _restore.plan(kinds, replicated, state, saved_per_rank, per_rank)
    return _Checked(manifest["step"], step_dir, manifest, replicated, mine, dcp_metadata, plan)


def _problem_of(e: BaseException) -> str:
    text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    return text[:2000]


def _finish(ctx: Context, checked: _Checked) -> LoadedCheckpoint:
    if checked.mine is not None:  # checked on scratch generators in step 2: restoring it cannot fail
        _payload.restore_rng(checked.mine["rng"])
    else:
        warn(f"rank {ctx.rank} has no saved RNG state in checkpoint step {checked.step} (saved by "
             f"{checked.manifest['world_size']} rank(s), loaded by {ctx.world_size}); its RNGs are reseeded "
             "deterministically from (step, rank).", stacklevel=user_stacklevel())
        _payload.reseed(checked.step, ctx.rank)
    return LoadedCheckpoint(step=checked.step, path=checked.step_dir, state=checked.replicated,
                            per_rank=(checked.mine or {}).get("per_rank", {}),
                            metadata=checked.manifest.get("metadata", {}), manifest=checked.manifest)


@dataclass
class _Outcome:
    """One candidate on this rank: loaded, or the problems by rank, whether it vanished while read, whether a
    rank found its files corrupt (not just unfit for the live objects), and whether a rank found it needs another
    torch (:class:`CheckpointVersionError`)."""

    loaded: LoadedCheckpoint | None = None
    bad: dict[int, str] = field(default_factory=dict)
    gone: bool = False
    corrupt: bool = False
    another_torch: bool = False


def _check_here(ctx: Context, step: int | None, step_dir: str, state: dict[str, Any], per_rank: dict[str, Any],
                map_location: MAP_LOCATION, listed: bool) -> tuple[_Checked | None, tuple[Any, ...]]:
    """Step 2 on this rank: the checked candidate (or None) and ``(problem, gone, corrupt, needs copies, another
    torch)``."""
    try:
        checked = _check(ctx.rank, step, step_dir, state, per_rank, map_location, ctx.max_file_bytes)
        return checked, (None, False, False, checked.plan.needs_copies, False)
    except CheckpointError as e:  # a listed candidate that no longer exists was rotated away, not damaged
        gone = step is not None and listed and not os.path.lexists(step_dir)
        return None, (_problem_of(e), gone, isinstance(e, CheckpointCorruptError), False,
                      isinstance(e, CheckpointVersionError))
    except Exception as e:  # a check that itself failed on a crafted value: still this candidate's problem
        return None, (f"{step_dir}: could not be checked ({_problem_of(e)})", False, True, False, False)


def _try(ctx: Context, step: int | None, step_dir: str, state: dict[str, Any], per_rank: dict[str, Any],
         map_location: MAP_LOCATION, *, listed: bool) -> _Outcome:
    """Steps 2 and 3 for one candidate. A restore that fails on any rank puts every copied object back."""
    checked, mine = _check_here(ctx, step, step_dir, state, per_rank, map_location, listed)
    everyone = ctx.collectives.all_gather(mine, "load check")
    bad = {r: row[0] for r, row in enumerate(everyone) if row[0]}
    if bad or checked is None:
        return _Outcome(bad=bad, gone=any(row[1] for row in everyone), corrupt=any(row[2] for row in everyone),
                        another_torch=any(row[4] for row in everyone))
    copies: list[Any] = []
    if any(row[3] for row in everyone):  # some rank restores an object step 2 could not check: copy first
        copies, problem = _restore.restore_unchecked(checked.plan, step_dir, checked.dcp_metadata, ctx.group)
        bad = ctx.collectives.problems(problem, "load restore")
    if not bad:
        bad = ctx.collectives.problems(_restore.restore_checked(checked.plan), "load apply")
    if bad:
        failed = _restore.put_back(copies)
        if failed:
            warn(f"rank {ctx.rank} could not put back the live state of {'; '.join(failed)} after checkpoint step "
                 f"{checked.step} failed to restore", stacklevel=user_stacklevel())
        return _Outcome(bad=bad)
    return _Outcome(loaded=_finish(ctx, checked))


def load_checkpoint(ctx: Context, step: Any, state: dict[str, Any] | None, per_rank: dict[str, Any] | None,
                    map_location: MAP_LOCATION, *, missing_ok: bool = False,
                    rejected: dict[int, tuple[Any, ...]] | None = None) -> LoadedCheckpoint | None:
    """Steps 1 to 4 of the load protocol (module docstring) on this rank. ``step``: None (the newest valid
    one, falling back), a committed step, or a ``ray.train.Checkpoint``. ``rejected`` (filled in, the same on
    every rank): step -> identity of the directory of each candidate whose files some rank found corrupt."""
    state, per_rank = dict(state or {}), dict(per_rank or {})
    tried: list[str] = []
    corrupt = False
    for _ in range(_RETRIES):
        vanished = False
        with _candidates(ctx, step) as candidates:
            if not candidates and missing_ok:
                return None
            for candidate, step_dir in candidates:
                out = _try(ctx, candidate, step_dir, state, per_rank, map_location, listed=step is None)
                if out.loaded is not None:
                    return out.loaded
                if out.gone:
                    vanished = True
                    continue
                shown = candidate if candidate is not None else step_dir
                identity = _layout.identity(step_dir) if out.corrupt and candidate is not None else None
                if rejected is not None and identity is not None:
                    rejected[candidate] = identity
                corrupt = corrupt or out.corrupt
                reason = "; ".join(f"rank {r}: {p}" for r, p in sorted(out.bad.items()))
                if out.another_torch:  # an older step would resume older work, where upgrading resumes this one
                    raise CheckpointVersionError(
                        f"checkpoint step {shown} needs another torch than this one ({reason}). Nothing was restored, "
                        "and no older checkpoint was tried (it would resume older work). Fix: as the reason says; "
                        "the checkpoint is intact.", rank=ctx.err_rank, ranks=sorted(out.bad))
                tried.append(f"step {shown}: {reason}")
                if step is not None:
                    _raise_failed(ctx, f"checkpoint step {shown}", reason, out.corrupt, sorted(out.bad))
                warn(f"checkpoint step {shown} failed verification ({reason}); falling back to the previous "
                     "committed checkpoint.", stacklevel=user_stacklevel())
        if not vanished:
            break
    else:
        raise CheckpointBusyError(
            f"the checkpoints in {ctx.directory} were rotated away while being read, {_RETRIES} times; expected a "
            "committed step to stay while it is read. A writer is saving and rotating fast (keep_last is small). "
            "Fix: retry the load, or raise checkpoint.keep_last on the writer.", rank=ctx.err_rank)
    _raise_failed(ctx, None, "; ".join(tried) or "no committed checkpoint", corrupt or not tried, None)


def _raise_failed(ctx: Context, what: str | None, reason: str, corrupt: bool, ranks: list[int] | None) -> NoReturn:
    """The error of a load that restored nothing (every live object is as it was before ``load()``)."""
    if what is not None and corrupt:
        raise CheckpointCorruptError(f"{what} failed verification ({reason}); expected intact files. Fix: load "
                                     "another step (steps() lists them).", rank=ctx.err_rank, ranks=ranks)
    if what is not None:
        raise CheckpointError(f"{what} could not be restored into the live objects ({reason}); it was not found "
                              "corrupt. Expected the entries, model and optimizer it was saved from. Nothing was "
                              "restored. Fix: build the same objects as when saving, or load another step.",
                              rank=ctx.err_rank, ranks=ranks)
    if corrupt:
        raise CheckpointCorruptError(
            f"no valid checkpoint in {ctx.directory} ({reason}); expected at least one committed checkpoint whose "
            "files match its manifest. Nothing was restored. Fix: check the directory, or start from scratch.",
            rank=ctx.err_rank)
    raise CheckpointError(
        f"no checkpoint in {ctx.directory} could be restored into the live objects ({reason}); none was found "
        "corrupt. Expected the entries, model and optimizer they were saved from. Nothing was restored. Fix: build "
        "the same objects as when saving (or pass only entries the checkpoints hold).", rank=ctx.err_rank)
