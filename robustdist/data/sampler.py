"""Which sampler a distributed :func:`~robustdist.data.dataloader.safe_dataloader` loader gets, and why.

Only with ``data.auto_sampler`` (the default; ``False`` leaves every sampler exactly as given):

* **The loader already has a** ``DistributedSampler`` (as ``sampler=``, or inside ``batch_sampler=``), subclasses
  included: it is kept, the same object, with its own ``shuffle``, ``seed`` and ``drop_last``, after checking
  that its ``num_replicas``/``rank`` are this process's world size and rank (from the process group, or the
  launcher's env before one exists) and that it covers a dataset of the loader's length. A mismatch is a
  :class:`~robustdist.runtime.errors.ConfigError` naming both and the fix, in a single process too. Such a sampler can
  be built before any process group exists only with explicit ``num_replicas=``/``rank=``
  (``DistributedSampler(dataset)`` alone asks ``torch.distributed`` for them, and raises without a group).
* **No sampler of its own** (what ``DataLoader(shuffle=...)`` builds: a ``RandomSampler`` or
  ``SequentialSampler`` over the dataset) **and more than one rank**: a ``DistributedSampler`` is inserted that
  keeps the loader's shuffle intent (``shuffle=True`` shuffles, ``shuffle=False`` gives contiguous, ordered
  shards), ``data.seed`` and ``drop_last``. It is a :class:`ShardSampler`: torch's sampler, which refuses to be
  iterated by Accelerate (``accelerator.prepare(h.loader)`` would shard it a second time).
* **Any other sampler or batch sampler, and more than one rank**: robustdist cannot shard it, so it raises
  a ``ConfigError`` that says exactly what to change.
* **An** ``IterableDataset``: not sharded (a warning says how to shard the stream).

What was chosen is logged at INFO.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import FrameType
from typing import Any

from torch.utils.data import (
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from robustdist.data.checks import warn_user
from robustdist.runtime.errors import ConfigError
from robustdist.runtime.log import get_logger

log = get_logger(__name__)

_BUILD_IT = ("DistributedSampler(dataset, num_replicas=int(os.environ['WORLD_SIZE']), "
             "rank=int(os.environ['RANK'])) (torchrun's env; DistributedSampler(dataset) alone needs a process group, "
             "so build it after harden()/init_process_group), or drop sampler= and let robustdist insert one "
             "(DataLoader(dataset, shuffle=True) shuffles)")


def shuffle_intent(sampler: Sampler[Any] | None, dataset: Dataset[Any]) -> bool | None:
    """True/False when ``sampler`` is what ``DataLoader(dataset, shuffle=True/False)`` builds itself (a plain
    ``RandomSampler``/``SequentialSampler`` over ``dataset``: replaceable without losing anything); None for
    anything else. An ``IterableDataset``'s placeholder sampler counts as False."""
    if isinstance(dataset, IterableDataset):  # DataLoader's own placeholder sampler; it refuses any other
        return False
    if type(sampler) is SequentialSampler:
        return False if sampler.data_source is dataset else None
    if type(sampler) is RandomSampler:
        plain = (sampler.data_source is dataset and not sampler.replacement
                 and sampler.num_samples == len(dataset))  # the same order as num_samples=None
        return True if plain else None
    return None


class ShardSampler(DistributedSampler):  # type: ignore[type-arg]
    """The ``DistributedSampler`` robustdist inserts: torch's, unchanged, except that Accelerate driving it (its
    iteration or its ``set_epoch``) is refused; see :func:`refuse_resharding`. Ray's ``prepare_data_loader`` keeps a
    ``DistributedSampler`` as it is, so it is not refused."""

    def __iter__(self) -> Iterator[Any]:
        refuse_resharding(inspect.currentframe(), self.rank, self.num_replicas)
        return super().__iter__()

    def set_epoch(self, epoch: int) -> None:
        refuse_resharding(inspect.currentframe(), self.rank, self.num_replicas)  # Accelerate's, on every rank
        super().set_epoch(epoch)


class GuardedBatchSampler(BatchSampler):
    """The ``BatchSampler`` a robustdist loader's ``DataLoader(batch_size=...)`` built over its
    ``DistributedSampler`` (the one robustdist inserted, or the loader's own that it kept): torch's, unchanged,
    except that Accelerate iterating it is refused (:func:`refuse_resharding`)."""

    def __iter__(self) -> Iterator[list[int]]:
        sampler = self.sampler
        refuse_resharding(inspect.currentframe(), getattr(sampler, "rank", None),
                          getattr(sampler, "num_replicas", None))
        yield from super().__iter__()


def guard_batches(loader: Any) -> None:
    """Make the batch sampler ``DataLoader`` built over a ``DistributedSampler`` a :class:`GuardedBatchSampler`
    (the same object: it was built inside the loader, never the user's)."""
    batches = loader.batch_sampler
    if type(batches) is BatchSampler and batches.sampler is loader.sampler \
            and isinstance(loader.sampler, DistributedSampler):
        batches.__class__ = GuardedBatchSampler


_RESHARDERS = ("accelerate",)


def _driven_by(frame: FrameType | None) -> str | None:
    """The framework driving this sampler: the first caller outside ``torch.utils.data`` (and this module), when
    it is one of :data:`_RESHARDERS`. A loop over ``h.loader`` reaches the sampler through robustdist's loader, so it
    is never the framework's, whatever called that loop."""
    caller = frame.f_back if frame is not None else None
    for _ in range(64):
        if caller is None:
            return None
        module = str(caller.f_globals.get("__name__", ""))
        if not (module == __name__ or module == "torch.utils.data" or module.startswith("torch.utils.data.")):
            return next((m for m in _RESHARDERS if module == m or module.startswith(m + ".")), None)
        caller = caller.f_back
    return None


def refuse_resharding(frame: FrameType | None, rank: int | None, replicas: int | None) -> None:
    """Raise :class:`ConfigError` when Accelerate drives a sampler of a loader robustdist sharded:
    ``accelerator.prepare(h.loader)`` builds a loader of its own around it and shards its batches a second time
    (each rank reads a fraction of its shard, silently), and ``skip_first_batches(h.loader, n)`` reads it outside
    ``h.loader``, so robustdist's epochs and resume position do not apply. Every rank raises: Accelerate sets the
    sampler's epoch on each at the start of an iteration, before any batch."""
    if _driven_by(frame) is None:
        return
    over = f" over {replicas} ranks" if replicas else ""
    raise ConfigError(
        f"Accelerate is reading the sampler of a loader robustdist sharded{over} (h.loader, or safe_dataloader) "
        "through a loader of its own: accelerator.prepare(h.loader) would shard its batches a second time (each rank "
        "reads a fraction of its shard), and skip_first_batches(h.loader, n) would bypass robustdist's epochs and "
        "resume position; expected h.loader iterated directly. Fix: leave h.loader out of accelerator.prepare and "
        "iterate it (harden already sharded it, and h.resume continues it mid-epoch), or prepare the plain "
        "DataLoader first and give harden() the loader accelerator.prepare returned (docs/porting.md, Accelerate).",
        rank=rank)


def distributed_sampler_of(kw: dict[str, Any]) -> DistributedSampler[Any] | None:
    """The ``DistributedSampler`` among the loader's ``sampler``/``batch_sampler`` settings, or None."""
    for candidate in (kw.get("sampler"), getattr(kw.get("batch_sampler"), "sampler", None)):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None


def choose(dataset: Dataset[Any], kw: dict[str, Any], *, rank: int, world: int, seed: int, source: str) -> None:
    """Settle ``kw``'s sampler for this rank (see the module docstring); ``source`` says where ``rank`` and
    ``world`` come from, for messages."""
    if isinstance(dataset, IterableDataset):
        if world > 1:
            warn_user("an IterableDataset is not sharded automatically, so every rank would read the whole stream. "
                      "Shard inside the dataset by rank (torch.distributed.get_rank(), and get_worker_info() for "
                      "workers), and give every rank the same number of batches: uneven shards leave ranks waiting "
                      "in DDP's all-reduce (a hang).", once=("dataloader", "iterable"))
        return
    own = distributed_sampler_of(kw)
    if own is not None:
        check_distributed_sampler(own, dataset, rank=rank, world=world, source=source)
        batches = kw.get("batch_sampler")
        if type(batches) is BatchSampler and batches.sampler is own:  # the same batches, guarded (a new object)
            kw["batch_sampler"] = GuardedBatchSampler(own, batches.batch_size, batches.drop_last)
        log.info("kept the loader's %s (rank %d of %d, shuffle=%s, seed %d, drop_last=%s)", type(own).__name__,
                 own.rank, own.num_replicas, own.shuffle, own.seed, own.drop_last)
        return
    if world <= 1:
        return
    intent = shuffle_intent(kw.get("sampler"), dataset) if kw.get("batch_sampler") is None else None
    if intent is not None:  # safe_dataloader(dataset, sampler=RandomSampler(dataset)) means shuffle=True
        kw.pop("sampler")
        kw["shuffle"] = intent
    elif kw.get("sampler") is not None or kw.get("batch_sampler") is not None:
        raise _unshardable(kw, rank, world)
    shuffle = bool(kw.pop("shuffle", False))
    drop_last = bool(kw.get("drop_last", False))
    kw["sampler"] = ShardSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    log.info("inserted a DistributedSampler (rank %d of %d, shuffle=%s because the loader %s, seed %d from "
             "data.seed, drop_last=%s)", rank, world, shuffle,
             "shuffled (shuffle=True, a RandomSampler)" if shuffle else "did not shuffle (shuffle=False)",
             seed, drop_last)


def check_distributed_sampler(sampler: DistributedSampler[Any], dataset: Dataset[Any], *, rank: int, world: int,
                              source: str) -> None:
    """Raise :class:`ConfigError` unless ``sampler`` shards ``dataset`` for this rank of ``world``."""
    name = type(sampler).__name__
    found = (getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None))
    if found != (world, rank):
        raise ConfigError(
            f"the loader's {name} was built with num_replicas={found[0]}, rank={found[1]}, but this process is rank "
            f"{rank} of {world} ({source}); expected num_replicas={world}, rank={rank}, else ranks read the wrong "
            f"or overlapping shards. Fix: build it as {_BUILD_IT}; or set data.auto_sampler=False if this shard "
            "is on purpose.", rank=rank if world > 1 else None)
    covered, length = _length(getattr(sampler, "dataset", None)), _length(dataset)
    if covered is not None and length is not None and covered != length:
        raise ConfigError(
            f"the loader's {name} was built on a dataset of {covered} samples, but the loader's dataset has "
            f"{length}; expected the same dataset, else indices are missed or out of range. Fix: pass the "
            "loader's own dataset to the sampler: DistributedSampler(dataset, ...) with the dataset given to "
            "DataLoader(dataset, ...).", rank=rank if world > 1 else None)


def _unshardable(kw: dict[str, Any], rank: int, world: int) -> ConfigError:
    what = "batch_sampler" if kw.get("batch_sampler") is not None else "sampler"
    obj = kw[what]
    return ConfigError(
        f"the loader has a custom {what} ({type(obj).__name__}) and the job has {world} ranks; robustdist "
        f"cannot shard a custom {what} safely, and without sharding every rank trains on the whole dataset. Fix: "
        "make the sampler yield only this rank's indices, the way a DistributedSampler does: subclass "
        "torch.utils.data.distributed.DistributedSampler (robustdist keeps any DistributedSampler after "
        "checking its num_replicas and rank), or give your batch sampler a DistributedSampler as its sampler "
        "(BatchSampler(DistributedSampler(dataset, ...), batch_size, drop_last)); if the custom sampler only "
        "shuffles or orders, drop it and pass shuffle=True/False instead; or set data.auto_sampler=False to keep "
        "it unsharded on purpose.", rank=rank)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None
