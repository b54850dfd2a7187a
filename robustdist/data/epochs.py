"""Where a :class:`~robustdist.data.dataloader.SafeDataLoader` is in its epochs, and what a new ``iter()`` does.

The loader keeps a :class:`Position`: epochs started, the sampler epoch the current one runs, and
whether it is still open. Its iterators count the batches they yield into a :class:`Progress` (they hold no
reference to the loader). An epoch ends when its iterator runs out or has yielded ``len(loader)`` batches (a
loop that breaks after the last batch). A new ``iter(loader)``:

* after an ended epoch, starts the next one: the sampler's ``set_epoch(epoch + 1)``, unless the user called
  ``set_epoch`` since its last iteration began (with any value, the same one included: ``set_epoch(e)`` twice runs
  epoch ``e`` twice, as with a plain ``DataLoader``) or changed ``sampler.epoch``. Calls are noticed by an
  instance-level wrapper that :func:`watch_set_epoch` puts on the sampler's ``set_epoch`` (it counts, then calls
  the sampler's own; a sampler that refuses the attribute falls back to noticing changed values only);
* while the epoch is still open (an iteration abandoned part-way, e.g. a batch-size peek
  ``next(iter(loader))``), replays that epoch: no ``set_epoch``, so an epoch-seeded sampler
  (``DistributedSampler``) yields the same order, as a plain ``DataLoader`` with ``set_epoch(epoch)`` does;
  after a resume it starts again at the restored position. A ``set_epoch`` the user calls in between wins.
  Restored one batch before its end, an epoch is not ended by an abandoned iteration that took that one batch: that
  is a peek, and the next iteration yields that batch again (a loop that breaks right after the last batch, then
  iterates again, meets it twice: a batch-size peek is the common case). A loop still in the iteration (a
  ``state_dict()`` after that batch) has ended the epoch: a checkpoint taken there resumes in the next epoch, though
  the live loader, if that loop then breaks and iterates again, replays the batch.

A sampler without ``set_epoch`` (a single process's ``RandomSampler``) draws its order at each ``iter()``, as
with a plain ``DataLoader``.

Saving and restoring this position, across processes, is :mod:`robustdist.data.state`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from robustdist.data.checks import warn_user
from robustdist.runtime import _data_compat
from robustdist.runtime._data_compat import BaseDataLoaderIter
from robustdist.runtime.log import get_logger

log = get_logger(__name__)

RngState = dict[str, "torch.Tensor | None"]  # {"torch": global RNG state, "generator": the loader's or None}
Start = tuple[int, RngState]  # (batches to skip, the RNG state the sampler saw when that epoch began)


class EpochSampler(Protocol):
    """A sampler whose order is chosen by its epoch (``DistributedSampler`` and look-alikes)."""

    epoch: int

    def set_epoch(self, epoch: int) -> None: ...


class PositionedLoader(Protocol):
    """What this module uses of a ``SafeDataLoader`` (not imported: that module imports this one)."""

    _pos: Position
    generator: torch.Generator | None
    dataset: Any

    def __len__(self) -> int: ...


def capture_rng(generator: torch.Generator | None) -> RngState:
    return {"torch": torch.get_rng_state(), "generator": generator.get_state() if generator is not None else None}


def restore_rng(state: RngState, generator: torch.Generator | None) -> None:
    torch.set_rng_state(state["torch"])  # type: ignore[arg-type]
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])  # type: ignore[arg-type]


@dataclass
class Progress:
    """One iteration's progress, written by its iterator: batches yielded, and whether it ran out."""

    batches: int = 0
    finished: bool = False


@dataclass
class Position:
    """Where a loader is (see the module docstring)."""

    epochs: int = 0  # epochs started; an abandoned epoch replayed by the next iteration counts once
    epoch_seen: int | None = None  # the sampler epoch the current epoch runs (None: no epoch sampler yet)
    calls_seen: int | None = None  # the sampler's set_epoch calls when the current iteration began
    open: bool = False  # the current epoch started and has not ended
    start: Start | None = None  # where each iteration of the open epoch starts, after a resume
    offset: int = 0  # batches the current iteration skipped (its start)
    progress: Progress | None = None  # the current iteration's
    iterator: weakref.ref[BaseDataLoaderIter] | None = None  # the current iteration's, while it lives
    rng: RngState | None = None  # what the current iteration's sampler started from
    pending: Start | None = None  # the current iteration's start, taken by its index sampler's iter()

    def ended(self, length: int | None, abandoned: bool = True) -> bool:
        """Whether the current iteration finished its epoch (ran out, or yielded every batch). An ``abandoned``
        iteration (no loop is in it) that took one batch from a restored position with one left is a peek (the DDP
        tutorial's ``next(iter(loader))``), not the end; a loop still in it (a save after the epoch's last batch,
        before the loop asks for the next) has ended it."""
        p = self.progress
        if p is None:
            return False
        peek = abandoned and self.offset > 0 and p.batches == 1 and not p.finished
        return p.finished or (length is not None and self.offset + p.batches >= length and not peek)

    def alive(self) -> bool:
        return self.iterator is not None and self.iterator() is not None

    def __getstate__(self) -> dict[str, Any]:  # a pickled loader (spawn, Ray) leaves its live iterator behind
        return {**self.__dict__, "iterator": None}


class SetEpochWatch:
    """Put on a sampler instance as its ``set_epoch``: counts the calls (a call with the epoch it already has is
    still a call), then runs the sampler's own ``set_epoch``. Pickles and deep-copies with its sampler."""

    def __init__(self, owner: Any, own: Any = None):
        self.owner, self.own, self.calls = owner, own, 0  # own: an instance-level set_epoch it replaced, if any

    def __call__(self, epoch: int) -> Any:
        self.calls += 1
        if self.own is not None:
            return self.own(epoch)
        return type(self.owner).set_epoch(self.owner, epoch)


def watch_set_epoch(sampler: EpochSampler | None) -> int | None:
    """The number of ``set_epoch`` calls on ``sampler`` since it was first watched (installing the watch);
    None where it cannot be watched (no sampler, or one that refuses an instance attribute)."""
    if sampler is None:
        return None
    current = getattr(sampler, "__dict__", {}).get("set_epoch")
    if isinstance(current, SetEpochWatch) and current.owner is sampler:
        return current.calls
    try:
        sampler.set_epoch = SetEpochWatch(sampler, current)  # type: ignore[method-assign]
    except (AttributeError, TypeError):  # __slots__, a read-only property: compare values only
        return None
    return 0


class _Tracked:
    """Counts the batches an iterator yields and notes when it runs out, into its :class:`Progress` (the batch
    hook of :mod:`robustdist.runtime._data_compat`'s iterators)."""

    _rd_progress: Progress | None = None

    def rd_batch(self, finished: bool) -> None:
        progress = self._rd_progress
        if progress is None:
            return
        if finished:
            progress.finished = True
        else:
            progress.batches += 1


# torch's iterators with progress tracking, under torch's class names (the profiler's record names use them)
class _SingleProcessDataLoaderIter(_Tracked, _data_compat.SingleProcessDataLoaderIter):
    """torch's single-process iterator, with progress tracking."""


class _MultiProcessingDataLoaderIter(_Tracked, _data_compat.MultiProcessingDataLoaderIter):
    """torch's worker-process iterator, with progress tracking."""


def new_iterator(loader: DataLoader[Any]) -> BaseDataLoaderIter:
    """``DataLoader._get_iterator``, returning the tracking iterators."""
    if loader.num_workers == 0:
        return _SingleProcessDataLoaderIter(loader)
    loader.check_worker_number_rationality()
    return _MultiProcessingDataLoaderIter(loader)


class PositionedSampler:
    """Wraps the loader's index sampler: records the RNG each iteration starts from, and applies the pending
    start (RNG replay, then skipping the indices already consumed). Holds the position, not the loader (a
    persistent-workers iterator keeps its index sampler for the loader's lifetime)."""

    def __init__(self, position: Position, generator: torch.Generator | None, inner: Sampler[Any]):
        self.position, self.generator, self.inner = position, generator, inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # Taken now, when the iterator is created (torch calls iter() on its index sampler in the iterator's
        # __init__ and again in its reset, which persistent workers also call at each epoch), not when the first
        # index is drawn: two iterators of a restored epoch both start at the restored batch. Not cleared:
        # begin_iteration sets it for each iteration.
        pos = self.position
        start, progress = pos.pending, pos.progress
        if start is not None:
            pos.rng = start[1]
        return self._indices(start, progress)

    def _indices(self, start: Start | None, progress: Progress | None) -> Iterator[Any]:
        pos = self.position
        if start is None:
            rng = capture_rng(self.generator)
            if pos.progress is progress:  # an older iterator drawing late does not overwrite the current one's
                pos.rng = rng
            yield from self.inner
            return
        skip, rng = start
        now = torch.get_rng_state()
        restore_rng(rng, self.generator)
        try:
            it = iter(self.inner)
            for _ in range(skip):
                next(it)
            first = next(it)
        except StopIteration:
            return
        finally:  # the global RNG goes back to the checkpoint's; the loader's generator moves on as it did
            torch.set_rng_state(now)
        yield first
        yield from it


def begin_iteration(loader: PositionedLoader, sampler: EpochSampler | None) -> Start | None:
    """Called by ``SafeDataLoader.__iter__`` before it creates the iterator: settle the epoch (see the module
    docstring) and return where this iteration starts (None: at the epoch's beginning, with the current RNG)."""
    pos = loader._pos
    if pos.open and pos.ended(epoch_length(loader, pos)):
        pos.open, pos.start = False, None
    epoch = int(sampler.epoch) if sampler is not None else None
    if pos.open:
        if sampler is not None and epoch != pos.epoch_seen:  # the user's set_epoch between two iterations wins
            if pos.start is not None:
                warn_user(f"set_epoch({epoch}) was called on a loader restored to epoch {pos.epoch_seen}, batch "
                          f"{pos.start[0]}, before that epoch ended: epoch {epoch} starts from its beginning and "
                          "the restored position is not used. Fix: continue your epoch counter from "
                          "loader.sampler.epoch after a resume.", once=("loader-state", "moved-epoch"))
            pos.start, pos.epoch_seen = None, epoch
        else:
            log.debug("the previous iteration stopped before the epoch ended: replaying epoch %s", epoch)
    else:
        if sampler is not None:
            calls = watch_set_epoch(sampler)
            untouched = epoch == pos.epoch_seen and (calls is None or calls == pos.calls_seen)
            if pos.epochs > 0 and untouched:  # no set_epoch since the last iteration began: the next epoch
                sampler.set_epoch(epoch + 1)
            pos.epoch_seen = int(sampler.epoch)
        pos.epochs += 1
        pos.open, pos.start = True, None
    pos.calls_seen = watch_set_epoch(sampler)  # calls from here on are the user's, for the next epoch
    pos.offset, pos.rng = (pos.start[0], pos.start[1]) if pos.start is not None else (0, None)
    pos.pending, pos.progress, pos.iterator = pos.start, Progress(), None
    return pos.start


def iteration_started(pos: Position, iterator: BaseDataLoaderIter) -> None:
    """Called by ``SafeDataLoader.__iter__`` with the iterator it returns."""
    pos.iterator = weakref.ref(iterator)
    iterator._rd_progress = pos.progress  # type: ignore[attr-defined]


def batches_per_epoch(loader: PositionedLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def epoch_length(loader: PositionedLoader, pos: Position) -> int | None:
    """The batches that end an epoch; None for a stream (it ends when it runs out: asking ``len()`` of an
    ``IterableDataset`` loader would also make torch warn when the stream yields more), or when not needed."""
    if isinstance(loader.dataset, IterableDataset) or pos.progress is None or pos.progress.finished:
        return None
    return batches_per_epoch(loader)
