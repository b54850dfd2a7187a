"""``fsdp_calibrate``: the numbers FSDP is built from, checked against the real world before sharding.

FSDP sizes its shards from the process group and its device from the process. Inside Ray Train a worker
granted k GPUs is *one* process, so FSDP uses one GPU of the k while ``world_size`` counts workers (the
"``num_workers=2, num_gpus_per_worker=4``" trap). Multi-node jobs want HSDP: replicate across nodes, shard
within a node. Checks, each a :class:`~robustdist.errors.TopologyError` whose message gives the fix:

* ``WORLD_SIZE`` in the environment differs from ``dist.get_world_size()``;
* nodes run different numbers of ranks, or ``local_world_size x num_nodes != world_size`` (one
  ``all_gather_object`` of every rank's host and local world size);
* a process sees k > 1 GPUs while the node runs a different number of processes (GPUs would sit idle).

``strategy="auto"``: one node -> FULL_SHARD over all ranks (mesh ``(world,)``, names ``("shard",)``);
several nodes -> HYBRID_SHARD (mesh ``(num_nodes, local_world_size)``, names ``("replicate", "shard")``);
world 1 -> NO_SHARD. HYBRID_SHARD requested on one node degrades to FULL_SHARD with a warning.
FSDP2 (``fully_shard``) runs on CPU/gloo; FSDP1 needs an accelerator.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from robustdist import _dist
from robustdist.errors import ConfigError, TopologyError
from robustdist.log import warn
from robustdist.topology import Topology, detect_topology

__all__ = ["Calibration", "fsdp_calibrate"]

STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD")


@dataclass
class Calibration:
    world_size: int
    rank: int
    local_world_size: int
    num_nodes: int
    local_rank: int
    device: torch.device
    gpus_visible_per_process: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    sharding_strategy: str
    warnings: list[str] = field(default_factory=list)

    def device_mesh(self) -> Any:
        """A real ``DeviceMesh`` (``init_device_mesh``) of ``mesh_shape`` on this device type."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)

    def fully_shard_kwargs(self, mixed_precision: Any = None, *, reshard_after_forward: bool = True) -> dict[str, Any]:
        """Keyword arguments for FSDP2 ``fully_shard``: the mesh (2-D for HSDP), ``reshard_after_forward``, and a
        ``MixedPrecisionPolicy`` (bf16 parameters, fp32 reductions) when ``mixed_precision`` is "bf16"."""
        kwargs: dict[str, Any] = {"mesh": self.device_mesh(), "reshard_after_forward": reshard_after_forward}
        if mixed_precision in ("bf16", "bfloat16", torch.bfloat16):
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        elif mixed_precision is not None:
            raise ConfigError(f"mixed_precision={mixed_precision!r}; expected None or 'bf16'. Fix: pass one of those.")
        return kwargs

    def fsdp1_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for classic FSDP (``FullyShardedDataParallel``): ``device_id``,
        ``sharding_strategy`` and, for HYBRID_SHARD, the (shard, replicate) process groups. FSDP1 needs an
        accelerator."""
        from torch.distributed.fsdp import ShardingStrategy

        kwargs: dict[str, Any] = {"device_id": self.device,
                                  "sharding_strategy": getattr(ShardingStrategy, self.sharding_strategy)}
        if self.sharding_strategy == "HYBRID_SHARD":
            mesh = self.device_mesh()
            kwargs["process_group"] = (mesh.get_group("shard"), mesh.get_group("replicate"))
        return kwargs


def _visible_gpus(visible_devices: list[Any] | None) -> list[Any]:
    if visible_devices is not None:
        return list(visible_devices)
    if torch.cuda.is_available():
        return list(range(torch.cuda.device_count()))
    return []


def fsdp_calibrate(*, topology: Topology | None = None, strategy: str = "auto", group: Any = None,
                   hostname: str | None = None, visible_devices: list[Any] | None = None) -> Calibration:
    """Compute and check FSDP's world, mesh and strategy (see the module docstring).

    Args:
        topology: the detected topology (default: :func:`detect_topology`).
        strategy: "auto", "FULL_SHARD", "HYBRID_SHARD" or "NO_SHARD".
        group: the process group (default: the default group).
        hostname: this rank's node identity (default: ``socket.gethostname()``; tests simulate nodes).
        visible_devices: the GPUs this process sees (default: from torch; tests inject them on CPU).
    """
    wanted = strategy.upper()
    if wanted not in ("AUTO", *STRATEGIES):
        raise ConfigError(f"strategy={strategy!r}; expected 'auto' or one of {STRATEGIES}. Fix: pass one of those.")
    if not _dist.is_up():
        topo = topology or detect_topology()
        return Calibration(1, 0, 1, 1, 0, topo.device, len(_visible_gpus(visible_devices)), (1,), ("shard",),
                           "NO_SHARD")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None and env_world.strip() != str(world):
        raise TopologyError(
            f"WORLD_SIZE={env_world} in the environment but the process group has {world} ranks; expected them to "
            "agree, or FSDP shards for one world while the launcher counts another. Fix: do not override WORLD_SIZE "
            "after the launcher sets it, and create the group with the launcher's ranks.", rank=rank)
    topo = topology or detect_topology()
    visible = _visible_gpus(visible_devices)
    nodes = _gather_nodes((hostname or socket.gethostname(), topo.local_world_size, [str(v) for v in visible]),
                          group, world)
    num_nodes, local_world = _check_nodes([(h, lws) for h, lws, _ in nodes], world, rank)
    _check_gpus_per_process(nodes, visible, local_world, rank)
    notes: list[str] = []
    chosen = _strategy(wanted, world, num_nodes, notes)
    if chosen == "HYBRID_SHARD":
        shape, names = (num_nodes, local_world), ("replicate", "shard")
    else:
        shape, names = (world,), ("shard",)
    return Calibration(world, rank, local_world, num_nodes, topo.local_rank, topo.device, len(visible), shape, names,
                       chosen, notes)


def _gather_nodes(mine: tuple[str, int, list[str]], group: Any, world: int) -> list[tuple[str, int, list[str]]]:
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _check_nodes(nodes: list[tuple[str, int]], world: int, rank: int) -> tuple[int, int]:
    per_host = Counter(host for host, _ in nodes)
    counts = sorted(set(per_host.values()))
    claimed = sorted({lws for _, lws in nodes})
    if len(counts) > 1:
        shown = ", ".join(f"{h}: {n}" for h, n in sorted(per_host.items()))
        raise TopologyError(
            f"nodes run different numbers of ranks ({shown}); expected the same on every node, since FSDP/HSDP "
            "meshes shard within a node. Fix: launch the same --nproc_per_node on every node (or the same number "
            "of Ray workers per node).", rank=rank)
    if len(claimed) > 1 or claimed[0] != counts[0] or claimed[0] * len(per_host) != world:
        raise TopologyError(
            f"local_world_size {claimed} x {len(per_host)} node(s) does not match world size {world} "
            f"({counts[0]} rank(s) found per node); expected local_world_size x num_nodes == world_size. Fix: set "
            "LOCAL_WORLD_SIZE to the ranks per node (torchrun does), or check the node count.", rank=rank)
    return len(per_host), counts[0]


def _check_gpus_per_process(nodes: list[tuple[str, int, list[str]]], visible: list[Any], local_world: int,
                            rank: int) -> None:
    k = len(visible)
    if k <= 1 or k == local_world:
        return
    per_host: dict[str, set[str]] = {}
    for host, _, gpus in nodes:
        per_host.setdefault(host, set()).update(gpus)
    total = sum(len(g) for g in per_host.values())
    ranks = len(nodes)
    raise TopologyError(
        f"each process sees {k} GPUs ({visible}) but its node runs {local_world} process(es): FSDP uses one GPU per "
        f"process, so {total - ranks} of the job's {total} GPUs would sit idle while world_size counts {ranks} ranks; "
        f"expected one process per GPU. Fix: in Ray Train use ScalingConfig(num_workers={total}, "
        f"resources_per_worker={{'GPU': 1}}), or under torchrun --nproc_per_node={k}.", rank=rank)


def _strategy(wanted: str, world: int, num_nodes: int, notes: list[str]) -> str:
    if world == 1:
        return "NO_SHARD"
    if wanted == "AUTO":
        return "HYBRID_SHARD" if num_nodes > 1 else "FULL_SHARD"
    if wanted == "HYBRID_SHARD" and num_nodes == 1:
        message = ("HYBRID_SHARD was requested on a single node: there is nothing to replicate across, so FULL_SHARD "
                   "is used. Request FULL_SHARD (or 'auto') to silence this.")
        notes.append(message)
        warn(message, once="hsdp-one-node", stacklevel=3)
        return "FULL_SHARD"
    return wanted
