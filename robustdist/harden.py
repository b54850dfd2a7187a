"""``harden()``: the 3-line change. It composes the parts, each usable alone, and re-implements none.

In order, ``harden(model, loader, cfg, optimizer=...)``:

1. detects the topology (:func:`~robustdist.topology.detect_topology`);
2. calls :func:`~robustdist.process_group.safe_init_process_group` when distributed and no group exists
   (an existing group, e.g. Ray Train's, is used as it is);
3. wraps the model: :func:`~robustdist.ddp.wrap_ddp`, or FSDP2 ``fully_shard`` on the root module with the
   mesh from :func:`~robustdist.fsdp.fsdp_calibrate` when ``distributed.strategy == "fsdp"``;
4. passes the loader through :func:`~robustdist.dataloader.safe_dataloader`;
5. creates an :class:`~robustdist.checkpoint.AtomicCheckpointer` when ``checkpoint.dir`` is set;
6. starts the health guards (:mod:`robustdist.health`): the watchdog unless ``health.hang_timeout`` is None,
   and the step guard with ``health.nan_policy`` and, for DDP, the divergence check every
   ``health.interval_steps`` steps.

One process with no launcher: no group, the model is returned as it is, and the loader gives the same
batches in the same order as before (rebuilt as a ``SafeDataLoader``, whose position can be checkpointed).
Checkpointing and the guards still work.

A training loop that resumes, and survives a rollback::

    h = harden(model, loader, cfg, optimizer=opt)
    step = h.resume(optimizer=opt, scheduler=sched) or 0
    while step < total_steps:
        for x, y in h.loader:                 # a new iteration starts where the checkpoint left the loader
            loss = loss_fn(h.model(x), y)
            loss.backward()
            decision = h.step_guard(loss, step)
            if decision:
                opt.step()
            opt.zero_grad()
            if decision.rolled_back:          # model, optimizer, RNG and loader are back at resume_step
                step = decision.resume_step
                break
            step += 1
            h.save(step, optimizer=opt, scheduler=sched)
            if step == total_steps:
                break
    h.close()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from robustdist.checkpoint import AtomicCheckpointer, CheckpointInfo, LoadedCheckpoint
from robustdist.config import HardenConfig, resolve_config
from robustdist.dataloader import SafeDataLoader, safe_dataloader
from robustdist.ddp import _convert_bn, wrap_ddp
from robustdist.errors import ConfigError
from robustdist.health import StepDecision, StepGuard, Watchdog
from robustdist.log import get_logger
from robustdist.process_group import InitReport, destroy_process_group_if_owned, safe_init_process_group
from robustdist.topology import Topology, detect_topology

__all__ = ["Hardened", "harden"]

log = get_logger(__name__)


class Hardened:
    """What :func:`harden` returns. Unpacks as ``model, loader = harden(...)``.

    Attributes: ``model``, ``loader``, ``topology``, ``init_report``, ``checkpointer`` (or None), ``config``,
    ``watchdog`` (or None), ``guard`` (the :class:`~robustdist.health.StepGuard`), ``optimizer`` (settable:
    used by skip and rollback, and as the default for ``save``/``resume``).
    """

    def __init__(self, *, model: nn.Module, loader: Any, topology: Topology, init_report: InitReport,
                 checkpointer: AtomicCheckpointer | None, config: HardenConfig, optimizer: Any):
        self.model, self.loader, self.topology, self.init_report = model, loader, topology, init_report
        self.checkpointer, self.config = checkpointer, config
        self.scheduler: Any = None
        self.extras: dict[str, Any] = {}
        self.last_loaded: LoadedCheckpoint | None = None
        self._step = 0
        self._closed = False
        self.watchdog: Watchdog | None = None
        self.guard: StepGuard
        self._hooks: list[Any] = []
        self._optimizer = optimizer

    # ------------------------------------------------------------------ drop-in shape
    def __iter__(self) -> Any:
        return iter((self.model, self.loader))

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._optimizer = value
        self.guard.optimizer = value

    # ------------------------------------------------------------------ per step
    def step_guard(self, loss: Any, step: int) -> StepDecision:
        """Call after ``backward()`` and before ``optimizer.step()``; step only if the result is true.

        Beats the watchdog, checks the loss (and gradients) with ``health.nan_policy`` on every rank, and runs
        the divergence check every ``health.interval_steps`` steps. After a rollback, ``decision.resume_step``
        is the step to continue from and the loader must be iterated afresh (``break`` out of the loop over
        it): the next iteration starts at the checkpoint's position.
        """
        if self.watchdog is not None:
            self.watchdog.beat(step)
        decision = self.guard(loss, step)
        self._step = decision.resume_step if decision.rolled_back and decision.resume_step is not None else step + 1
        return decision

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, *, optimizer: Any = None, scheduler: Any = None, force: bool = False,
             **extra: Any) -> CheckpointInfo | None:
        """Save when ``checkpoint.every_n_steps`` divides ``step`` (or always with ``force=True``).

        Saved: the model (prefix-free, or sharded for FSDP), the optimizer and scheduler (given here or
        earlier), ``extra`` entries (stateful objects or plain data), every rank's RNG state and loader
        position. Returns the :class:`CheckpointInfo`, or None when this step is not a saving step.
        """
        if self.checkpointer is None:
            if force:
                raise ConfigError("save(force=True) was called but checkpoint.dir is None; expected a checkpoint "
                                  "directory. Fix: set checkpoint.dir in the config passed to harden().",
                                  rank=self._err_rank())
            return None
        every = self.config.checkpoint.every_n_steps
        if not force and (every is None or step % every):
            return None
        self._remember(optimizer, scheduler, extra)
        state: dict[str, Any] = {"model": self.model, **self._live_state(), **extra}
        per_rank = {"loader": self.loader.state_dict()} if isinstance(self.loader, SafeDataLoader) else None
        self._beat()
        info = self.checkpointer.save(step, state, per_rank=per_rank)
        self._beat()
        return info

    def resume(self, *, optimizer: Any = None, scheduler: Any = None, **extra: Any) -> int | None:
        """Restore the newest valid checkpoint: model, optimizer, scheduler, stateful ``extra`` objects, RNG and
        the loader's position. Returns the step to continue from, or None when there is nothing to resume."""
        if self.checkpointer is None:
            return None
        self._remember(optimizer, scheduler, extra)
        step = self._load(missing_ok=True)
        if step is None:
            log.info("nothing to resume in %s: starting from step 0", self.checkpointer.directory)
            return None
        log.info("resumed from checkpoint step %d", step)
        return step

    def _load(self, *, missing_ok: bool = False) -> int | None:
        if self.checkpointer is None:  # rollback and resume only reach here with a checkpointer
            raise ConfigError("no checkpointer to load from; expected checkpoint.dir to be set. Fix: set it.")
        self._beat()
        per_rank = {"loader": self.loader} if isinstance(self.loader, SafeDataLoader) else None
        loaded = self.checkpointer.load(state={"model": self.model, **self._live_state(), **self.extras},
                                        per_rank=per_rank, missing_ok=missing_ok)
        if loaded is None:
            return None
        self.last_loaded, self._step = loaded, loaded.step
        self.guard.state_restored()
        self._beat()
        return loaded.step

    def _remember(self, optimizer: Any, scheduler: Any, extra: dict[str, Any]) -> None:
        if optimizer is not None:
            self.optimizer = optimizer
        if scheduler is not None:
            self.scheduler = scheduler
        self.extras.update({k: v for k, v in extra.items() if hasattr(v, "load_state_dict")})

    def _live_state(self) -> dict[str, Any]:
        return {k: v for k, v in (("optimizer", self.optimizer), ("scheduler", self.scheduler)) if v is not None}

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the watchdog, wait for an async save (re-raising its error), and destroy the process group
        only if ``harden`` created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.watchdog is not None:
                self.watchdog.close()
            for handle in self._hooks:
                handle.remove()
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            destroy_process_group_if_owned(self.init_report)

    def __enter__(self) -> Hardened:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(self._step)

    def _err_rank(self) -> int | None:
        return self.init_report.rank if self.init_report.distributed else None

    def _install_beats(self) -> None:
        """Beat at forward start and at backward start (a hook on the output), so a rank stuck between
        them is told apart from ranks already waiting in the next collective."""
        def before_forward(module: nn.Module, args: Any) -> None:
            self._beat()

        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(_BackwardBeat(self))

        self._hooks = [self.model.register_forward_pre_hook(before_forward),
                       self.model.register_forward_hook(after_forward)]


class _BackwardBeat:
    def __init__(self, hardened: Hardened):
        self.hardened = hardened

    def __call__(self, grad: torch.Tensor) -> None:
        self.hardened._beat()


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for value in values:
        found = _first_grad_tensor(value)
        if found is not None:
            return found
    return None


def harden(model: nn.Module, loader: Any = None, cfg: Any = None, *, optimizer: Any = None) -> Hardened:
    """Harden a training script (see the module docstring).

    Args:
        model: the bare model.
        loader: a ``DataLoader`` (or ``Dataset``), or None (e.g. Ray Data feeds the loop).
        cfg: a ``HardenConfig``, a dict, a YAML path, or None for defaults.
        optimizer: used by ``nan_policy`` skip/rollback and as the default for ``save``/``resume``. With
            ``strategy="fsdp"``, create it after ``harden`` (sharding replaces the parameters) and set
            ``hardened.optimizer``.
    """
    config = resolve_config(cfg)
    topo = detect_topology()
    report = _init(config, topo)
    checkpointer: AtomicCheckpointer | None = None
    hardened: Hardened | None = None
    try:
        wrapped = _wrap(model, config, topo, report, optimizer)
        safe = safe_dataloader(loader, config) if loader is not None else None
        if config.checkpoint.dir is not None:
            checkpointer = AtomicCheckpointer(config.checkpoint.dir, keep_last=config.checkpoint.keep_last,
                                              async_save=config.checkpoint.async_save,
                                              timeout=config.distributed.timeout,
                                              arrival_timeout=config.checkpoint.arrival_timeout,
                                              config_fingerprint=config.fingerprint())
        hardened = Hardened(model=wrapped, loader=safe, topology=topo, init_report=report, checkpointer=checkpointer,
                            config=config, optimizer=optimizer)
        _start_health(hardened, config)
    except BaseException:
        if hardened is not None and hardened.watchdog is not None:
            hardened.watchdog.close()
        if checkpointer is not None:
            checkpointer.close()
        destroy_process_group_if_owned(report)
        raise
    log.info("hardened: %s", _describe(hardened))
    return hardened


def _init(config: HardenConfig, topo: Topology) -> InitReport:
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        backend = str(dist.get_backend())
        return InitReport(distributed=world > 1, created=False, backend="nccl" if "nccl" in backend else backend,
                          rank=dist.get_rank(), world_size=world, topology=topo)
    return safe_init_process_group(config, topology=topo)


def _wrap(model: nn.Module, config: HardenConfig, topo: Topology, report: InitReport, optimizer: Any) -> nn.Module:
    if not report.distributed:
        return model if not (dist.is_available() and dist.is_initialized()) else wrap_ddp(model, config,
                                                                                           device=topo.device)
    if config.distributed.strategy == "ddp":
        return wrap_ddp(model, config, device=topo.device)
    if optimizer is not None:
        raise ConfigError(
            "harden(..., optimizer=...) with distributed.strategy='fsdp': fully_shard replaces the model's parameters, "
            "so an optimizer built before harden() would update tensors the model no longer uses; expected no "
            "optimizer yet. Fix: h = harden(model, loader, cfg); "
            "h.optimizer = torch.optim.AdamW(h.model.parameters()).",
            rank=report.rank)
    from torch.distributed.fsdp import fully_shard

    from robustdist.fsdp import fsdp_calibrate

    calibration = fsdp_calibrate(topology=topo)
    if config.distributed.sync_batchnorm in ("auto", True):
        model = _convert_bn(model, topo.device)
    fully_shard(model.to(topo.device), **calibration.fully_shard_kwargs())
    return model


def _start_health(h: Hardened, config: HardenConfig) -> None:
    health = config.health
    if health.hang_timeout is not None:
        h.watchdog = Watchdog(health.hang_timeout, dump_dir=health.dump_dir, action=health.hang_action,
                              rank=h.init_report.rank, world_size=h.init_report.world_size)
        h._install_beats()
    ddp = h.init_report.distributed and config.distributed.strategy == "ddp"
    h.guard = StepGuard(health.nan_policy, model=h.model, optimizer=h.optimizer,
                        restore=h._load if h.checkpointer is not None else None,
                        max_rollbacks=health.max_rollbacks,
                        divergence_interval=health.interval_steps if health.check_divergence and ddp else None)


def _describe(h: Hardened) -> str:
    cfg, r = h.config, h.init_report
    parts = [f"launcher {h.topology.launcher}", f"{r.world_size} rank(s)"]
    if r.distributed:
        parts.append(f"backend {r.backend}{' (created here)' if r.created else ' (existing group)'}")
        parts.append(f"model {type(h.model).__name__}")
    parts.append("checkpoints in " + (f"{cfg.checkpoint.dir} every {cfg.checkpoint.every_n_steps} steps"
                                      if h.checkpointer is not None else "(off)"))
    parts.append(f"watchdog {cfg.health.hang_timeout:g} s ({cfg.health.hang_action})" if h.watchdog else "watchdog off")
    parts.append(f"nan_policy {cfg.health.nan_policy} ({h.guard.agreement} agreement)")
    if h.guard.divergence_interval:
        parts.append(f"divergence check every {h.guard.divergence_interval} steps")
    return ", ".join(parts)
