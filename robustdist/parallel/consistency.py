"""``check_consistency``: do all ranks hold the same model? One small collective; tensors never travel.

The real "gradient misalignment" is parameters drifting apart across ranks (a rank skipped a step, misused
``no_sync``, or runs a different optimizer config); a barrier before ``optimizer.step()`` does not prevent
it. Every rank fingerprints each parameter and buffer of the unwrapped model (shape, dtype, and a CRC-32 of
its raw bytes, copied to the host in chunks for accelerator tensors), one
``all_gather_object`` carries the fingerprints, and on any difference every rank raises the same
:class:`RankDivergenceError` naming the tensors and which ranks hold which variant.

CRC-32 (zlib) rather than a cryptographic hash, for speed: it detects every change confined to 32
consecutive bits (so any single changed fp32/bf16 value, guaranteed) and any other change with probability
1 - 2**-32 per tensor; real drift touches many tensors. What a call costs, against a cryptographic hash and
against broadcasting rank 0's tensors and comparing, is benchmark P7 (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from robustdist.parallel.state_dict import unwrap_model
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import ConfigError, RankDivergenceError, ranks_phrase

__all__ = ["ConsistencyReport", "check_consistency", "tensor_digest"]

ASPECTS = ("keys", "shapes", "dtypes", "values")
SHOWN = 10
_CHUNK_BYTES = 64 << 20


@dataclass
class ConsistencyReport:
    tensors: int
    world_size: int
    seconds: float


def tensor_digest(t: torch.Tensor) -> str:
    """CRC-32 of a tensor's raw bytes (any dtype, any device, any layout), as 8 hex digits."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    crc = 0
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        chunk = flat[start:start + _CHUNK_BYTES]
        crc = zlib.crc32(memoryview(chunk.cpu().numpy() if chunk.device.type != "cpu" else chunk.numpy()), crc)
    return f"{crc:08x}"


def _fingerprints(model: nn.Module, include: tuple[str, ...], buffers: bool) -> dict[str, tuple[Any, ...]]:
    inner = unwrap_model(model)
    named: Iterable[tuple[str, torch.Tensor]] = inner.named_parameters()
    if buffers:
        named = [*named, *((n, b) for n, b in inner.named_buffers() if b is not None)]
    out = {}
    for name, t in named:
        out[name] = (
            tuple(t.shape) if "shapes" in include else None,
            str(t.dtype).replace("torch.", "") if "dtypes" in include else None,
            tensor_digest(t) if "values" in include else None,
        )
    return out


def _describe(value: tuple[Any, ...] | None) -> str:
    if value is None:
        return "absent"
    shape, dtype, digest = value
    parts = [f"shape {shape}" if shape is not None else "", dtype or "", f"crc {digest}" if digest else ""]
    return " ".join(p for p in parts if p) or "present"


def check_consistency(model: nn.Module, *, include: Iterable[str] = ASPECTS, group: Any = None,
                      buffers: bool = True) -> ConsistencyReport:
    """Compare the model across the ranks of ``group``; raise :class:`RankDivergenceError` on any difference.

    Args:
        model: any wrapped form (DDP, compile, ...); the unwrapped model is compared.
        include: which aspects to compare: "keys", "shapes", "dtypes", "values".
        group: the process group (default: the default group).
        buffers: compare buffers (BatchNorm running stats, ...) as well as parameters.
    """
    include = tuple(include)
    unknown = [a for a in include if a not in ASPECTS]
    if unknown:
        raise ConfigError(f"include={include!r} has {unknown}; expected a subset of {ASPECTS}. Fix: drop those.")
    start = time.perf_counter()
    mine = _fingerprints(model, include, buffers)
    if not _dist.is_multi(group):
        return ConsistencyReport(tensors=len(mine), world_size=1, seconds=time.perf_counter() - start)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problems = _differences(_dist.gather_objects(mine, group), "keys" in include)
    if problems:
        named = sorted({r for _, ranks in problems for r in ranks})
        shown = "\n  ".join(msg for msg, _ in problems[:SHOWN])
        more = f"\n  ... and {len(problems) - SHOWN} more tensors" if len(problems) > SHOWN else ""
        raise RankDivergenceError(
            f"{len(problems)} tensor(s) differ across the {world} ranks:\n  {shown}{more}\n"
            "Expected identical parameters and buffers on every rank. Fix: look for a rank that skipped an "
            "optimizer step, misused no_sync(), loaded a different checkpoint or runs a different optimizer "
            "config; restore from the last consistent checkpoint.",
            rank=rank, ranks=named,
        )
    return ConsistencyReport(tensors=len(mine), world_size=world, seconds=time.perf_counter() - start)


def _differences(everyone: list[dict[str, Any]], keys: bool) -> list[tuple[str, list[int]]]:
    names = sorted(set().union(*everyone)) if keys else sorted(set.intersection(*(set(e) for e in everyone)))
    problems = []
    for name in names:
        variants: dict[str, list[int]] = {}
        values: dict[str, Any] = {}
        for r, fps in enumerate(everyone):
            value = fps.get(name)
            variants.setdefault(repr(value), []).append(r)
            values[repr(value)] = value
        if len(variants) > 1:
            groups = sorted(variants.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
            text = "; ".join(f"{ranks_phrase(rs)}: {_describe(values[k])}" for k, rs in groups)
            problems.append((f"{name}: {text}", [r for _, rs in groups[1:] for r in rs]))
    return problems
