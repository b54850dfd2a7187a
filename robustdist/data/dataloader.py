"""``safe_dataloader``: a real ``DataLoader`` with the user's settings kept and the known traps fixed.

It takes an existing ``DataLoader`` (or a ``Dataset`` plus ``DataLoader`` keyword arguments) and rebuilds it
keeping every setting: ``batch_size``, shuffle intent (a ``RandomSampler`` means shuffle), a custom
``sampler``/``batch_sampler``, ``collate_fn``, ``drop_last``, ``timeout``, ``worker_init_fn`` (chained, not
replaced), ``multiprocessing_context``, ``generator``, ``prefetch_factor``, ``persistent_workers``,
``pin_memory``, ``pin_memory_device`` and ``in_order``. Keyword arguments override the loader's.

Each fix warns once per process per cause (:class:`~robustdist.runtime.errors.RobustDistWarning`: what changed, why,
how to silence it); with ``data.strict=True`` it raises :class:`~robustdist.runtime.errors.ConfigError` instead:

1. ``persistent_workers``/``prefetch_factor`` with ``num_workers=0`` (torch raises): dropped.
2. ``pin_memory=True`` without an accelerator (torch warns every iteration): disabled. With
   ``data.pin_memory="auto"`` memory is pinned exactly when CUDA is available.
3. CUDA already initialised, workers, and the ``fork`` start method ("Cannot re-initialize CUDA in forked
   subprocess", and the fork + pin-memory-thread hang of torch #130610): ``forkserver``, after checking that
   the dataset pickles (else an error naming the attribute that does not).
4. Many loaders with ``pin_memory`` and ``persistent_workers`` in one process leak descriptors (torch
   #91252): past a threshold, a warning with the count and ``RLIMIT_NOFILE``.
5. Samplers (with ``data.auto_sampler``; see :mod:`robustdist.data.sampler`): a loader's own ``DistributedSampler``
   (built before any process group exists with explicit ``num_replicas=``/``rank=``) is kept with its shuffle,
   seed and ``drop_last`` once its rank and world size match the job's (else ``ConfigError`` with the fix).
   Distributed, map-style, no sampler of its own: a ``DistributedSampler`` is inserted keeping the loader's
   shuffle intent (``shuffle=True`` shuffles, ``shuffle=False`` shards in order), ``drop_last`` and
   ``data.seed``. A custom sampler or batch sampler cannot be sharded safely: ``ConfigError`` saying what to
   change. An ``IterableDataset`` is not sharded: a warning.
6. Epochs (see :mod:`robustdist.data.epochs` and :mod:`robustdist.data.state`): each new epoch calls
   ``sampler.set_epoch(n)``; a user's own ``set_epoch`` is respected. An iteration abandoned before the epoch
   ends (a batch-size peek ``next(iter(loader))``) does not advance the epoch: the next iteration replays the
   same order, as a plain ``DataLoader`` with ``set_epoch`` does. The position (epoch and batches consumed)
   saves and restores mid-epoch: ``state_dict()``/``load_state_dict()``.
7. Worker seeding: python ``random``, numpy and torch are seeded from (``data.seed``, rank, worker id,
   epoch), then the user's ``worker_init_fn`` runs. First a forked worker closes the listening sockets it
   inherited from its rank (the c10d store's server, gloo's): otherwise they keep their ports bound, and an
   in-process recovery's next generation cannot serve its store on the job's port while the worker lives.
8. ``/dev/shm``: the bytes in flight (workers x prefetch_factor x one measured batch) must fit its free
   space; if not, ``prefetch_factor`` and then ``num_workers`` are reduced. (The ``file_system`` sharing
   strategy would not help: it allocates in ``/dev/shm`` too.)

A single process gets the same samples in the same order as the plain ``DataLoader`` would give.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import random
import resource
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from robustdist.config.schema import DataConfig, HardenConfig, section_of
from robustdist.data import checks, epochs
from robustdist.data import sampler as _sampler
from robustdist.data import state as loader_state
from robustdist.data.checks import warn_user
from robustdist.runtime import dist as _dist
from robustdist.runtime import group_sockets
from robustdist.runtime._data_compat import BaseDataLoaderIter, LoaderHooks
from robustdist.runtime.errors import ConfigError
from robustdist.runtime.log import get_logger
from robustdist.runtime.topology import Topology, detect_topology

__all__ = ["SafeDataLoader", "safe_dataloader"]

log = get_logger(__name__)
LEAK_WARN_THRESHOLD = 8  # loaders with pin_memory + persistent_workers per process before the fd-leak warning
_pinned_persistent = 0
_count_lock = threading.Lock()

_KEYS = ("batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory",
         "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
         "persistent_workers", "pin_memory_device", "in_order")


class WorkerSeeder:
    """``worker_init_fn`` seeding python ``random``, numpy and torch from (seed, rank, worker id, epoch),
    then calling the user's function. Picklable, so it works with spawn and forkserver workers."""

    def __init__(self, seed: int, rank: int, user_fn: Callable[[int], object] | None):
        self.seed, self.rank, self.user_fn, self.epoch = seed, rank, user_fn, 0

    def worker_seed(self, worker_id: int) -> int:
        mixed = np.random.SeedSequence([self.seed, self.rank, worker_id, self.epoch]).generate_state(2, np.uint64)
        return int(mixed[0]) & ((1 << 63) - 1)

    def __call__(self, worker_id: int) -> None:
        if torch.utils.data.get_worker_info() is not None:  # in a worker, never in the rank itself
            group_sockets.close_listeners()  # a forked worker's copies of the rank's listeners (the store's, gloo's)
        seed = self.worker_seed(worker_id)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        torch.manual_seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class SafeDataLoader(LoaderHooks, DataLoader):
    """A real ``DataLoader`` that starts a new sampler epoch at each new epoch (unless the user did), replays an
    epoch whose iteration was abandoned, and whose position can be saved and restored mid-epoch
    (``state_dict``/``load_state_dict``; see :mod:`robustdist.data.state` for exactly what is restored)."""

    _seeder: WorkerSeeder | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _sampler.guard_batches(self)
        self._pos = epochs.Position()

    def rd_index_sampler(self, inner: Any) -> epochs.PositionedSampler:
        return epochs.PositionedSampler(self._pos, self.generator, inner)

    def rd_new_iterator(self) -> BaseDataLoaderIter:
        return epochs.new_iterator(self)

    def __iter__(self) -> BaseDataLoaderIter:
        _refuse_framework_iteration(inspect.currentframe())
        sampler = _epoch_sampler(self)
        start = epochs.begin_iteration(self, sampler)
        if self._seeder is not None:
            self._seeder.epoch = sampler.epoch if sampler is not None else self._pos.epochs - 1
        if start is None:
            iterator = super().__iter__()
        else:  # creating the iterator draws its base seed: keep the global RNG where the checkpoint put it
            rng = torch.get_rng_state()
            iterator = super().__iter__()
            torch.set_rng_state(rng)
        epochs.iteration_started(self._pos, iterator)
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: epoch, epochs started, batches consumed in the current one, and the RNG
        state that iteration's sampler started from. Plain tensors and data (checkpoint-safe)."""
        return loader_state.state_dict(self, _epoch_sampler(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter(self)`` continue where the saved loader was: same epoch, the batches it had not
        yet yielded, in the same order."""
        loader_state.load_state_dict(self, _epoch_sampler(self), state)


def _refuse_framework_iteration(frame: Any) -> None:
    """Raise when Lightning Fabric's loader wrapper (``fabric.setup_dataloaders(h.loader)``) iterates this loader:
    it sets the sampler's epoch from its own count of iterations, which restarts at 0 after a resume."""
    caller = frame.f_back if frame is not None else None
    module = str(caller.f_globals.get("__name__", "")) if caller is not None else ""
    if any(module == m or module.startswith(m + ".") for m in ("lightning.fabric", "lightning_fabric")):
        raise ConfigError(
            "a loader robustdist built (h.loader, safe_dataloader) was given to fabric.setup_dataloaders: Fabric sets "
            "its sampler's epoch from its own count of iterations, which restarts at 0 after a resume, so a resumed "
            "run would read another epoch's order; expected the loader iterated directly. Fix: iterate h.loader and "
            "move batches with fabric.to_device(batch) (docs/porting.md, Fabric).", rank=_dist.error_rank())


def _epoch_sampler(loader: DataLoader[Any]) -> epochs.EpochSampler | None:
    for candidate in (loader.sampler, getattr(loader.batch_sampler, "sampler", None), loader.batch_sampler):
        if candidate is not None and hasattr(candidate, "set_epoch") and hasattr(candidate, "epoch"):
            return candidate  # type: ignore[no-any-return]
    return None


def _settings(source: DataLoader[Any] | Dataset[Any], overrides: dict[str, Any]) -> tuple[Dataset[Any], dict[str, Any]]:
    """The dataset and the DataLoader keyword arguments to rebuild with (the user's, overrides applied)."""
    unknown = sorted(set(overrides) - set(_KEYS))
    if unknown:
        raise ConfigError(f"safe_dataloader got unknown keyword argument(s) {unknown}; expected DataLoader "
                          f"arguments ({', '.join(_KEYS)}). Fix: check the spelling.")
    if not isinstance(source, DataLoader):
        if isinstance(overrides.get("worker_init_fn"), WorkerSeeder):
            overrides = {**overrides, "worker_init_fn": overrides["worker_init_fn"].user_fn}
        return source, dict(overrides)
    kw: dict[str, Any] = {k: getattr(source, k) for k in _KEYS if k not in ("shuffle", "sampler", "batch_sampler")
                          and hasattr(source, k)}
    auto_batch = type(source.batch_sampler) in (BatchSampler, _sampler.GuardedBatchSampler) \
        and source.batch_sampler.sampler is source.sampler
    intent = _sampler.shuffle_intent(source.sampler, source.dataset)
    if source.batch_sampler is not None and not auto_batch:
        kw.update(batch_sampler=source.batch_sampler, batch_size=1, drop_last=False)
    elif intent is None:
        kw["sampler"] = source.sampler
    else:  # DataLoader built this sampler from shuffle=True/False: rebuilding from the flag loses nothing
        kw["shuffle"] = intent
    if source.num_workers == 0:
        kw.pop("prefetch_factor", None)
    kw.update(overrides)
    if "batch_sampler" in kw:  # DataLoader forbids batch_size/drop_last beside a batch_sampler
        for key in ("batch_size", "drop_last", "shuffle", "sampler"):
            kw.pop(key, None)
    if isinstance(kw.get("worker_init_fn"), WorkerSeeder):  # a loader robustdist already built: no double chain
        kw["worker_init_fn"] = kw["worker_init_fn"].user_fn
    return source.dataset, kw


def _fix(strict: bool, cause: str, message: str) -> None:
    if strict:
        raise ConfigError(message + " (data.strict=True: robustdist raises instead of fixing)")
    warn_user(message, once=("dataloader", cause))


def safe_dataloader(loader_or_dataset: DataLoader[Any] | Dataset[Any],
                    config: DataConfig | HardenConfig | None = None, *, cfg: DataConfig | HardenConfig | None = None,
                    shm_path: str = "/dev/shm", shm_free_bytes: int | None = None,
                    **dataloader_kwargs: Any) -> SafeDataLoader:
    """Rebuild ``loader_or_dataset`` as a :class:`SafeDataLoader` (see the module docstring).

    Args:
        loader_or_dataset: a ``DataLoader``, or a ``Dataset`` (then ``dataloader_kwargs`` as for ``DataLoader``).
        config: a :class:`~robustdist.config.DataConfig`, or a :class:`~robustdist.config.HardenConfig` (its
            ``data`` section is used), or None for the defaults. A dict or YAML path still works, with a
            ``DeprecationWarning``.
        cfg: the same as ``config`` (this argument's earlier name).
        shm_path: where workers' shared memory lives (for the capacity check).
        shm_free_bytes: free bytes to assume there instead of measuring (tests, unusual mounts).
        dataloader_kwargs: ``DataLoader`` arguments; they override the given loader's.
    """
    if cfg is not None:
        if config is not None:
            raise ConfigError("safe_dataloader got both config= (the second argument) and cfg=; expected one. Fix: "
                              "pass the config once, e.g. safe_dataloader(loader, cfg.data).")
        config = cfg
    data = section_of(config, DataConfig, "safe_dataloader")
    dataset, kw = _settings(loader_or_dataset, dataloader_kwargs)
    strict = data.strict
    _fix_worker_args(kw, strict)
    _fix_pinning(kw, data.pin_memory, strict, explicit="pin_memory" in dataloader_kwargs)
    topo = detect_topology()
    _fix_start_method(dataset, kw, strict)
    if data.auto_sampler:
        _sampler.choose(dataset, kw, rank=topo.rank, world=topo.world_size, seed=data.seed, source=_source(topo))
    seeder = WorkerSeeder(data.seed, topo.rank, kw.get("worker_init_fn"))
    if kw.get("num_workers", 0) > 0:
        kw["worker_init_fn"] = seeder
        if data.check_shm:
            _fix_shm(dataset, kw, strict, shm_path, shm_free_bytes)
    loader = SafeDataLoader(dataset, **kw)
    loader._seeder = seeder if kw.get("num_workers", 0) > 0 else None
    _count_leak_prone(loader)
    return loader


def _source(topo: Topology) -> str:
    """Where this process's rank and world size come from, for messages."""
    if _dist.is_up():
        return "from the process group"
    if topo.launcher == "single":
        return "a single process: no process group and no launcher environment"
    return f"from the {topo.launcher} launcher's environment; no process group exists yet"


def _fix_worker_args(kw: dict[str, Any], strict: bool) -> None:
    if kw.get("num_workers", 0) == 0:
        dropped = [k for k in ("persistent_workers", "prefetch_factor") if kw.get(k) not in (None, False)]
        if dropped:
            _fix(strict, "no-workers", f"dropped {', '.join(dropped)}: they need num_workers > 0 and torch's "
                 "DataLoader raises ValueError without workers. Silence: pass them only with num_workers > 0.")
            for k in dropped:
                kw.pop(k)


def _accelerator_available() -> bool:
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def _fix_pinning(kw: dict[str, Any], mode: bool | str, strict: bool, *, explicit: bool) -> None:
    if not explicit:  # an explicit pin_memory= argument wins over data.pin_memory
        if mode == "auto":
            kw["pin_memory"] = bool(kw.get("pin_memory")) or torch.cuda.is_available()
        else:
            kw["pin_memory"] = bool(mode)
    if kw.get("pin_memory") and not kw.get("pin_memory_device") and not _accelerator_available():
        _fix(strict, "pin-no-accelerator", "disabled pin_memory: no accelerator is available, so pinning only "
             "costs memory and torch warns on every iteration. Silence: pin_memory=False, or data.pin_memory='auto'.")
        kw["pin_memory"] = False


def _fix_start_method(dataset: Dataset[Any], kw: dict[str, Any], strict: bool) -> None:
    if kw.get("num_workers", 0) == 0 or not checks.cuda_initialized():
        return
    ctx = kw.get("multiprocessing_context")
    method = ctx if isinstance(ctx, str) else ctx.get_start_method() if ctx is not None else mp.get_start_method()
    if method != "fork":
        return
    checks.require_picklable(dataset, "the dataset")
    _fix(strict, "fork-after-cuda", "switched the workers' start method from fork to forkserver: CUDA is already "
         "initialised in this process, and forked workers fail ('Cannot re-initialize CUDA in forked subprocess') "
         "or hang with the pin-memory thread (torch #130610). Silence: pass multiprocessing_context='forkserver'.")
    kw["multiprocessing_context"] = "forkserver"


def _fix_shm(dataset: Dataset[Any], kw: dict[str, Any], strict: bool, path: str, free: int | None) -> None:
    batch_bytes = checks.batch_bytes(dataset, kw)
    if batch_bytes is None:
        return
    free = checks.shm_free(path) if free is None else free
    workers, prefetch = kw["num_workers"], kw.get("prefetch_factor") or 2
    fitted = checks.fit_in_flight(batch_bytes, free, workers, prefetch)
    if fitted == (workers, prefetch):
        return
    new_workers, new_prefetch = fitted
    need = workers * prefetch * batch_bytes
    _fix(strict, "shm", f"{workers} workers x prefetch_factor {prefetch} x {_human(batch_bytes)} per batch "
         f"= {_human(need)} in flight does not fit half of the {_human(free)} free in {path} (workers die "
         f"with 'Bus error'); reduced to num_workers={new_workers}, prefetch_factor={new_prefetch}. Fix the cause: "
         "give the container more shared memory (docker run --shm-size=8g, or --ipc=host).")
    kw["num_workers"] = new_workers
    if new_workers == 0:
        for k in ("prefetch_factor", "persistent_workers", "worker_init_fn", "multiprocessing_context"):
            kw.pop(k, None)
    else:
        kw["prefetch_factor"] = new_prefetch


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _count_leak_prone(loader: DataLoader) -> None:
    global _pinned_persistent
    if not (loader.pin_memory and loader.persistent_workers):
        return
    with _count_lock:
        _pinned_persistent += 1
        count = _pinned_persistent
    if count > LEAK_WARN_THRESHOLD:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        warn_user(f"{count} DataLoaders with pin_memory=True and persistent_workers=True were created in this process "
                  f"(pid {os.getpid()}); each recreation leaks file descriptors (torch #91252) and RLIMIT_NOFILE is "
                  f"{soft}. Fix: create the loader once and reuse it across epochs.", once=("dataloader", "fd-leak"))
