"""Where a :class:`~robustdist.dataloader.SafeDataLoader` is, and how to put a new one back there.

``state_dict()`` records the epoch, how many iterations were started, how many batches of the current
iteration were consumed (the iterator's own counter: no per-batch cost), and the RNG state the index sampler
saw when the iteration began (the global torch RNG and the loader's ``generator``). ``load_state_dict()``
makes the *next* ``iter(loader)`` yield exactly the batches the interrupted iteration had not yet yielded:

* indices are skipped at the sampler level, before any worker fetches them, so skipping costs no data
  loading;
* the skipped iteration's sampler runs with the RNG state it saw originally, so a shuffling sampler without
  a seed (a single process's ``RandomSampler``) replays the same order; a ``DistributedSampler`` is seeded by
  ``data.seed`` and the epoch anyway;
* the global RNG is left as it was before ``iter()``, so training code after a resume draws the same
  random numbers as the uninterrupted run did (with the RNG state the checkpoint restored); the loader's own
  ``generator`` ends where the interrupted run's was after the same draws, so later epochs match too.

Not restored: the progress of an ``IterableDataset`` stream (the epoch restarts, with a warning), and the
RNG state *inside* worker processes part-way through an epoch (workers are re-seeded from
(``data.seed``, rank, worker, epoch) as at any epoch start, so per-sample random augmentation done in workers
differs after a mid-epoch resume; with ``num_workers=0`` it is exact).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from robustdist.errors import ConfigError
from robustdist.log import warn

STATE_VERSION = 1


def capture_rng(generator: torch.Generator | None) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "generator": generator.get_state() if generator is not None else None}


def restore_rng(state: dict[str, Any], generator: torch.Generator | None) -> None:
    torch.set_rng_state(state["torch"])
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])


class PositionedSampler:
    """Wraps the loader's index sampler: records the RNG each iteration starts from, and applies a pending
    resume (RNG replay, then skipping the indices already consumed)."""

    def __init__(self, loader: Any, inner: Any):
        self.loader, self.inner = loader, inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        resume, loader._active_resume = loader._active_resume, None
        if resume is None:
            loader._epoch_rng = capture_rng(loader.generator)
            yield from self.inner
            return
        skip, rng = resume
        now = torch.get_rng_state()
        restore_rng(rng, loader.generator)
        loader._epoch_rng = rng
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


def iteration_started(loader: Any, iterator: Any) -> None:
    """Called by ``SafeDataLoader.__iter__`` with the iterator it returns."""
    loader._current = weakref.ref(iterator)


def consumed(loader: Any) -> int | None:
    """Batches of the current iteration consumed so far, or None when no iteration is in flight."""
    iterator = loader._current() if loader._current is not None else None
    if iterator is None:
        return None
    return loader._offset + int(getattr(iterator, "_num_yielded", 0))


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def state_dict(loader: Any, sampler: Any) -> dict[str, Any]:
    done = consumed(loader)
    length = _length(loader)
    in_flight = done is not None and loader._iterations > 0 and (length is None or done < length)
    return {
        "version": STATE_VERSION,
        "iterations": loader._iterations,
        "epoch": int(sampler.epoch) if sampler is not None else None,
        "num_batches": length,
        "batches": done if in_flight else 0,
        "in_flight": bool(in_flight),
        "rng": loader._epoch_rng if in_flight else None,
    }


def load_state_dict(loader: Any, sampler: Any, state: Any) -> None:
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else None
        raise ConfigError(f"loader state {type(state).__name__} with version {found!r}"
                          f"; expected a dict from SafeDataLoader.state_dict() (version {STATE_VERSION}). Fix: pass "
                          "the state saved by this robustdist version, or start the loader fresh.")
    epoch, iterations = state["epoch"], int(state["iterations"])
    if sampler is not None and epoch is not None:
        sampler.set_epoch(epoch)
    loader._resume = None
    if not state["in_flight"]:
        loader._iterations, loader._epoch_seen = iterations, epoch
        return
    if isinstance(loader.dataset, IterableDataset):
        warn("the loader reads an IterableDataset: its position inside the interrupted epoch cannot be restored, "
             f"so that epoch restarts from the beginning of the stream ({state['batches']} batches are read again). "
             "Shard and resume the stream inside the dataset if that matters.", once=("loader-state", "iterable"))
        loader._iterations, loader._epoch_seen = iterations - 1, None
        return
    length = _length(loader)
    if length != state["num_batches"]:
        warn(f"the loader has {length} batches per epoch but the saved state was taken with {state['num_batches']} "
             "(a different dataset, batch size or world size); the interrupted epoch restarts from its beginning.",
             once=("loader-state", "length"))
        loader._iterations, loader._epoch_seen = iterations - 1, None
        return
    loader._iterations, loader._epoch_seen = iterations - 1, None
    loader._resume = (int(state["batches"]), state["rng"])
