"""``ray_memory_plan``: size Ray's object store so that it and CPU offload fit in the node's RAM together.

Ray's object store takes 30% of RAM by default; ZeRO-3/FSDP CPU offload holds parameters, gradients and
optimizer states in host RAM too, and pinned host buffers add more. Together they can exceed the node and
get the raylet OOM-killed. So can robustdist's in-memory checkpoint tier (``/dev/shm`` is RAM):
``local_checkpoint_bytes`` is what it holds on the node (:func:`robustdist.checkpoint.local_tier.node_need`,
``(checkpoint.local_keep_last + 1)`` x the copies the node holds). The plan, per node::

    usable        = total_ram * (1 - headroom) - offload_bytes - pinned_bytes - local_checkpoint_bytes
    object_store  = min(object_store_fraction * total_ram, usable)     (fraction: Ray's 0.3 by default)

It raises :class:`~robustdist.errors.ConfigError` listing every term and the shortfall when ``usable`` is
below Ray's minimum object store (75 MiB). ``total_ram`` defaults to the smaller of physical memory and the
cgroup (container) limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from robustdist.errors import ConfigError

__all__ = ["MemoryPlan", "estimate_offload_bytes", "ray_memory_plan", "system_ram"]

RAY_DEFAULT_FRACTION = 0.3
RAY_MIN_OBJECT_STORE = 75 * 2**20
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}


def system_ram() -> int:
    """Physical RAM, or the cgroup v2/v1 memory limit when that is smaller (containers)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit():
            ram = min(ram, int(text))
    return ram


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    total_ram: int
    headroom_bytes: int
    offload_bytes: int
    pinned_bytes: int
    object_store_memory: int
    local_checkpoint_bytes: int = 0

    @property
    def explanation(self) -> str:
        usable = self.total_ram - self.headroom_bytes - self.offload_bytes - self.pinned_bytes \
            - self.local_checkpoint_bytes
        tier = f" - in-memory checkpoints {_gib(self.local_checkpoint_bytes)}" if self.local_checkpoint_bytes else ""
        return (f"total RAM {_gib(self.total_ram)} - headroom {_gib(self.headroom_bytes)} - CPU offload "
                f"{_gib(self.offload_bytes)} - pinned buffers {_gib(self.pinned_bytes)}{tier} = usable {_gib(usable)}; "
                f"object store {_gib(self.object_store_memory)}")

    def ray_init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.init`` (or ``ray start --object-store-memory``)."""
        return {"object_store_memory": self.object_store_memory}


def ray_memory_plan(*, total_ram: int | None = None, offload_bytes: int = 0, pinned_bytes: int = 0,
                    object_store_fraction: float | None = None, headroom: float = 0.1,
                    local_checkpoint_bytes: int = 0) -> MemoryPlan:
    """Compute a safe ``object_store_memory`` (see the module docstring)."""
    ram = system_ram() if total_ram is None else int(total_ram)
    fraction = RAY_DEFAULT_FRACTION if object_store_fraction is None else float(object_store_fraction)
    for name, value, ok in (("total_ram", ram, ram > 0), ("offload_bytes", offload_bytes, offload_bytes >= 0),
                            ("pinned_bytes", pinned_bytes, pinned_bytes >= 0),
                            ("local_checkpoint_bytes", local_checkpoint_bytes, local_checkpoint_bytes >= 0),
                            ("object_store_fraction", fraction, 0 < fraction <= 1), ("headroom", headroom, 0 <= headroom < 1)):
        if not ok:
            raise ConfigError(f"{name}={value!r} is out of range; expected bytes >= 0 (total_ram > 0) and fractions "
                              "in (0, 1] (headroom in [0, 1)). Fix: pass a value in range.")
    head = int(ram * headroom)
    usable = ram - head - int(offload_bytes) - int(pinned_bytes) - int(local_checkpoint_bytes)
    if usable < RAY_MIN_OBJECT_STORE:
        raise ConfigError(
            f"no safe object store size: total RAM {_gib(ram)} - headroom {_gib(head)} ({headroom:.0%}) - CPU offload "
            f"{_gib(offload_bytes)} - pinned buffers {_gib(pinned_bytes)}"
            f"{f' - in-memory checkpoints {_gib(local_checkpoint_bytes)}' if local_checkpoint_bytes else ''} = "
            f"{_gib(usable)}, below Ray's minimum object store of "
            f"{_gib(RAY_MIN_OBJECT_STORE)}; short by {_gib(RAY_MIN_OBJECT_STORE - usable)}. Fix: offload less "
            "(fewer ranks per node, or keep optimizer states on the GPU), keep fewer in-memory checkpoints "
            "(checkpoint.local_keep_last 1, replicas 0), use nodes with more RAM, or lower headroom.")
    store = min(int(fraction * ram), usable)
    return MemoryPlan(total_ram=ram, headroom_bytes=head, offload_bytes=int(offload_bytes),
                      pinned_bytes=int(pinned_bytes), object_store_memory=store,
                      local_checkpoint_bytes=int(local_checkpoint_bytes))


def estimate_offload_bytes(model: torch.nn.Module, optimizer: Any = "adam", *, include_grads: bool = True,
                           ranks_per_node: int = 1, state_dtype_bytes: int | None = None) -> int:
    """Host bytes CPU offload holds on one node: (parameters + gradients + optimizer states) x ranks per node.

    ``optimizer`` is a name (``"adam"``: 2 states per parameter, ``"sgd"``: none, ``"sgd_momentum"``: 1...),
    an optimizer class or an instance. With sharded offload (ZeRO-3/FSDP) divide by the shard count yourself.
    """
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
    params = [p for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(p.numel() * (state_dtype_bytes or p.element_size()) for p in params) * _OPTIMIZER_STATES[name]
    grads = param_bytes if include_grads else 0
    return (param_bytes + grads + state_bytes) * int(ranks_per_node)
