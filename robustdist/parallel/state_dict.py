"""Prefix-free state dicts and loading across any wrapping: DDP, DataParallel, FSDP1, ``torch.compile``.

``DDP(m).state_dict()`` keys start with ``module.``; ``torch.compile(m)`` adds ``_orig_mod.``; nesting
stacks them (``_orig_mod.module.0.weight``). :func:`model_state_dict` always returns the keys of the bare
model. :func:`load_model_state_dict` loads a state dict saved from any form into any form: both sides'
keys are compared after removing leading ``module.`` segments and every ``_orig_mod.`` segment.

Mismatches are never hidden: ``strict=True`` raises :class:`StateDictMismatchError` with a readable diff
(missing, unexpected, ``name: saved (3, 4) vs model (4, 3)``, dtypes); ``strict=False`` loads what matches
and returns the :class:`LoadReport`, but a *shape* mismatch still raises unless
``allow_shape_mismatch=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from robustdist.runtime import _torch_compat
from robustdist.runtime.errors import StateDictMismatchError
from robustdist.runtime.log import get_logger

__all__ = ["LoadReport", "canonical_key", "is_compiled", "load_model_state_dict", "model_state_dict", "unwrap_model"]

log = get_logger(__name__)
SHOWN = 20  # entries of each kind listed in a message; the rest are counted


def is_compiled(model: Any) -> bool:
    """True for ``torch.compile``'s ``OptimizedModule`` wrapper around a module."""
    return _torch_compat.compiled_inner(model) is not None


def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        types.append(FullyShardedDataParallel)
    except ImportError:  # a torch build without distributed
        pass
    return tuple(types)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip any nesting of DDP, DataParallel, FSDP1 and ``torch.compile`` wrappers."""
    wrappers = _wrapper_types()
    while True:
        inner = _torch_compat.compiled_inner(model)
        if inner is not None:
            model = inner
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return model


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The state dict of the unwrapped model: no ``module.`` or ``_orig_mod.`` prefixes, whatever wraps it."""
    return unwrap_model(model).state_dict()


def canonical_key(key: str) -> str:
    """``key`` without leading ``module.`` segments and without any ``_orig_mod.`` segment."""
    parts = [p for p in key.split(".") if p != _torch_compat.COMPILED_KEY_SEGMENT]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


@dataclass
class LoadReport:
    """What :func:`load_model_state_dict` loaded and what it could not."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    dtype_mismatches: list[tuple[str, str, str]] = field(default_factory=list)
    renamed: int = 0  # keys matched only after adapting prefixes

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatches or self.dtype_mismatches)

    def describe(self) -> str:
        parts = []
        for title, items in (
            ("missing from the saved state", self.missing),
            ("unexpected (not in the model)", self.unexpected),
            ("shape mismatches", [f"{n}: saved {tuple(s)} vs model {tuple(m)}" for n, s, m in self.shape_mismatches]),
            ("dtype mismatches", [f"{n}: saved {s} vs model {m}" for n, s, m in self.dtype_mismatches]),
        ):
            if items:
                shown = "\n    ".join(items[:SHOWN])
                more = f"\n    ... and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
                parts.append(f"  {len(items)} {title}:\n    {shown}{more}")
        return "\n".join(parts) or "  everything matched"


def _match(saved: Mapping[str, Any], target_keys: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """Map target key -> saved key, exactly where possible, else by canonical key."""
    mapping = {k: k for k in target_keys if k in saved}
    left_saved = [k for k in saved if k not in mapping.values()]
    by_canon: dict[str, list[str]] = {}
    for k in left_saved:
        by_canon.setdefault(canonical_key(k), []).append(k)
    missing = []
    for k in target_keys:
        if k in mapping:
            continue
        candidates = by_canon.get(canonical_key(k), [])
        if len(candidates) == 1:
            mapping[k] = candidates.pop()
        else:
            missing.append(k)
    used = set(mapping.values())
    return mapping, missing, [k for k in saved if k not in used]


def load_model_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True,
                          allow_shape_mismatch: bool = False) -> LoadReport:
    """Load ``state_dict`` (saved from any wrapped form) into ``model`` (any wrapped form)."""
    target = unwrap_model(model)
    own = target.state_dict()
    mapping, missing, unexpected = _match(state_dict, list(own))
    report = LoadReport(missing=missing, unexpected=unexpected, renamed=sum(1 for t, s in mapping.items() if t != s))
    to_load: dict[str, Any] = {}
    for name, saved_key in mapping.items():
        value, mine = state_dict[saved_key], own[name]
        if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor):
            if value.shape != mine.shape:
                report.shape_mismatches.append((name, tuple(value.shape), tuple(mine.shape)))
                continue
            if value.dtype != mine.dtype:
                report.dtype_mismatches.append((name, str(value.dtype).replace("torch.", ""),
                                                str(mine.dtype).replace("torch.", "")))
        to_load[name] = value
    if strict and not report.ok:
        raise StateDictMismatchError(
            f"the state dict does not fit {type(target).__name__} (strict=True):\n{report.describe()}\n"
            "Expected the same keys, shapes and dtypes after adapting module./_orig_mod. prefixes. Fix: load the "
            "checkpoint of this architecture, or pass strict=False to load what matches (shape mismatches still "
            "raise unless allow_shape_mismatch=True)."
        )
    if report.shape_mismatches and not allow_shape_mismatch:
        raise StateDictMismatchError(
            f"shape mismatches loading into {type(target).__name__} (never skipped silently):\n{report.describe()}\n"
            "Expected every matching key to have the model's shape. Fix: load a checkpoint of this architecture, "
            "or pass allow_shape_mismatch=True to skip those tensors and keep the model's values."
        )
    target.load_state_dict(to_load, strict=False)
    report.loaded = sorted(to_load)
    if not report.ok:
        log.warning("loaded %d tensors with mismatches (strict=False):\n%s", len(to_load), report.describe())
    return report
