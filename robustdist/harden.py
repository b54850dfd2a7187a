"""``harden()``: the 3-line change. It composes the parts, each usable alone, and re-implements none.

``cfg`` (a ``HardenConfig``, dict, YAML path or None) is resolved once, here; each part gets its own typed
section. In order, ``harden(model, loader, cfg, optimizer=...)``:

1. detects the topology (:func:`~robustdist.runtime.topology.detect_topology`);
2. calls :func:`~robustdist.init.process_group.safe_init_process_group` when distributed and no group exists, or
   :func:`~robustdist.init.process_group.adopt_group` for a group that exists (Ray Train's, or the script's own:
   validated, and told loudly what robustdist cannot protect in it);
3. wraps the model: :func:`~robustdist.parallel.ddp.wrap_ddp` (``distributed`` section), or
   :func:`~robustdist.parallel.fsdp.wrap_fsdp` (``fsdp`` section, per-layer sharding, meta-device init) when
   ``distributed.strategy == "fsdp"``;
4. passes the loader through :func:`~robustdist.data.dataloader.safe_dataloader` (``data`` section);
5. creates an :class:`~robustdist.checkpoint.AtomicCheckpointer` when ``checkpoint.dir`` is set, and a
   :class:`~robustdist.checkpoint.train_state.TrainState` (model, optimizer, scheduler, extras, loader) that it saves;
6. starts the health guards (:mod:`robustdist.health`): a :class:`~robustdist.health.Watchdog` attached to the
   model unless ``health.hang_timeout`` is None, and the step guard with ``health.nan_policy`` (through
   ``h.step_guard``; under DDP it reads the all-reduced gradients, or with ``health.check_gradients`` false only
   the losses, by one all-reduce per step) and, for DDP, the divergence check every ``health.interval_steps``
   steps.

One process with no launcher: no group, the model is returned as it is, and the loader gives the same
batches in the same order as before (rebuilt as a ``SafeDataLoader``, whose position can be checkpointed).
Checkpointing and the guards still work.

A training loop that resumes, and survives a rollback: the README's "Quick start" (the loop ``make demo`` runs).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from robustdist._hardened import Hardened
from robustdist.checkpoint import AtomicCheckpointer, LocalTier
from robustdist.checkpoint._run_owner import RunIdentity, claim
from robustdist.checkpoint.local.tier import lineage_of
from robustdist.checkpoint.train_state import TrainState
from robustdist.config.schema import HardenConfig, resolve_config
from robustdist.data.dataloader import safe_dataloader
from robustdist.frameworks import accelerate as _accelerate
from robustdist.frameworks import fabric as _fabric
from robustdist.frameworks import wrapped as _wrapped
from robustdist.health.step_guard import Watchdog
from robustdist.init.process_group import adopt_group, destroy_process_group_if_owned, safe_init_process_group
from robustdist.parallel import strategy
from robustdist.ray import group as _ray_group
from robustdist.ray import train as _ray_train
from robustdist.ray import tune as _tune
from robustdist.ray.runs import run_directory
from robustdist.recovery import generations as _generations
from robustdist.recovery import loop as _recovery
from robustdist.recovery import joining as _joining
from robustdist.runtime import dist as _dist
from robustdist.runtime.group_sockets import GroupSockets
from robustdist.runtime.log import get_logger
from robustdist.runtime.topology import detect_topology

__all__ = ["Hardened", "harden"]

log = get_logger(__name__)


ConfigInput = HardenConfig | Mapping[str, Any] | str | os.PathLike[str] | None


def harden(model: nn.Module, loader: Any = None, cfg: ConfigInput = None, *,
           optimizer: torch.optim.Optimizer | None = None, shard_policy: Any = None,
           init_weights: Any = None, scaler: Any = None) -> Hardened:
    """Harden a training script (see the module docstring).

    Args:
        model: the bare model (on the meta device too, with ``strategy="fsdp"``).
        loader: a ``DataLoader`` (or ``Dataset``), or None (e.g. Ray Data feeds the loop).
        cfg: a ``HardenConfig``, a dict, a YAML path, or None for defaults.
        optimizer: used by ``nan_policy`` skip/rollback and as the default for ``save``/``resume``. With
            ``strategy="fsdp"``, create it after ``harden`` (sharding replaces the parameters) and set
            ``hardened.optimizer``.
        shard_policy: FSDP only: which submodules get their own ``fully_shard`` (module classes, or a callable
            ``module -> bool``); overrides ``fsdp.shard_modules``.
        init_weights: FSDP only: ``init_weights(module)`` initialises a meta-device model after it is
            materialised (default: the model's own ``reset_parameters``).
        scaler: the fp16 loop's ``torch.amp.GradScaler``: the step guard leaves its overflows to it, and it is
            checkpointed (as ``grad_scaler``) and restored by ``resume``.
    """
    config = resolve_config(cfg)
    return _build(model, loader, config, optimizer=optimizer, shard_policy=shard_policy, init_weights=init_weights,
                  scaler=scaler, into=None)


def _build(model: nn.Module, loader: Any, config: HardenConfig, *, optimizer: torch.optim.Optimizer | None,
           shard_policy: Any, init_weights: Any, scaler: Any, into: Hardened | None,
           kept_loader: Any = None) -> Hardened:
    """harden()'s work, into a new ``Hardened`` or, for an in-process recovery's next generation, into ``into``
    (the same object the script holds, renewed: ``h.model`` is then the new generation's), keeping the previous
    generation's ``SafeDataLoader`` (``kept_loader``; ranks and world size are the same). A replacement worker
    (``robustdist run``) first joins the others' in-process recovery: :mod:`robustdist.recovery.joining`."""
    with _joining.joining(config, detect_topology(), first=into is None):
        return _assemble(model, loader, config, optimizer=optimizer, shard_policy=shard_policy,
                         init_weights=init_weights, scaler=scaler, into=into, kept_loader=kept_loader)


def _assemble(model: nn.Module, loader: Any, config: HardenConfig, *, optimizer: torch.optim.Optimizer | None,
              shard_policy: Any, init_weights: Any, scaler: Any, into: Hardened | None,
              kept_loader: Any = None) -> Hardened:
    """:func:`_build`'s work, once any join is done."""
    given_scaler = scaler
    topo = detect_topology()
    framework = _wrapped.refuse_rewrap(model, topo, config)
    topo = _ray_group.prepare(config, topo, framework=framework)  # Ray Train's group given up for in-process recovery
    # In-process recovery unblocks a collective by shutting the group's connections: record them as they open
    # (the default group, the checkpointer's and the tier's groups).
    recording = contextlib.ExitStack()
    sockets = recording.enter_context(GroupSockets().recording()) if config.recovery.in_process else None
    try:
        report = (adopt_group if _dist.is_up() else safe_init_process_group)(config, topology=topo)
    except BaseException:
        recording.close()
        raise
    finally:
        _ray_group.release()  # the group's store holds the server taken for its port now (or the init failed)
    _generations.group_made(config.distributed.timeout)  # a recovery's next generation watches from here on
    checkpointer: AtomicCheckpointer | None = None
    identity: RunIdentity | None = None
    local: LocalTier | None = None
    watchdog: Watchdog | None = None
    try:
        if framework is not None:  # the framework keeps its DDP (and its sampler, for a loader it prepared)
            wrapped = model
            scaler = scaler if scaler is not None else _wrapped.framework_scaler(framework, model, optimizer)
        else:
            wrapped = strategy.wrap(model, config, topo, distributed=report.distributed, rank=report.rank,
                                    optimizer=optimizer, shard_policy=shard_policy, init_weights=init_weights)
        if _wrapped.keeps_loader(framework, loader, checkpointing=config.checkpoint.dir is not None):
            safe = loader
        elif kept_loader is not None:
            safe = kept_loader  # a recovery keeps the loader (ranks and world are the same): resume sets its position
        else:
            safe = safe_dataloader(loader, config.data)
        ckpt = config.checkpoint
        ray = _ray_train.current() if topo.launcher == "ray_train" else None
        trial = _ray_train.current_trial() if ray is None else None
        tune = trial if trial is not None and trial.function else None  # a function trainable's one process
        if tune is not None:
            _tune.take_over()  # an earlier trial in this (reused) actor that left its Hardened open
        if ckpt.dir is not None:
            directory, identity = run_directory(ckpt.dir, ckpt.run_name, ray, trial)
            checkpointer = AtomicCheckpointer(directory, keep_last=ckpt.keep_last, async_save=ckpt.async_save,
                                              timeout=config.distributed.timeout,
                                              arrival_timeout=ckpt.arrival_timeout,
                                              config_fingerprint=config.fingerprint(),
                                              lock_patience=_tune.LOCK_PATIENCE_S if tune is not None else 0.0)
            claim(checkpointer.directory, identity, checkpointer.rank, checkpointer.collectives)
            if ckpt.local_every_n_steps is not None:
                # a fresh launch renews the lineage; a restart, or an in-process recovery, continues it
                lineage = lineage_of(checkpointer.directory, checkpointer.rank, checkpointer.collectives,
                                     renew=report.attempt == 0 and _recovery.generation() == 0)
                local = LocalTier(ckpt.local_dir, lineage=lineage, replicas=ckpt.replicas,
                                  keep_last=ckpt.local_keep_last, timeout=config.distributed.timeout,
                                  arrival_timeout=ckpt.arrival_timeout)
        health = config.health
        if health.hang_timeout is not None:
            watchdog = Watchdog(health.hang_timeout, dump_dir=health.dump_dir, action=health.hang_action,
                                rank=report.rank, world_size=report.world_size,
                                hand_over=_ray_train.raise_in_training_thread if ray is not None else None
                                ).attach(wrapped)
        recording.close()
        parts: dict[str, Any] = dict(state=TrainState(wrapped, optimizer=optimizer, loader=safe), topology=topo,
                                     init_report=report, checkpointer=checkpointer, config=config, watchdog=watchdog,
                                     local=local, ray=ray, identity=identity, scaler=scaler, tune=tune)
        hardened = Hardened(**parts) if into is None else into._renew(**parts)
    except BaseException as e:
        recording.close()
        _generations.failed(e, sockets)  # a recovery's next generation: the other ranks learn of it, named
        if watchdog is not None:
            watchdog.close()
        if local is not None:
            local.close()
        if checkpointer is not None:
            checkpointer.close()
        destroy_process_group_if_owned(report)
        raise
    if config.recovery.in_process:  # the next generation: the same bare model, loader and arguments
        rebuild = functools.partial(_build, model, loader, config, shard_policy=shard_policy,
                                    init_weights=init_weights, scaler=given_scaler)
        hardened.generations().record(sockets, rebuild)
    _wrapped.hardened_holds(hardened, model, wrapped)
    if tune is not None:
        _tune.opened(hardened)
    log.info("hardened: %s", _describe(hardened))
    return hardened


def _describe(h: Hardened) -> str:
    cfg, r = h.config, h.init_report
    parts = [f"launcher {h.topology.launcher}", f"{r.world_size} rank(s)"]
    if _accelerate.in_charge() is not None:
        parts.append("composed with Accelerate (its DDP and sampler kept)")
    elif _fabric.is_fabric_module(h.model):
        parts.append("composed with Lightning Fabric (its wrapper kept)")
    if r.distributed:
        parts.append(f"backend {r.backend}{' (created here)' if r.created else ' (existing group)'}")
        parts.append(f"model {type(h.model).__name__}")
    parts.append("checkpoints in " + (f"{h.checkpointer.directory} every {cfg.checkpoint.every_n_steps} steps"
                                      if h.checkpointer is not None else "(off)"))
    if h.ray is not None:
        parts.append(f"Ray Train run {h.ray.run_name!r} (committed checkpoints reported to Ray)")
    if h.local is not None:
        parts.append(f"in-memory checkpoints in {h.local.directory} every {cfg.checkpoint.local_every_n_steps} "
                     f"steps ({'a replica on the next node' if any(p is not None for p in h.local.peers) else 'no replica'})")
    parts.append(f"watchdog {cfg.health.hang_timeout:g} s ({cfg.health.hang_action})" if h.watchdog else "watchdog off")
    parts.append(f"nan_policy {cfg.health.nan_policy} through h.step_guard ({h.guard.agreement} agreement"
                 f"{'; GradScaler overflows left to the scaler' if h.guard.scaler is not None else ''})")
    if h.guard.divergence_interval:
        parts.append(f"divergence check every {h.guard.divergence_interval} steps")
    return ", ".join(parts)
