"""``ray_memory_plan``: size Ray's object store so that it, CPU offload and the workers fit in the node's RAM.

Ray's default object store (:func:`ray_default_object_store`, the same arithmetic as Ray's
``resolve_object_store_memory``) is 30% of the memory *available* when the node starts, capped at 200 GB and
by ``/dev/shm``. ZeRO/FSDP CPU offload holds parameters, gradients and optimizer states in host RAM, pinned
host buffers add more, and the worker processes have their own heaps (the Python/torch processes: CUDA
context, dataloader, activations copied to the host). None of it is allocated yet when Ray sizes its store,
so together they can exceed the node and get the raylet OOM-killed. So can robustdist's in-memory checkpoint
tier (``/dev/shm`` is RAM): ``local_checkpoint_bytes`` is what it holds on the node
(:func:`robustdist.checkpoint.local.tier.node_need`, ``(checkpoint.local_keep_last + 1)`` times the copies
the node holds). The plan, per node::

    usable        = total_ram - headroom * total_ram - offload_bytes - pinned_bytes - worker_heap_bytes
                    - local_checkpoint_bytes
    object_store  = min(ray_default_object_store(), usable)                      (by default)
    object_store  = min(object_store_fraction * total_ram, usable)               (an explicit fraction)

The store is never larger than Ray's own default unless ``object_store_fraction`` asks for more, and then
``plan.explanation`` says so. It raises :class:`~robustdist.runtime.errors.ConfigError` listing every term and the
shortfall when ``usable`` is below Ray's minimum object store (75 MiB). ``total_ram`` defaults to the smaller
of physical memory and the cgroup (container) limit, as Ray reads it.

Offload per node (:func:`estimate_offload_bytes`): with ``P``, ``G`` and ``S`` the bytes of the parameters,
their gradients and the optimizer states (Adam: two per parameter), each rank holds
``ceil(P / shards) + ceil(G / shards) + ceil(S / shards)`` and the node ``ranks_per_node`` times that.
``shards`` is the number of ranks the offloaded state is sharded over: a fp32 model of N parameters with Adam
is 16 N bytes; FSDP ``FULL_SHARD`` or ZeRO-3 with CPU offload on 2 nodes of 8 GPUs is ``ranks_per_node=8,
shards=16`` (each node holds half of 16 N: 8 N bytes); FSDP ``HYBRID_SHARD`` (sharded within a node) is
``ranks_per_node=8, shards=8`` (each node holds 16 N); unsharded offload is ``shards=1``.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from robustdist.runtime.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["MemoryPlan", "estimate_offload_bytes", "ray_available_memory", "ray_default_object_store",
           "ray_memory_plan", "system_ram"]

# Ray's constants (its private ray_constants module), the same names and values.
RAY_DEFAULT_FRACTION = 0.3                 # DEFAULT_OBJECT_STORE_MEMORY_PROPORTION
RAY_MAX_OBJECT_STORE = 200 * 10**9         # DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES
RAY_MIN_OBJECT_STORE = 75 * 2**20          # OBJECT_STORE_MINIMUM_MEMORY_BYTES
RAY_SHM_CAP_FLOOR = 10**10                 # REQUIRE_SHM_SIZE_THRESHOLD
RAY_MAC_LIMIT = 2 * 2**30                  # MAC_DEGRADED_PERF_MMAP_SIZE_LIMIT
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}
_CGROUP_V1, _CGROUP_V2 = "/sys/fs/cgroup/memory/", "/sys/fs/cgroup/"


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (what psutil reads)."""
    info = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].isdigit():
            info[fields[0].rstrip(":")] = int(fields[1]) * 1024
    return info


def system_ram() -> int:
    """Total memory as Ray's ``get_system_memory`` reads it: ``MemTotal``, or the cgroup v1 (else v2) memory
    limit when that is smaller (containers)."""
    ram = _meminfo().get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _read(_CGROUP_V1 + "memory.limit_in_bytes")
    if limit is None:
        limit = _read(_CGROUP_V2 + "memory.max")
    if limit is not None and limit.strip().isdigit():
        ram = min(ram, int(limit.strip()))
    return ram


def _cgroup_used(stat_path: str, usage_path: str, inactive_key: str, active_key: str) -> int | None:
    """Ray's ``get_cgroup_used_memory``: usage minus the (in)active file cache, ``None`` when a figure is
    missing. Keys match as Ray matches them (``"key "`` inside the line, the inactive key first)."""
    stat, usage = _read(stat_path), _read(usage_path)
    if stat is None or usage is None:
        return None
    inactive = active = -1
    for line in stat.splitlines():
        if f"{inactive_key} " in line:
            inactive = int(line.split()[1])
        elif f"{active_key} " in line:
            active = int(line.split()[1])
    if inactive == -1 or active == -1 or not usage.strip().lstrip("-").isdigit():
        return None
    return int(usage.strip()) - inactive - active


def ray_available_memory() -> int:
    """The memory Ray counts as available on this node: its ``estimate_available_memory``, i.e.
    ``get_system_memory() - get_used_memory()``. Used memory is the cgroup's (v1, else v2) usage minus its file
    cache when those files exist, else psutil's ``used`` (``MemTotal - MemAvailable``)."""
    used = None
    if os.path.exists(_CGROUP_V1 + "memory.usage_in_bytes") and os.path.exists(_CGROUP_V1 + "memory.stat"):
        used = _cgroup_used(_CGROUP_V1 + "memory.stat", _CGROUP_V1 + "memory.usage_in_bytes",
                            "total_inactive_file", "total_active_file")
    elif os.path.exists(_CGROUP_V2 + "memory.current") and os.path.exists(_CGROUP_V2 + "memory.stat"):
        used = _cgroup_used(_CGROUP_V2 + "memory.stat", _CGROUP_V2 + "memory.current", "inactive_file", "active_file")
    if used is None:
        info = _meminfo()
        total = info.get("MemTotal", 0)
        avail = info.get("MemAvailable") or info.get("MemFree", 0) + info.get("Buffers", 0) + info.get("Cached", 0)
        used = total - min(max(avail, 0), total)
    return system_ram() - used


def _shm_free() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bsize * st.f_bavail


def _env(name: str, default: float, kind: type) -> Any:
    try:
        return kind(os.environ[name])
    except (KeyError, ValueError):
        return default


def _check_bytes(name: str, value: Any, *, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise ConfigError(f"{name}={value!r}; expected an int number of bytes {'> 0' if positive else '>= 0'}. "
                          f"Fix: pass {name} in bytes, or leave it out to read it from this node.")
    return value


def _proportion() -> float:
    return _env("RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION", RAY_DEFAULT_FRACTION, float)


def _resolve(available: int, shm: int | None, *, linux: bool, darwin: bool) -> int:
    """``resolve_object_store_memory``'s arithmetic for a node with ``available`` bytes and ``shm`` free
    ``/dev/shm`` bytes (``None``: not known, no /dev/shm cap)."""
    cap = _env("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", RAY_MAX_OBJECT_STORE, int)
    if linux and shm is not None:
        cap = min(cap, max(RAY_SHM_CAP_FLOOR, int(shm * 0.95)))
    store = int(available * _proportion())
    if darwin:
        store = min(store, RAY_MAC_LIMIT)
    return min(store, cap)


def _default_for(total_ram: int | None, available_ram: int | None, shm_bytes: int | None) -> tuple[int, int]:
    """``(Ray's default, the available memory it was computed from)``; see :func:`ray_default_object_store`."""
    if total_ram is not None:
        _check_bytes("total_ram", total_ram, positive=True)
    if available_ram is not None:
        _check_bytes("available_ram", available_ram, positive=True)
    if shm_bytes is not None:
        _check_bytes("shm_bytes", shm_bytes)
    if total_ram is None and available_ram is None:  # this node, read as Ray reads it
        linux = sys.platform in ("linux", "linux2")
        available = ray_available_memory()
        shm = shm_bytes if shm_bytes is not None else (_shm_free() if linux else None)
        return _resolve(available, shm, linux=linux, darwin=sys.platform == "darwin"), available
    if available_ram is None:
        available = int(total_ram)  # type: ignore[arg-type]
    else:
        available = available_ram if total_ram is None else min(available_ram, total_ram)
    return _resolve(available, shm_bytes, linux=True, darwin=False), available


def ray_default_object_store(total_ram: int | None = None, available_ram: int | None = None, *,
                             shm_bytes: int | None = None) -> int:
    """The ``object_store_memory`` Ray chooses when it is not given one (Ray 2.x, without importing ray).

    Mirrors Ray's private ``resolve_object_store_memory(estimate_available_memory())``, as Ray's
    ``ResourceAndLabelSpec`` calls it when a node starts: ``DEFAULT_OBJECT_STORE_MEMORY_PROPORTION`` (0.3) of
    the available memory, capped at ``DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES`` (200 GB) and, on Linux, at
    ``max(REQUIRE_SHM_SIZE_THRESHOLD, 0.95 * free /dev/shm)`` (10 GB at least); on macOS at 2 GiB
    (``MAC_DEGRADED_PERF_MMAP_SIZE_LIMIT``). The ``RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION`` and
    ``RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES`` environment overrides are honoured as Ray honours them. Ray's
    opt-in resource isolation (system-reserved memory) is not mirrored: pass ``available_ram`` for it.

    Called with no figures it reads this node as Ray does (:func:`ray_available_memory`, free ``/dev/shm``).
    ``total_ram`` and/or ``available_ram`` describe a (Linux) node instead: available defaults to
    ``total_ram`` (a node where nothing else runs yet), and ``/dev/shm`` caps only when ``shm_bytes`` (its free
    bytes) is given.
    """
    return _default_for(total_ram, available_ram, shm_bytes)[0]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    """A node's memory plan. ``ray_default`` is Ray's own default object store for the node (``None``: not
    known), ``available_ram`` the available memory it was computed from, ``object_store_fraction`` the
    fraction the caller asked for (``None``: Ray's default)."""

    total_ram: int
    headroom_bytes: int
    offload_bytes: int
    pinned_bytes: int
    object_store_memory: int
    local_checkpoint_bytes: int = 0
    worker_heap_bytes: int = 0
    ray_default: int | None = None
    available_ram: int | None = None
    object_store_fraction: float | None = None

    @property
    def usable_bytes(self) -> int:
        return (self.total_ram - self.headroom_bytes - self.offload_bytes - self.pinned_bytes
                - self.worker_heap_bytes - self.local_checkpoint_bytes)

    @property
    def explanation(self) -> str:
        """Every term, the usable memory, Ray's default and why the object store is what it is."""
        terms = _terms(self.total_ram, self.headroom_bytes, None, self.offload_bytes, self.pinned_bytes,
                       self.worker_heap_bytes, self.local_checkpoint_bytes)
        text = f"{terms} = usable {_gib(self.usable_bytes)}; object store {_gib(self.object_store_memory)}"
        if self.ray_default is None:
            return text
        of = ""
        if self.available_ram:
            share = _proportion()
            capped = ", capped" if self.ray_default < int(self.available_ram * share) else ""
            of = f" ({share:.0%} of available RAM {_gib(self.available_ram)}{capped})"
        default = f"Ray's default {_gib(self.ray_default)}{of}"
        asked = self.object_store_fraction
        if self.object_store_memory > self.ray_default:
            why = f"larger than {default} because object_store_fraction={asked} was asked"
        elif self.object_store_memory == self.usable_bytes and self.object_store_memory < self.ray_default:
            why = f"all the usable RAM, below {default}"
        elif asked is not None:
            why = f"object_store_fraction={asked} of total RAM, not above {default}"
        else:
            why = default
        return f"{text}: {why}"

    def ray_init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.init`` (or ``ray start --object-store-memory``)."""
        return {"object_store_memory": self.object_store_memory}


def _terms(ram: int, head: int, headroom: float | None, offload: int, pinned: int, heap: int, ckpt: int) -> str:
    share = f" ({headroom:.0%})" if headroom is not None else ""
    tier = f" - in-memory checkpoints {_gib(ckpt)}" if ckpt else ""
    return (f"total RAM {_gib(ram)} - headroom {_gib(head)}{share} - CPU offload {_gib(offload)} - pinned buffers "
            f"{_gib(pinned)} - worker heaps {_gib(heap)}{tier}")


def ray_memory_plan(*, total_ram: int | None = None, available_ram: int | None = None, offload_bytes: int = 0,
                    pinned_bytes: int = 0, worker_heap_bytes: int = 0, object_store_fraction: float | None = None,
                    headroom: float = 0.1, local_checkpoint_bytes: int = 0,
                    shm_bytes: int | None = None) -> MemoryPlan:
    """Compute a safe ``object_store_memory`` (see the module docstring).

    ``worker_heap_bytes``: what the worker processes themselves use on the node (ranks per node times the
    per-process heap). ``total_ram``/``available_ram``/``shm_bytes`` describe the node as for
    :func:`ray_default_object_store`; left out, they are read from this node as Ray reads them.
    """
    ram = system_ram() if total_ram is None else int(total_ram)
    fraction = RAY_DEFAULT_FRACTION if object_store_fraction is None else float(object_store_fraction)
    for name, value, ok in (("total_ram", ram, ram > 0), ("offload_bytes", offload_bytes, offload_bytes >= 0),
                            ("pinned_bytes", pinned_bytes, pinned_bytes >= 0),
                            ("worker_heap_bytes", worker_heap_bytes, worker_heap_bytes >= 0),
                            ("local_checkpoint_bytes", local_checkpoint_bytes, local_checkpoint_bytes >= 0),
                            ("available_ram", available_ram, available_ram is None or available_ram > 0),
                            ("object_store_fraction", fraction, 0 < fraction <= 1),
                            ("headroom", headroom, 0 <= headroom < 1)):
        if not ok:
            raise ConfigError(f"{name}={value!r} is out of range; expected bytes >= 0 (total_ram > 0) and fractions "
                              "in (0, 1] (headroom in [0, 1)). Fix: pass a value in range.")
    described = total_ram is not None or available_ram is not None  # else: this node, read as Ray reads it
    default, available = _default_for(ram if described else None,
                                      None if available_ram is None else int(available_ram), shm_bytes)
    head = int(ram * headroom)
    offload, pinned, heap, ckpt = (int(offload_bytes), int(pinned_bytes), int(worker_heap_bytes),
                                   int(local_checkpoint_bytes))
    usable = ram - head - offload - pinned - heap - ckpt
    if usable < RAY_MIN_OBJECT_STORE:
        raise ConfigError(
            f"no safe object store size: {_terms(ram, head, headroom, offload, pinned, heap, ckpt)} = "
            f"{_gib(usable)}, below Ray's minimum object store of "
            f"{_gib(RAY_MIN_OBJECT_STORE)}; short by {_gib(RAY_MIN_OBJECT_STORE - usable)}. Fix: offload less "
            "(fewer ranks per node, shard the offloaded state over more ranks, or keep optimizer states on the "
            "GPU), shrink the worker heaps (fewer ranks or dataloader workers per node), keep fewer in-memory "
            "checkpoints (checkpoint.local_keep_last 1, replicas 0), use nodes with more RAM, or lower headroom.")
    wanted = default if object_store_fraction is None else int(fraction * ram)
    store = min(wanted, usable)
    if store < RAY_MIN_OBJECT_STORE and object_store_fraction is not None:
        raise ConfigError(
            f"no safe object store size: object_store_fraction={fraction} of total RAM {_gib(ram)} is "
            f"{_gib(store)}, below Ray's minimum of {_gib(RAY_MIN_OBJECT_STORE)}; expected a fraction of at least "
            f"{RAY_MIN_OBJECT_STORE / ram:.4f}. Fix: ask for a larger object_store_fraction, or leave it out.")
    if store < RAY_MIN_OBJECT_STORE:
        raise ConfigError(
            f"no safe object store size: Ray's default object store here is {_gib(default)} ({_proportion():.0%} of "
            f"available RAM {_gib(available)}), below Ray's minimum of {_gib(RAY_MIN_OBJECT_STORE)}; expected at least "
            f"{_gib(RAY_MIN_OBJECT_STORE / _proportion())} available. Fix: free memory on the node, or ask "
            "explicitly with object_store_fraction (the plan still keeps it within the usable RAM).")
    return MemoryPlan(total_ram=ram, headroom_bytes=head, offload_bytes=offload, pinned_bytes=pinned,
                      object_store_memory=store, local_checkpoint_bytes=ckpt, worker_heap_bytes=heap,
                      ray_default=default, available_ram=available,
                      object_store_fraction=None if object_store_fraction is None else fraction)


def _check_count(name: str, value: Any, meaning: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}; expected an int >= 1 ({meaning}). Fix: {fix}")
    return value


def estimate_offload_bytes(model: torch.nn.Module, optimizer: Any = "adam", *, include_grads: bool = True,
                           ranks_per_node: int = 1, state_dtype_bytes: int | None = None, shards: int = 1) -> int:
    """Host bytes CPU offload holds on one node: per rank ``ceil(P/shards) + ceil(G/shards) + ceil(S/shards)``
    (parameters, gradients, optimizer states), times ``ranks_per_node``.

    ``optimizer`` is a name (``"adam"``: 2 states per parameter, ``"sgd"``: none, ``"sgd_momentum"``: 1...),
    an optimizer class or an instance. ``shards``: the ranks the offloaded state is sharded over (FSDP
    ``FULL_SHARD``/ZeRO-3: the world size; ``HYBRID_SHARD``: the shard group; unsharded offload: 1).
    """
    ranks = _check_count("ranks_per_node", ranks_per_node, "the ranks, i.e. processes, that offload on one node",
                         "pass the number of training processes per node, e.g. ranks_per_node=8.")
    shards = _check_count("shards", shards, "the number of ranks the offloaded state is sharded over",
                          "pass the world size for FSDP FULL_SHARD or ZeRO-3, the shard group size for "
                          "HYBRID_SHARD, or 1 for unsharded offload.")
    if not isinstance(optimizer, str):
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        name = cls.__name__.lower()
        if name == "sgd" and not isinstance(optimizer, type) and optimizer.defaults.get("momentum", 0):
            name = "sgd_momentum"
    else:
        name = optimizer.lower()
    if name not in _OPTIMIZER_STATES:
        raise ConfigError(f"optimizer {name!r} has no known state size; expected one of {sorted(_OPTIMIZER_STATES)}. "
                          "Fix: pass the closest name.")
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(p.numel() * (state_dtype_bytes or p.element_size()) for p in params) * _OPTIMIZER_STATES[name]
    grads = param_bytes if include_grads else 0
    per_rank = sum(math.ceil(b / shards) for b in (param_bytes, grads, state_bytes))
    return per_rank * ranks
