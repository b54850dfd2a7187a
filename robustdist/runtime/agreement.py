"""Cross-rank agreement: every rank's small fingerprint, gathered once, checked identically everywhere.

:func:`local_fingerprint` describes this rank (host, versions, config fingerprint, backend, visible devices,
device and physical GPU, ``NCCL_*``/``GLOO_*`` env). :func:`check_agreement` is a pure function of all the
ranks' fingerprints, so every rank reaches the same verdict and raises the same error:

* errors: a torch/python/robustdist version mismatch; a config-fingerprint mismatch; on one host, ranks
  using CUDA with different ``CUDA_VISIBLE_DEVICES`` (unless each rank sees exactly one GPU, the
  per-process-isolation pattern of ``srun --gpus-per-task=1``); on one host, two ranks on one physical GPU
  (NCCL's "Duplicate GPU detected");
* warnings: ``NCCL_*`` variables that differ between ranks of one host.
"""

from __future__ import annotations

import os
import platform
import socket
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from robustdist._version import __version__
from robustdist.runtime.errors import ranks_phrase

__all__ = ["check_agreement", "local_fingerprint"]

_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")


def gpu_identity(device: torch.device) -> str | None:
    """A physical id for a CUDA device (its UUID when torch exposes it), None for non-CUDA devices.

    This is the only device discovery in the agreement path; tests fake it to simulate GPUs on CPU.
    """
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else []
    return entries[index] if index < len(entries) else str(index)


def local_fingerprint(*, rank: int, backend: str, device: torch.device, config_fingerprint: str) -> dict[str, Any]:
    """This rank's fingerprint: a small dict of plain types, cheap to ``all_gather_object``."""
    return {
        "rank": rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "robustdist": __version__,
        "config": config_fingerprint,
        "backend": backend,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": str(device),
        "gpu": gpu_identity(device),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
    }


def _groups(values: Mapping[int, Any]) -> list[tuple[Any, list[int]]]:
    """Ranks grouped by value, the largest group first (ties: the group holding the lowest rank)."""
    by_value: dict[str, tuple[Any, list[int]]] = {}
    for rank, value in sorted(values.items()):
        by_value.setdefault(repr(value), (value, []))[1].append(rank)
    return sorted(by_value.values(), key=lambda g: (-len(g[1]), g[1][0]))


def _mismatch(what: str, values: Mapping[int, Any], fix: str) -> tuple[str, set[int]] | None:
    groups = _groups(values)
    if len(groups) < 2:
        return None
    shown = "; ".join(f"{ranks_phrase(r)}: {v!r}" for v, r in groups)
    odd = {r for _, ranks in groups[1:] for r in ranks}
    return f"{what} differs across ranks ({shown}); expected one value on every rank. Fix: {fix}", odd


def check_agreement(fingerprints: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[str, set[int]]], list[str]]:
    """Return ``(errors, warnings)``; each error is ``(message, ranks named)``. Pure and deterministic."""
    errors: list[tuple[str, set[int]]] = []
    warnings: list[str] = []
    by_rank = {int(fp["rank"]): fp for fp in fingerprints}
    for key, fix in (
        ("torch", "install the same torch build on every node (pin it in the image)."),
        ("python", "use the same Python on every node."),
        ("robustdist", "install the same robustdist version on every node."),
        ("config", "give every rank the same config (a rank-dependent value or a stale file on one node?)."),
    ):
        found = _mismatch(f"the {key} {'fingerprint' if key == 'config' else 'version'}",
                          {r: fp.get(key) for r, fp in by_rank.items()}, fix)
        if found:
            errors.append(found)
    hosts: dict[str, list[int]] = defaultdict(list)
    for r, fp in sorted(by_rank.items()):
        hosts[str(fp.get("hostname"))].append(r)
    for host, ranks in hosts.items():
        _check_host(host, {r: by_rank[r] for r in ranks}, errors, warnings)
    return errors, warnings


def _check_host(host: str, fps: Mapping[int, Mapping[str, Any]], errors: list[tuple[str, set[int]]],
                warnings: list[str]) -> None:
    cuda = {r: fp for r, fp in fps.items() if str(fp.get("device", "")).startswith("cuda")}
    visible = {r: fp.get("cuda_visible_devices") for r, fp in cuda.items()}
    isolated = all(v is not None and len([e for e in v.split(",") if e.strip()]) == 1 for v in visible.values())
    if not isolated:
        found = _mismatch(f"CUDA_VISIBLE_DEVICES on host {host}", visible,
                          "export one CUDA_VISIBLE_DEVICES for the whole node and pick the GPU with LOCAL_RANK, "
                          "or give each rank exactly one GPU. Otherwise the same ordinal means different GPUs "
                          "('invalid device ordinal').")
        if found:
            errors.append(found)
    owners: dict[str, list[int]] = defaultdict(list)
    for r, fp in cuda.items():
        if fp.get("gpu") is not None:
            owners[str(fp["gpu"])].append(r)
    for gpu, ranks in sorted(owners.items()):
        if len(ranks) > 1:
            errors.append((
                f"{ranks_phrase(ranks)} on host {host} use the same physical GPU {gpu}; expected one GPU per rank "
                "(NCCL fails with 'Duplicate GPU detected'). Fix: call torch.cuda.set_device(LOCAL_RANK) before "
                "init (safe_init_process_group does), and launch at most one rank per GPU.",
                set(ranks),
            ))
    env_keys = sorted({k for fp in fps.values() for k in fp.get("env", {}) if k.startswith("NCCL_")})
    for key in env_keys:
        found = _mismatch(f"{key} on host {host}", {r: fp.get("env", {}).get(key) for r, fp in fps.items()},
                          f"export the same {key} for every rank of the node.")
        if found:
            warnings.append(found[0])
