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

Trust: the state comes from a checkpoint file, so ``load_state_dict()`` treats it as untrusted input. Every
field is checked before anything changes (exact types, ranges, ``batches <= num_batches``, RNG states tried
on a scratch generator); a malformed state raises :class:`~robustdist.errors.CheckpointError` naming the
field and leaves the loader as it was.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from robustdist._validate import show
from robustdist.errors import CheckpointError
from robustdist.log import warn

STATE_VERSION = 1
FIELDS = ("version", "iterations", "epoch", "num_batches", "batches", "in_flight", "rng")
MAX_UNSIZED_SKIP = 10_000_000  # batches a resume may skip when the loader has no length (each is a next())
MAX_COUNT = 2**63 - 1  # counters are int64 in torch; a DistributedSampler seeds with seed + epoch (uint64)
_FIX = ("Fix: pass the dict SafeDataLoader.state_dict() returned, unmodified (check that the checkpoint holds this "
        "loader's state), or skip load_state_dict() to start the loader fresh.")


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


def validate_state(state: Any, generator: torch.Generator | None) -> None:
    """Raise :class:`CheckpointError` naming the first malformed field of a saved loader state; change nothing."""
    _check_dict(state)
    in_flight = state["in_flight"]
    if type(in_flight) is not bool:
        raise _refuse("in_flight", in_flight, "True or False")
    started = " (at least 1 while `in_flight` is True: the interrupted iteration had started)" if in_flight else ""
    _check_count(state, "iterations", 1 if in_flight else 0, why=started)
    _check_count(state, "epoch", optional=True)
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


def load_state_dict(loader: Any, sampler: Any, state: Any) -> None:
    validate_state(state, loader.generator)
    epoch, iterations = state["epoch"], state["iterations"]
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
    loader._resume = (state["batches"], _copy_rng(state["rng"]))
