"""Probes used by ``safe_dataloader``: CUDA state, picklability, batch size in bytes, /dev/shm space; and
:func:`warn_user`, the loader modules' warning, blamed on the user's line."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from collections.abc import Hashable
from typing import Any

import torch

from robustdist.runtime.errors import ConfigError
from robustdist.runtime.log import PACKAGE_DIR as _PACKAGE
from robustdist.runtime.log import user_stacklevel, warn


def _in_package(depth: int) -> bool:
    """Whether the frame ``depth`` levels above the caller (0: the caller itself) is robustdist's own code."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:  # the stack ends inside robustdist
        return False
    return os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE)


def warn_user(message: str, *, once: Hashable | None = None) -> bool:
    """:func:`robustdist.runtime.log.warn`, pointing at the first frame outside robustdist (the user's line that called
    ``safe_dataloader``, ``harden``, ``iter(loader)``, ...), wherever in robustdist it is called from."""
    level = user_stacklevel()
    if _in_package(level - 1):  # warn(stacklevel=level) would still blame robustdist: one frame further
        level += 1
    return warn(message, once=once, stacklevel=level)


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (forked workers then cannot use it). Tests patch this."""
    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())


def _unpicklable_path(obj: Any, path: str, depth: int = 0) -> str | None:
    try:
        pickle.dumps(obj)
        return None
    except Exception as e:  # noqa: BLE001 - any pickling failure is what we are looking for
        reason = f"{type(e).__name__}: {e}"
    if depth < 3:
        attrs = getattr(obj, "__dict__", None)
        items = attrs.items() if isinstance(attrs, dict) else ()
        for name, value in items:
            found = _unpicklable_path(value, f"{path}.{name}", depth + 1)
            if found:
                return found
    return f"{path} ({type(obj).__name__}; {reason})"


def require_picklable(obj: Any, what: str) -> None:
    """Raise ConfigError naming the first attribute of ``obj`` that does not pickle."""
    found = _unpicklable_path(obj, what)
    if found:
        raise ConfigError(
            f"{what} must pickle to reach forkserver/spawn workers, but {found} does not. Fix: open files, "
            "connections and locks lazily in the worker (in __getitem__ or a worker_init_fn) instead of in "
            "__init__, or use num_workers=0."
        )


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    nbytes = getattr(obj, "nbytes", None)  # numpy arrays
    return int(nbytes) if isinstance(nbytes, int) else 0


def batch_bytes(dataset: Any, kw: dict[str, Any]) -> int | None:
    """Bytes of one collated batch, measured on the dataset's first samples; None when it cannot be measured
    (an iterable dataset, a custom batch sampler, an empty dataset)."""
    from torch.utils.data import IterableDataset
    from torch.utils.data import default_collate

    batch_size = kw.get("batch_size", 1)
    if isinstance(dataset, IterableDataset) or kw.get("batch_sampler") is not None or not batch_size:
        return None
    try:
        n = min(int(batch_size), len(dataset))
        if n == 0:
            return None
        samples = [dataset[i] for i in range(n)]
        collate = kw.get("collate_fn") or default_collate
        return _nbytes(collate(samples))
    except Exception:  # a dataset that cannot be indexed this way: skip the check rather than fail the user
        return None


def shm_free(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def fit_in_flight(batch_bytes: int, free: int, workers: int, prefetch: int, budget: float = 0.5) -> tuple[int, int]:
    """The largest (workers, prefetch_factor) at or below the given ones whose bytes in flight fit in
    ``budget`` of the free space: prefetch is reduced first (throughput costs less), then workers; (0, 0)
    when even one batch does not fit."""
    allowed = free * budget
    if workers * prefetch * batch_bytes <= allowed:
        return workers, prefetch
    for w in range(workers, 0, -1):
        for p in range(prefetch, 0, -1):
            if w * p * batch_bytes <= allowed:
                return w, p
    return 0, 0
