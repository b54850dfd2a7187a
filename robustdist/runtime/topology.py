"""Where this process sits in the job: ranks, nodes, launcher, device and visible GPUs.

:func:`detect_topology` reads, in precedence order:

1. an initialised ``torch.distributed`` process group (authoritative for ``rank`` and ``world_size``);
2. the torchrun / torch-elastic env: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``;
3. the Ray Train context, when this process is a Ray Train worker (ray is never imported here: a worker
   has imported ``ray.train`` already, so it is consulted only when ``ray.train`` is in ``sys.modules``).
   Outside a worker Ray Train V2 raises from ``ray.train.get_context()`` but Train V1 (Ray's default before
   V2, and ``RAY_TRAIN_V2_ENABLED=0``) returns a stub with a local world size of 0; only a context whose
   ranks and sizes are all integers, with sizes >= 1, counts as a worker's (anything else is "not Ray Train");
4. SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NNODES``, ``SLURM_NODEID``;
5. otherwise a single process.

``launcher`` names what started the process: ``"torchrun"`` (``TORCHELASTIC_RUN_ID`` is set),
``"ray_train"``, ``"slurm"``, ``"manual"`` (``RANK``/``WORLD_SIZE`` or a process group from something else:
``mp.spawn``, :func:`robustdist.testing.run_ranks`, a hand-written launcher), or ``"single"``.

It raises :class:`~robustdist.runtime.errors.TopologyError`, with the fix, when a launcher variable is not an
integer or is out of its range (ranks in ``0..2**24-1``, sizes in ``1..2**24``, a node rank below the node
count; see :mod:`robustdist.runtime.launcher_env`), when ``rank >= world_size``,
``local_rank >= local_world_size``, two sources disagree (``RANK`` vs ``SLURM_PROCID``, or the env vs the
process group), or ``local_rank`` indexes past the visible CUDA devices (what NCCL later reports as
"invalid device ordinal"). It warns when ``world_size`` is not a multiple of ``local_world_size``.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import TopologyError
from robustdist.runtime.launcher_env import Raw, from_slurm, from_torch_env, shown
from robustdist.runtime.log import get_logger, warn

__all__ = ["Topology", "detect_topology", "local_device", "parse_visible_devices"]

log = get_logger(__name__)

LAUNCHERS = ("torchrun", "ray_train", "slurm", "manual", "single")


@dataclass(frozen=True)
class Topology:
    """This process's place in the job. ``visible_devices`` is None when ``CUDA_VISIBLE_DEVICES`` is unset."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    launcher: str
    device: torch.device
    master_addr: str | None
    master_port: int | None
    visible_devices: tuple[int | str, ...] | None

    @property
    def is_distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/_.-]+$")


def parse_visible_devices(value: str | None) -> tuple[int | str, ...] | None:
    """Parse ``CUDA_VISIBLE_DEVICES`` the way CUDA does.

    Entries are ordinals (``"2"``) or UUIDs (``"GPU-8a1b..."``, ``"MIG-..."``, legacy ``"MIG-GPU-.../1/0"``).
    CUDA stops at the first invalid entry, so ``"0,1,-1,2"`` exposes devices 0 and 1 and ``"-1"`` or ``""``
    exposes none (an empty tuple). Unset (``None``) means every device is visible and returns None.
    """
    if value is None:
        return None
    out: list[int | str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if re.fullmatch(r"[0-9]{1,9}", entry):  # ASCII, and short: CUDA rejects a huge ordinal too
            out.append(int(entry))
        elif _UUID_RE.match(entry):
            out.append(entry)
        else:
            break  # CUDA ignores this entry and everything after it
    return tuple(out)


def _process_group() -> tuple[int, int] | None:
    return (_dist.rank(), _dist.world_size()) if _dist.is_up() else None


def _ray_train_context() -> Raw | None:
    """This Ray Train worker's ranks, or None: ``ray.train`` not imported in this process, or its context is not
    a worker's (Train V2 raises outside a worker; Train V1 returns a stub whose local world size is 0)."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        ctx = train.get_context()
        with warnings.catch_warnings():  # Train V1's stub warns "meant to only be called inside ..." once per getter
            warnings.simplefilter("ignore")
            local_world = ctx.get_local_world_size()  # asked first: a stub answers 0, and nothing else is asked
            if not _is_size(local_world):
                log.debug("ray.train.get_context() is not a Ray Train worker's (local world size %r)", local_world)
                return None
            raw = _from_ray(ctx, local_world)
    except Exception as e:  # not a Ray Train worker: V2 raises RuntimeError, other versions other types
        log.debug("no Ray Train worker context: %s: %s", type(e).__name__, e)
        return None
    values = (raw.rank, raw.world_size, raw.local_rank, raw.node_rank)
    if not (all(isinstance(v, int) and not isinstance(v, bool) for v in values) and _is_size(raw.world_size)):
        log.debug("ray.train.get_context() is not a Ray Train worker's (ranks %s)", raw)
        return None
    return raw


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _from_ray(ctx: Any, local_world: int) -> Raw:
    return Raw(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        local_rank=ctx.get_local_rank(),
        local_world_size=local_world,
        node_rank=ctx.get_node_rank(),
    )


def _first(*values: Any) -> Any:
    return next((x for x in values if x is not None), None)


def _launcher(env: Mapping[str, str], ray_ctx: Raw | None, pg: tuple[int, int] | None) -> str:
    if env.get("TORCHELASTIC_RUN_ID") or env.get("TORCHELASTIC_RESTART_COUNT"):
        return "torchrun"
    if ray_ctx is not None:
        return "ray_train"
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        # srun launched this process directly (torchrun inside srun was caught above)
        return "slurm"
    if pg is not None or env.get("RANK") is not None or env.get("WORLD_SIZE") is not None:
        return "manual"
    return "single"


def _check_agreement(launcher: str, pg: tuple[int, int] | None, torch_env: Raw, slurm: Raw) -> None:
    """Two sources that both speak about rank/world_size must agree."""
    if pg is not None and torch_env.rank is not None:
        for what, group_value, env_name, env_value in (
            ("rank", pg[0], "RANK", torch_env.rank),
            ("world size", pg[1], "WORLD_SIZE", torch_env.world_size),
        ):
            if env_value is not None and env_value != group_value:
                raise TopologyError(
                    f"the process group says {what} {group_value} but {env_name}={env_value} in the environment; "
                    f"expected them to agree. Fix: pass no explicit rank/world_size to init_process_group when "
                    f"using env://, or unset the stale {env_name}.",
                    rank=pg[0],
                )
    if launcher == "slurm" and torch_env.rank is not None and slurm.rank is not None:
        for env_name, env_value, slurm_name, slurm_value in (
            ("RANK", torch_env.rank, "SLURM_PROCID", slurm.rank),
            ("WORLD_SIZE", torch_env.world_size, "SLURM_NTASKS", slurm.world_size),
        ):
            if env_value is not None and slurm_value is not None and env_value != slurm_value:
                raise TopologyError(
                    f"{env_name}={env_value} but {slurm_name}={slurm_value}; expected them to agree when srun starts "
                    f"one task per rank. Fix: derive {env_name} from {slurm_name} in your sbatch script, or run "
                    f"`srun --ntasks-per-node=1 torchrun ...` so torchrun sets the ranks.",
                    rank=torch_env.rank,
                )


def local_device(*, set_current: bool = True) -> torch.device:
    """The device this process trains on, the one ``harden()`` will use: ``cuda:<local rank>`` under a launcher
    (the first visible GPU in a Ray Train worker or alone), else ``cpu``. For the lines a script runs before
    ``harden``: ``model.to(device)``, a fused AdamW, ``torch.autocast(device.type)``. On CUDA, unless
    ``set_current=False``, it also makes it the current device (``torch.cuda.set_device``), as ``harden`` does
    before creating the process group, so nothing lands on GPU 0 by default. Raises what
    :func:`detect_topology` raises (a LOCAL_RANK past the visible GPUs, say)."""
    device = detect_topology().device
    if set_current and device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def detect_topology(*, environ: Mapping[str, str] | None = None) -> Topology:
    """Detect this process's :class:`Topology` (see the module docstring for sources and checks)."""
    env = os.environ if environ is None else environ
    pg = _process_group()
    ray_ctx = _ray_train_context()
    launcher = _launcher(env, ray_ctx, pg)
    torch_env = from_torch_env(env)
    ray_raw = ray_ctx if ray_ctx is not None else Raw()
    slurm = from_slurm(env) if launcher == "slurm" else Raw()
    _check_agreement(launcher, pg, torch_env, slurm)

    sources = (torch_env, ray_raw, slurm)
    rank, world, local_rank, local_world = _ranks(sources, pg)
    node_rank = _first(*(s.node_rank for s in sources), rank // local_world)
    num_nodes = _first(*(s.num_nodes for s in sources), math.ceil(world / local_world))
    visible = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    master_addr, master_port = env.get("MASTER_ADDR"), _master_port(env, rank, world)
    device = _device(launcher, local_rank, env.get("CUDA_VISIBLE_DEVICES"), rank)
    topo = Topology(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, node_rank=node_rank,
        num_nodes=num_nodes, launcher=launcher, device=device, master_addr=master_addr, master_port=master_port,
        visible_devices=visible,
    )
    log.debug("detected %s", topo)
    return topo


def _ranks(sources: tuple[Raw, ...], pg: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """``(rank, world, local_rank, local_world)`` from the first source that says each, checked."""
    rank = pg[0] if pg else _first(*(s.rank for s in sources), 0)
    world = pg[1] if pg else _first(*(s.world_size for s in sources), 1)
    if world < 1:
        raise TopologyError(
            f"world size is {world}; expected at least 1. Fix: set WORLD_SIZE to the number of processes "
            "(torchrun --nproc_per_node sets it for you).",
            rank=rank,
        )
    if not 0 <= rank < world:
        raise TopologyError(
            f"rank {rank} is outside world size {world}; expected 0 <= rank < {world}. "
            "Fix: every process needs a distinct RANK below WORLD_SIZE; check the launcher's --nnodes and "
            "--nproc_per_node against WORLD_SIZE.",
            rank=rank,
        )
    local_world = _first(*(s.local_world_size for s in sources), world)  # no per-node info: one node
    local_rank = _first(*(s.local_rank for s in sources), None)
    if local_world >= 1 and local_rank is None:
        local_rank = rank % local_world
    if local_world < 1 or local_rank is None or not 0 <= local_rank < local_world:
        raise TopologyError(
            f"local rank {local_rank} is outside local world size {local_world}; expected "
            f"0 <= LOCAL_RANK < LOCAL_WORLD_SIZE. Fix: set LOCAL_WORLD_SIZE to the processes on this node "
            "(torchrun --nproc_per_node sets both).",
            rank=rank,
        )
    if world % local_world:
        warn(
            f"world size {world} is not a multiple of the local world size {local_world}: nodes run different "
            "numbers of ranks, which FSDP/HSDP meshes cannot shard evenly. Launch the same --nproc_per_node "
            "on every node to silence this.",
            once=("uneven-nodes", world, local_world),
        )
    return rank, world, local_rank, local_world


def _master_port(env: Mapping[str, str], rank: int, world: int) -> int | None:
    raw = env.get("MASTER_PORT")
    if raw is None:
        return None
    text = raw.strip()
    port = int(text) if re.fullmatch(r"[0-9]{1,5}", text) else -1  # never int() an unbounded string
    if 1 <= port <= 65535:
        return port
    if world == 1:  # a stale variable does not matter to a single process
        log.debug("ignoring MASTER_PORT=%s in a single-process run", shown(raw))
        return None
    raise TopologyError(
        f"MASTER_PORT={shown(raw)} is not a TCP port; expected an integer in 1..65535. "
        "Fix: set MASTER_PORT to a free port on the master node (torchrun --master_port=29500).",
        rank=rank,
    )


def _device(launcher: str, local_rank: int, visible: str | None, rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if launcher == "ray_train":
        # Ray narrows CUDA_VISIBLE_DEVICES per worker: its helper maps the assigned GPU to its position.
        import ray.train.torch

        return ray.train.torch.get_device()
    count = torch.cuda.device_count()
    if local_rank >= count:
        visible_text = "unset" if visible is None else f"= {shown(visible, 200)}"
        raise TopologyError(
            f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES "
            f"{visible_text}); "
            f"expected LOCAL_RANK < {count}. NCCL would fail later with 'invalid device ordinal'. Fix: start at "
            f"most {count} processes per node (torchrun --nproc_per_node={count}) or make more GPUs visible.",
            rank=rank,
        )
    return torch.device("cuda", local_rank)
