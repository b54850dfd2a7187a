"""Saving and restoring where a :class:`~robustdist.data.dataloader.SafeDataLoader` is (its epochs and iterations are
:mod:`robustdist.data.epochs`).

``state_dict()`` records the epoch, the epochs started (field ``iterations``), how many batches of
the open epoch were consumed, and the RNG state the index sampler saw when that iteration began (the global
torch RNG and the loader's ``generator``). Consumed means: by the live iterator, when it is still referenced
(the training loop is in it); by none, when the iteration was abandoned (the next ``iter()`` replays from the
epoch's start, or from the restored position after a resume). ``load_state_dict()`` makes the *next*
``iter(loader)`` yield exactly the batches the interrupted iteration had not yet yielded:

* indices are skipped at the sampler level, before any worker fetches them, so skipping costs no data
  loading;
* the skipped iteration's sampler runs with the RNG state it saw originally, so a shuffling sampler without
  a seed (a single process's ``RandomSampler``) replays the same order; a ``DistributedSampler`` is seeded by
  its seed and the epoch anyway;
* the global RNG is left as it was before ``iter()``, so training code after a resume draws the same
  random numbers as the uninterrupted run did (with the RNG state the checkpoint restored); the loader's own
  ``generator`` ends where the interrupted run's was after the same draws, so later epochs match too;
* an iteration abandoned before the restored epoch ends does not use the restored position up: the next one
  starts there again.

Not restored: the progress of an ``IterableDataset`` stream (the epoch restarts, with a warning), and the
RNG state *inside* worker processes part-way through an epoch (workers are re-seeded from
(``data.seed``, rank, worker, epoch) as at any epoch start, so per-sample random augmentation done in workers
differs after a mid-epoch resume; with ``num_workers=0`` it is exact).

Trust: the state comes from a checkpoint file, so ``load_state_dict()`` treats it as untrusted input. Every
field is checked before anything changes (exact types, ranges, ``batches <= num_batches``, RNG states tried
on a scratch generator); a malformed state raises :class:`~robustdist.runtime.errors.CheckpointError` naming the
field and leaves the loader as it was.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import IterableDataset

from robustdist.config.validate import show
from robustdist.data.checks import warn_user
from robustdist.data.epochs import (
    EpochSampler,
    Position,
    PositionedLoader,
    batches_per_epoch,
    capture_rng,
    epoch_length,
    watch_set_epoch,
)
from robustdist.runtime import _data_compat
from robustdist.runtime.errors import CheckpointError

STATE_VERSION = 1
FIELDS = ("version", "iterations", "epoch", "num_batches", "batches", "in_flight", "rng")
MAX_UNSIZED_SKIP = 10_000_000  # batches a resume may skip when the loader has no length (each is a next())
MAX_COUNT = 2**63 - 1  # counters are int64 in torch; a DistributedSampler seeds with seed + epoch (uint64)
MAX_SEED = 2**64 - 1  # the largest seed torch's manual_seed accepts
_LOADER_REFS = 3  # getrefcount's argument, in_use's local, the persistent-workers loader's own _iterator
_FIX = ("Fix: pass the dict SafeDataLoader.state_dict() returned, unmodified (check that the checkpoint holds this "
        "loader's state), or skip load_state_dict() to start the loader fresh.")


def in_use(loader: PositionedLoader, pos: Position) -> bool:
    """Whether the current iteration's iterator is still referenced outside the loader (a training loop is in
    it). A loader with persistent workers keeps its iterator (``_iterator``) for the next epoch, so that
    reference does not count: after an abandoned ``next(iter(loader))`` only the loader holds it."""
    it = pos.iterator() if pos.iterator is not None else None
    if it is None:
        return False
    if _data_compat.live_iterator(loader) is not it or not hasattr(sys, "getrefcount"):
        return True  # (without refcounts, as on PyPy: taken as in use, the iterator's own position)
    return sys.getrefcount(it) > _LOADER_REFS


def state_dict(loader: PositionedLoader, sampler: EpochSampler | None) -> dict[str, Any]:
    pos, length = loader._pos, batches_per_epoch(loader)
    in_flight = pos.open and not pos.ended(epoch_length(loader, pos), abandoned=not in_use(loader, pos))
    if not in_flight:
        batches, rng = 0, None
    elif in_use(loader, pos) and pos.progress is not None:  # the loop is in this iteration: its own position
        batches, rng = pos.offset + pos.progress.batches, pos.rng
    elif pos.start is not None:  # abandoned, or not iterated since a resume: the next iteration starts here
        batches, rng = pos.start
    else:  # abandoned: the next iteration replays the epoch from its beginning
        batches, rng = 0, pos.rng
    if in_flight and rng is None:  # the iteration has not drawn its order yet: the current RNG state draws it
        rng = capture_rng(loader.generator)
    return {
        "version": STATE_VERSION,
        "iterations": pos.epochs,
        "epoch": int(sampler.epoch) if sampler is not None else None,
        "num_batches": length,
        "batches": batches,
        "in_flight": bool(in_flight),
        "rng": rng,
    }


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _found(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return show(value)


def _refuse(field: str, value: Any, expected: str, fix: str = _FIX) -> CheckpointError:
    return CheckpointError(f"loader state `{field}` is {_found(value)}; expected {expected}. {fix}")


def _check_dict(state: Any) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"loader state is {_found(state)}; expected a dict from SafeDataLoader.state_dict() "
                              f"(version {STATE_VERSION}). {_FIX}")
    version = state.get("version", STATE_VERSION)  # a missing version is reported with the other missing keys
    if type(version) is not int or version != STATE_VERSION:
        raise _refuse("version", version, f"{STATE_VERSION} (the version of SafeDataLoader.state_dict() in this "
                      "robustdist)", "Fix: pass the state saved by this robustdist version, or start the loader "
                      "fresh (skip load_state_dict()).")
    missing = [k for k in FIELDS if k not in state]
    unknown = [show(k, 40) for k in state if k not in FIELDS]
    if missing or unknown:
        found = "; ".join(part for part in (f"missing key(s) {missing}" if missing else "",
                                            f"unknown key(s) {', '.join(unknown[:5])}" if unknown else "") if part)
        raise CheckpointError(f"loader state has {found}; expected exactly the keys {list(FIELDS)}. {_FIX}")


def _check_count(state: dict[str, Any], field: str, low: int = 0, high: int = MAX_COUNT, *,
                 optional: bool = False, why: str = "") -> None:
    value = state[field]
    if value is None and optional:
        return
    if type(value) is not int or not low <= value <= high:  # type() is: a bool is not a count
        expected = f"{'None or ' if optional else ''}an int (not a bool) from {low} to {high}{why}"
        raise _refuse(field, value, expected)


def _check_rng_state(field: str, value: Any, trial: torch.Generator | None) -> None:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.device.type == "cpu"
            and value.layout == torch.strided):
        raise _refuse(field, value, "a torch.uint8 CPU tensor (from torch.get_rng_state() or Generator.get_state())")
    if trial is None:  # the loader has no generator to restore: the entry is not used
        return
    try:
        trial.set_state(value)
    except (RuntimeError, TypeError, ValueError) as e:
        raise _refuse(field, value, f"an RNG state that a {trial.device} generator accepts (torch said: "
                      f"{_cut(str(e), 120)})") from e


def _check_rng(rng: Any, in_flight: bool, generator: torch.Generator | None) -> None:
    if not in_flight:
        if rng is not None:
            raise _refuse("rng", rng, "None when `in_flight` is False (no iteration to replay)")
        return
    if not isinstance(rng, dict) or set(rng) != {"torch", "generator"}:
        raise _refuse("rng", rng, "a dict with exactly the keys 'torch' and 'generator' while `in_flight` is True "
                      "(the RNG states the interrupted iteration began with)")
    _check_rng_state("rng['torch']", rng["torch"], torch.Generator())  # the global RNG is a CPU generator
    if rng["generator"] is not None:
        trial = torch.Generator(device=generator.device) if generator is not None else None
        _check_rng_state("rng['generator']", rng["generator"], trial)


def _check_epoch(state: dict[str, Any], seed: int | None) -> None:
    epoch = state["epoch"]
    if seed is None or type(epoch) is not int or epoch < 0:
        _check_count(state, "epoch", optional=True)
        return
    high = min(MAX_COUNT, MAX_SEED - 1 - seed)  # the next epoch (epoch + 1) must seed too
    if epoch > high:
        raise CheckpointError(
            f"loader state `epoch` is {epoch}; expected at most {high}: the sampler seeds each epoch with seed + "
            f"epoch (its seed is {seed}), and torch's manual_seed accepts at most 2**64-1 = {MAX_SEED}, for this "
            f"epoch and the next. {_FIX} If the checkpoint is right, build the sampler with the seed it was "
            "saved with (a smaller one).")


def validate_state(state: Any, generator: torch.Generator | None, seed: int | None = None) -> None:
    """Raise :class:`CheckpointError` naming the first malformed field of a saved loader state; change nothing.
    ``seed``: the epoch sampler's seed (``DistributedSampler.seed``), which bounds ``epoch``; None if none."""
    _check_dict(state)
    in_flight = state["in_flight"]
    if type(in_flight) is not bool:
        raise _refuse("in_flight", in_flight, "True or False")
    started = " (at least 1 while `in_flight` is True: the interrupted iteration had started)" if in_flight else ""
    _check_count(state, "iterations", 1 if in_flight else 0, why=started)
    _check_epoch(state, seed)
    _check_count(state, "num_batches", optional=True)
    num_batches = state["num_batches"]
    if num_batches is None:  # a sampler without a length: skipping is bounded here, since no length bounds it
        _check_count(state, "batches", high=MAX_UNSIZED_SKIP,
                     why=" (the loader's length is unknown, so a resume skips at most this many batches)")
    else:
        _check_count(state, "batches", high=num_batches, why=f" (`num_batches` is {num_batches})")
    _check_rng(state["rng"], in_flight, generator)


def _copy_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """The saved RNG states, detached from the caller's dict and tensors (they are used at the next ``iter``)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in rng.items()}


def load_state_dict(loader: PositionedLoader, sampler: EpochSampler | None, state: Any) -> None:
    seed = getattr(sampler, "seed", None)
    validate_state(state, loader.generator, seed if type(seed) is int else None)
    epoch, iterations = state["epoch"], state["iterations"]
    if sampler is not None and epoch is not None:
        sampler.set_epoch(epoch)
    pos = loader._pos
    pos.epochs, pos.epoch_seen = iterations, int(sampler.epoch) if sampler is not None else None
    pos.calls_seen = watch_set_epoch(sampler)  # this set_epoch restores the epoch: not the user's
    pos.open, pos.start, pos.offset = state["in_flight"], None, 0
    pos.progress = pos.iterator = pos.pending = None
    if not state["in_flight"]:
        return
    if isinstance(loader.dataset, IterableDataset):
        warn_user("the loader reads an IterableDataset: its position inside the interrupted epoch cannot be restored, "
                  f"so that epoch restarts from the beginning of the stream ({state['batches']} batches are read "
                  "again). Shard and resume the stream inside the dataset if that matters.",
                  once=("loader-state", "iterable"))
        return
    length = batches_per_epoch(loader)
    if length != state["num_batches"]:
        warn_user(f"the loader has {length} batches per epoch but the saved state was taken with "
                  f"{state['num_batches']} (a different dataset, batch size or world size); the interrupted epoch "
                  "restarts from its beginning.", once=("loader-state", "length"))
        return
    pos.start = (state["batches"], _copy_rng(state["rng"]))
