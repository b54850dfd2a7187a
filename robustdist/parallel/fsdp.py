"""FSDP2 for real scripts: ``fsdp_calibrate`` (the numbers FSDP is built from, checked against the real world
before sharding) and ``wrap_fsdp`` (per-layer ``fully_shard``, meta-device init, mixed precision, offload).

FSDP sizes its shards from the process group and its device from the process. Inside Ray Train a worker
granted k GPUs is *one* process, so FSDP uses one GPU of the k while ``world_size`` counts workers (the
"``num_workers=2, num_gpus_per_worker=4``" trap). Multi-node jobs want HSDP: replicate across nodes, shard
within a node. Checks, each a :class:`~robustdist.runtime.errors.TopologyError` whose message gives the fix:

* ``WORLD_SIZE`` in the environment differs from ``dist.get_world_size()``;
* nodes run different numbers of ranks, or ``local_world_size x num_nodes != world_size`` (one
  ``all_gather_object`` of every rank's host and local world size);
* a process sees k > 1 GPUs while the node runs a different number of processes (GPUs would sit idle).

``strategy="auto"``: one node -> FULL_SHARD over all ranks (mesh ``(world,)``, names ``("shard",)``);
several nodes -> HYBRID_SHARD (mesh ``(num_nodes, local_world_size)``, names ``("replicate", "shard")``);
world 1 -> NO_SHARD. HYBRID_SHARD requested on one node degrades to FULL_SHARD with a warning.
FSDP2 (``fully_shard``) runs on CPU/gloo; FSDP1 needs an accelerator. Without a process group the world is
one process, unless ``WORLD_SIZE`` or the detected topology says more: then the group was forgotten, and
``fsdp_calibrate`` raises instead of calibrating a 1-rank world.

:func:`wrap_fsdp` shards a model the way the FSDP2 examples do (its docstring has the steps). Protocol: it
runs on every rank, in the same order; ``fully_shard`` itself does not communicate, ``fsdp_calibrate`` does one
``all_gather_object``, building the mesh is collective, and materialising a meta model does one
``all_gather_object`` per init check (so every rank raises, or none does).
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from robustdist.config.schema import FsdpConfig, HardenConfig, section_of
from robustdist.parallel import fsdp_wrap as _w
from robustdist.parallel.syncbn import SyncBatchNorm, convert_batchnorm_for
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import ConfigError, TopologyError, UnsupportedVersionError
from robustdist.runtime.log import get_logger, warn
from robustdist.runtime.topology import Topology, detect_topology

__all__ = ["Calibration", "fsdp_calibrate", "wrap_fsdp"]

log = get_logger(__name__)

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
        _check_no_group(topo)
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
    nodes = _dist.gather_objects((hostname or socket.gethostname(), topo.local_world_size,
                                  [str(v) for v in visible]), group)
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


def _check_no_group(topo: Topology) -> None:
    """Without a group the world is one process; refuse when the launcher says otherwise."""
    env_world = os.environ.get("WORLD_SIZE", "").strip()
    claimed = [(f"WORLD_SIZE={env_world} in the environment", int(env_world))] if env_world.isdigit() else []
    claimed.append((f"the detected topology ({topo.launcher})", topo.world_size))
    for source, world in claimed:
        if world > 1:
            raise TopologyError(
                f"fsdp_calibrate() found no process group, but {source} says the world has {world} ranks; expected "
                f"the group of {world} ranks to exist first, or FSDP is calibrated for a 1-rank world and fails "
                "later (an IndexError in device_mesh). Fix: call robustdist.safe_init_process_group() (or harden(), "
                "which creates it) before fsdp_calibrate() and wrap_fsdp().", rank=topo.rank)


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


# ---------------------------------------------------------------------------------------------- wrap_fsdp
def wrap_fsdp(model: nn.Module, config: FsdpConfig | HardenConfig | None = None, *, shard_policy: Any = None,
              init_weights: Any = None, device: torch.device | str | int | None = None,
              sync_batchnorm: bool | str | None = None, calibration: Calibration | None = None) -> nn.Module:
    """Shard ``model`` with FSDP2 the way the FSDP2 examples do: per layer, bottom-up, then the root.

    Returns the model itself (``fully_shard`` turns it into an ``FSDPModule`` in place). Steps:

    1. the modules picked by ``shard_policy`` (module classes, class names, or a callable ``module -> bool``)
       or else ``fsdp.shard_modules`` ("auto": the elements of every ``nn.ModuleList``) each get their own
       ``fully_shard``, children before parents, then the root (see :mod:`robustdist.parallel.fsdp_wrap`);
    2. with the mesh of ``calibration`` (default: :func:`fsdp_calibrate` with ``fsdp.sharding``; NO_SHARD
       is a ``(world, 1)`` replicate mesh), ``fsdp.mixed_precision`` as a ``MixedPrecisionPolicy``
       (fp32 reductions), ``fsdp.cpu_offload`` as a ``CPUOffloadPolicy`` and ``fsdp.reshard_after_forward``;
    3. a model built on the meta device is sharded there, then ``to_empty(device=...)`` and initialised with
       ``init_weights(model)`` or its own ``reset_parameters()``; a tensor left uninitialised is an error;
    4. BatchNorm is converted to a SyncBatchNorm that works on the device when ``sync_batchnorm`` (default:
       ``distributed.sync_batchnorm`` of a HardenConfig, else "auto") is True, or "auto" with world > 1.

    A model whose root is already an ``FSDPModule`` is left as it is (meta tensors are still materialised);
    one whose submodules are sharded gets only its root sharded, on their mesh. Without a group of more than
    one rank the model is returned on ``device``, unsharded (materialised if on meta).

    Args:
        model: the bare model, on any device or on meta.
        config: the ``fsdp`` section (or a whole HardenConfig); None for defaults.
        shard_policy: overrides ``fsdp.shard_modules``.
        init_weights: ``init_weights(model)`` initialises a meta-device model in place, under ``no_grad``,
            after sharding (its parameters are then DTensor shards; ``torch.nn.init`` functions work on them).
        device: the compute device (default: the topology's).
        sync_batchnorm: "auto", True or False.
        calibration: a :class:`Calibration` (``harden`` passes its own).
    """
    cfg = section_of(config, FsdpConfig, "wrap_fsdp")
    bn_mode = sync_batchnorm if sync_batchnorm is not None else (
        config.distributed.sync_batchnorm if isinstance(config, HardenConfig) else "auto")
    if bn_mode not in ("auto", True, False):
        raise ConfigError(f"sync_batchnorm={bn_mode!r}; expected 'auto', True or False. Fix: pass one of those.",
                          rank=_dist.error_rank())
    target = _device(device)
    on_meta = _w.meta_state(model)
    policy, described = _w.resolve_policy(shard_policy, cfg.shard_modules, model)
    if calibration is None:
        calibration = fsdp_calibrate(strategy=cfg.sharding)
    if not _dist.is_multi():
        log.info("no process group of more than one rank: %s on %s, unsharded", _w.class_name(model), target)
        if on_meta:
            _w.materialise(model, target, init_weights)
            return model
        return model.to(target)
    if calibration.world_size != _dist.world_size():
        raise TopologyError(f"the calibration is for {calibration.world_size} rank(s) but the process group has "
                            f"{_dist.world_size()}; expected the same world. Fix: call fsdp_calibrate() after the "
                            "group exists, or pass calibration=None.", rank=_dist.error_rank())
    if not any(_w.is_fsdp(m) for m in model.modules()) and \
            any(type(p).__name__ == "DTensor" for p in model.parameters()):  # a model error before a torch one
        raise ConfigError(
            f"{_w.class_name(model)} has parameters split across ranks by tensor parallelism (DTensor, "
            "parallelize_module) and no FSDP2 module; wrap_fsdp shards over a 1-D mesh of its own, which cannot "
            "be combined with another one, expected a bare module or one you sharded. Fix: apply fully_shard "
            "yourself over the data-parallel dimension of your 2-D mesh (dp, tp) and give the result to harden "
            "(it is kept as it is), or remove the tensor parallelism.", rank=_dist.error_rank())
    missing = fsdp2_missing(target.type)
    if missing:
        raise UnsupportedVersionError(
            f"wrap_fsdp needs FSDP2 on {target.type}, and this torch ({torch.__version__}) lacks {missing}; expected "
            f"torch >= {FSDP2_CPU_TORCH if target.type == 'cpu' else FSDP2_TORCH}. Fix: upgrade torch (robustdist doctor "
            "lists the tested versions), or wrap with DDP.", rank=_dist.error_rank())
    if target.type == "cpu" and not gloo_averages():
        raise UnsupportedVersionError(
            f"this torch ({torch.__version__}) has gloo's reduce-scatter ignore ReduceOp.AVG (it sums), and FSDP2 "
            "reduces gradients with it on the CPU: every step would apply world-size times the gradient, silently "
            f"(pytorch/pytorch#162338); expected a torch whose gloo averages (torch >= {FSDP2_GLOO_AVG_TORCH}, the "
            "oldest the version matrix verified). Fix: upgrade torch, or wrap with DDP on the CPU.",
            rank=_dist.error_rank())
    if _w.is_fsdp(model):
        _adopt(model, calibration, bn_mode)
    else:
        model = _shard(model, cfg, calibration, policy, described, target, bn_mode, on_meta)
    if on_meta:
        _w.materialise(model, target, init_weights, cpu_offload=cfg.cpu_offload)
    return model


FSDP2_TORCH = "2.6"  # torch.distributed.fsdp.fully_shard, FSDPModule, MixedPrecisionPolicy; DTensor public
FSDP2_CPU_TORCH = "2.7"  # fully_shard's all-gather calls torch.cpu.Stream.record_event (absent in 2.6)


FSDP2_GLOO_AVG_TORCH = "2.13"  # gloo's reduce-scatter sums for ReduceOp.AVG in 2.8 (pytorch#162338); 2.13 averages
_gloo_avg: dict[int, bool] = {}


def gloo_averages() -> bool:
    """Whether the default group's reduce-scatter honours ``ReduceOp.AVG``, as FSDP2's gradient reduction needs
    (True for a group that is not gloo). A capability probe, not a version check: one reduce-scatter of one
    element per rank, collective like the ``wrap_fsdp`` that calls it, answered once per group."""
    if not _dist.is_multi() or _dist.backend_kind() != "gloo":
        return True
    key = id(dist.group.WORLD)
    if key not in _gloo_avg:
        world = _dist.world_size()
        out = torch.zeros(1)
        dist.reduce_scatter_tensor(out, torch.full((world,), float(_dist.rank() + 1)), op=dist.ReduceOp.AVG)
        _gloo_avg[key] = abs(out.item() - (world + 1) / 2) < 1e-6  # the mean of 1..world
        if not _gloo_avg[key]:
            log.warning("gloo's reduce-scatter returned %s for ReduceOp.AVG; expected the mean %s", out.item(),
                        (world + 1) / 2)
    return _gloo_avg[key]


def fsdp2_missing(device_type: str) -> str | None:
    """What this torch lacks to run FSDP2 on ``device_type`` (checked by capability, not by version number),
    or None. 2.4/2.5 keep FSDP2 under a private path; 2.6 cannot run its all-gather on the CPU."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import DTensor
    except ImportError as e:
        return f"the public FSDP2 API ({e})"
    del CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard, DTensor
    if device_type == "cpu" and not hasattr(getattr(torch.cpu, "Stream", None), "record_event"):
        return "torch.cpu.Stream.record_event, which FSDP2's all-gather calls on the CPU"
    return None


def _device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return detect_topology().device
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _mesh(calibration: Calibration) -> Any:
    if calibration.sharding_strategy == "NO_SHARD" and calibration.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh  # FSDP2's NO_SHARD: replicate, shards of 1

        return init_device_mesh(calibration.device.type, (calibration.world_size, 1),
                                mesh_dim_names=("replicate", "shard"))
    return calibration.device_mesh()


def _adopt(model: nn.Module, calibration: Calibration, bn_mode: bool | str) -> None:
    mesh = _w.mesh_of(model)
    log.info("%s is already sharded (its root is an FSDPModule): left as it is (mesh %s)", _w.class_name(model),
             None if mesh is None else tuple(mesh.shape))
    if mesh is not None and mesh.size() != calibration.world_size:
        warn(f"{_w.class_name(model)} was sharded over a mesh of {mesh.size()} rank(s) {tuple(mesh.shape)}, but "
             f"the world has {calibration.world_size}; expected the whole world unless a sub-mesh is meant (e.g. "
             "with tensor parallelism). Fix: pass the mesh from fsdp_calibrate().device_mesh() to fully_shard, or "
             "let wrap_fsdp shard the bare model.", once=("fsdp-adopted-mesh", id(model)))
    _convert_bn(model, calibration.device, bn_mode, sharded=True)


def _shard(model: nn.Module, cfg: FsdpConfig, calibration: Calibration, policy: Any, described: str,
           target: torch.device, bn_mode: bool | str, on_meta: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    inner = [name for name, m in model.named_modules() if m is not model and _w.is_fsdp(m)]
    model = _convert_bn(model, target, bn_mode, sharded=bool(inner))
    if inner:
        mesh = _w.mesh_of(model) or _mesh(calibration)
        chosen: list[tuple[str, nn.Module]] = []
        log.info("%d submodule(s) of %s are already sharded (%s): sharding only the root, on their mesh %s",
                 len(inner), _w.class_name(model), ", ".join(inner[:8]), tuple(mesh.shape))
    else:
        if not on_meta:
            model = model.to(target)
        mesh = _mesh(calibration)
        chosen = _w.select_modules(model, policy)
    kwargs = _w.fully_shard_kwargs(mesh, mixed_precision=cfg.mixed_precision, cpu_offload=cfg.cpu_offload,
                                   reshard_after_forward=cfg.reshard_after_forward)
    for _, module in chosen:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    log.info("fully_shard (%s, mesh %s, mixed_precision %s, cpu_offload %s) on %d submodule(s) by %s, then the root "
             "%s", calibration.sharding_strategy, tuple(mesh.shape), cfg.mixed_precision, cfg.cpu_offload,
             len(chosen), described, _w.class_name(model))
    return model


def _convert_bn(model: nn.Module, device: torch.device, mode: bool | str, *, sharded: bool) -> nn.Module:
    if mode is False:
        return model
    _BatchNorm = _torch_compat.batch_norm_base()

    plain = [n for n, m in model.named_modules()
             if isinstance(m, _BatchNorm) and not isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm))]
    if not plain:
        return model
    if sharded:
        warn(f"{_w.class_name(model)} is already (partly) sharded, so its BatchNorm ({', '.join(plain[:8])}) cannot "
             f"be converted to SyncBatchNorm (sync_batchnorm={mode!r}): each rank normalises with its own batch. "
             "Fix: convert before your own fully_shard (robustdist.convert_sync_batchnorm), or pass "
             "sync_batchnorm=False to silence this.", once=("fsdp-bn-sharded", id(model)))
        return model
    return convert_batchnorm_for(model, device)
