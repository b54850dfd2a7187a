"""``Hardened``: what :func:`robustdist.harden` returns (the model, the loader, and the per-step, checkpoint and
lifecycle calls). Exported as ``robustdist.harden.Hardened``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from robustdist.checkpoint import AtomicCheckpointer, CheckpointInfo, LoadedCheckpoint, LocalSaveInfo, LocalTier
from robustdist.checkpoint._run_owner import RunIdentity
from robustdist.checkpoint.train_state import Stateful, TrainState
from robustdist.config.schema import HardenConfig
from robustdist.data.dataloader import SafeDataLoader
from robustdist.parallel.state_dict import unwrap_model
from robustdist.health import restart_guard as _restart_guard
from robustdist.health.restart_guard import ProgressMarks
from robustdist.health.step_guard import StepDecision, StepGuard, Watchdog
from robustdist.init.process_group import InitReport, destroy_process_group_if_owned
from robustdist.ray import train as _ray_train
from robustdist.ray.reporting import RayReporting
from robustdist.recovery import loop as _recovery
from robustdist.runtime import dist as _dist
from robustdist.runtime import group_teardown
from robustdist.runtime.errors import CheckpointError, ConfigError
from robustdist.runtime.group_sockets import GroupSockets
from robustdist.runtime.log import get_logger, logging_configured
from robustdist.runtime.topology import Topology

__all__ = ["Generations", "Hardened"]

log = get_logger("robustdist.harden")
T = TypeVar("T")


class Generations:
    """What in-process recovery does to a :class:`Hardened` (``recovery.in_process``), and nothing else outside
    this module touches its private state: ``harden`` records the group's connections and how to harden the next
    generation into the same object (:meth:`record`); the recovery loop reads those connections (:attr:`sockets`),
    lets the closed generation's parts go (:meth:`let_go`) and hardens the next one (:meth:`next`)."""

    def __init__(self, hardened: Hardened):
        self._h = hardened

    def record(self, sockets: GroupSockets | None, rebuild: Callable[..., Hardened]) -> None:
        """The connections harden recorded, and ``rebuild(optimizer=..., into=h, kept_loader=...)``."""
        self._h._sockets, self._h._rebuild = sockets, rebuild

    @property
    def sockets(self) -> GroupSockets | None:
        """The current generation's recorded group connections (None where none were recorded)."""
        return self._h._sockets

    def let_go(self, optimizer: Optimizer | None = None) -> None:
        """After ``close()``: drop the closed generation's parts (its checkpointer's group, its watchdog, its report,
        the copy last loaded): they go with their last reference, not keeping the old group, store or memory while
        the next generation is made. Model, loader, optimizer, scheduler, extras stay."""
        h = self._h
        scheduler, extras = h.scheduler, dict(h.extras)
        optimizer = optimizer if optimizer is not None else h.optimizer
        if h.local is not None:  # a save of this generation left behind reports nothing to the next
            h.local.on_complete = None
        h.state = TrainState(unwrap_model(h.model), optimizer=optimizer, loader=h.loader,
                             scaler=h.state.scaler)  # the bare model, until renewed
        h.state.remember(scheduler=scheduler, extra=extras)
        h.checkpointer = h.watchdog = h.local = h.last_loaded = None
        h.guard._restore_fn = None  # a bound method of the object: a cycle (the rebuild makes a new guard)
        h._pending, h._unreported = [], []

    def next(self, optimizer: Optimizer | None) -> GroupSockets | None:
        """After ``close()``: harden the next generation into the object; its recorded connections."""
        h = self._h
        if h._rebuild is None:
            raise ConfigError("this Hardened was not made with recovery.in_process: true; expected one that was. "
                              "Fix: set recovery.in_process: true in the config given to harden().",
                              rank=h._err_rank())
        optimizer = optimizer if optimizer is not None else h.optimizer
        loader, scheduler, extras = h.loader, h.scheduler, dict(h.extras)
        self.let_go(optimizer)
        kept = loader if isinstance(loader, SafeDataLoader) else None
        h._rebuild(optimizer=optimizer, into=h, kept_loader=kept)
        # what the script set on h (h.scheduler = ..., extras given to save) carries over, as a restart's would
        h.state.remember(scheduler=scheduler, extra=extras)
        return h._sockets


class Hardened(RayReporting, ProgressMarks):
    """What :func:`~robustdist.harden.harden` returns. Unpacks as ``model, loader = harden(...)``.

    Attributes: ``model``, ``loader``, ``attempt`` (0 on a fresh run, then 1, 2, ... after restarts, the same on
    every rank), ``state`` (the :class:`~robustdist.checkpoint.train_state.TrainState` that ``save`` and ``resume``
    checkpoint), ``topology``, ``init_report``, ``checkpointer`` (or None), ``local`` (the in-memory
    :class:`~robustdist.checkpoint.LocalTier`, or None), ``config``, ``watchdog`` (or None),
    ``guard`` (the :class:`~robustdist.health.StepGuard`), ``optimizer`` and ``scheduler`` (settable: used by
    skip and rollback, and as the default for ``save``/``resume``), ``ray`` (the Ray Train run this worker
    belongs to, or None), ``last_metrics`` (the metrics saved with the checkpoint resumed from, or None).

    Inside Ray Train (V2), every committed durable checkpoint is reported to Ray with ``ray.train.report``
    (each rank its own files), with the ``metrics`` given to ``save``; ``resume`` also considers
    ``ray.train.get_checkpoint()`` and takes the newest valid of the two; a run resumed at its end reports
    its last metrics again at ``close`` (so a restored Tune trial that is already done has its result). In a Ray
    Tune function trainable's trial (``tune``), ``save`` reports to Tune and ``resume`` takes a checkpoint Tune
    handed over from another trial (:mod:`robustdist.ray.tune`).
    """

    def __init__(self, *, state: TrainState, topology: Topology, init_report: InitReport,
                 checkpointer: AtomicCheckpointer | None, config: HardenConfig,
                 watchdog: Watchdog | None = None, local: LocalTier | None = None,
                 ray: _ray_train.RayTrain | None = None, identity: RunIdentity | None = None, scaler: Any = None,
                 tune: _ray_train.TuneTrial | None = None):
        self._rebuild: Callable[..., Hardened] | None = None  # recovery.in_process: the next generation's harden
        self._sockets: GroupSockets | None = None  # recovery.in_process: this generation's group connections
        self._renew(state=state, topology=topology, init_report=init_report, checkpointer=checkpointer,
                    config=config, watchdog=watchdog, local=local, ray=ray, identity=identity, scaler=scaler,
                    tune=tune)

    def _renew(self, *, state: TrainState, topology: Topology, init_report: InitReport,
               checkpointer: AtomicCheckpointer | None, config: HardenConfig, watchdog: Watchdog | None,
               local: LocalTier | None, ray: _ray_train.RayTrain | None, identity: RunIdentity | None,
               scaler: Any, tune: _ray_train.TuneTrial | None = None) -> Hardened:
        """This object's parts, new (at construction, and at each in-process recovery's next generation: the
        script's ``h`` then holds the new model, group, checkpointer and guards)."""
        self.state, self.topology, self.init_report = state, topology, init_report
        self.checkpointer, self.config, self.watchdog = checkpointer, config, watchdog
        self.local, self.ray, self.identity, self.tune = local, ray, identity, tune
        self._adopted: dict[str, Any] | None = None  # a Tune trial's state from another trial's checkpoint
        self._handed: dict[str, Any] | None = None
        self.last_loaded: LoadedCheckpoint | None = None
        self.last_metrics: dict[str, Any] | None = None
        self._unreported: list[tuple[CheckpointInfo, dict[str, Any]]] = []  # committed (or committing) durable saves
        self._reported = False  # this attempt reported to Ray
        self._resumed_from: int | None = None
        self._progress_marked = True  # until resume() runs there is no record to mark
        self._pending: list[CheckpointInfo] = []
        if local is not None:
            local.on_complete = self._committed
        self._step = 0
        self._closed = False
        health = config.health
        ddp = init_report.distributed and config.distributed.strategy == "ddp"
        self.guard = StepGuard(health.nan_policy, model=state.model, optimizer=state.optimizer,
                               restore=self._load if checkpointer is not None else None,
                               max_rollbacks=health.max_rollbacks, check_gradients=health.check_gradients,
                               divergence_interval=health.interval_steps if health.check_divergence and ddp else None,
                               scaler=scaler, overflow_warn_after=health.scaler_overflow_warn_after)
        if scaler is not None:  # its scale and growth tracker: a resume without them skips other steps
            state.scaler = scaler
        return self

    def generations(self) -> Generations:
        """In-process recovery's one way into this object (``harden`` and :mod:`robustdist.recovery.loop` use it;
        a script has no need of it)."""
        return Generations(self)

    # ------------------------------------------------------------------ drop-in shape
    def __iter__(self) -> Any:
        log.info("harden() unpacked as `model, loader`: the step guard (nan_policy %r) runs only through "
                 "h.step_guard(loss, step), so non-finite losses are not checked in this form. Keep the Hardened "
                 "object (h = harden(...)) and call h.step_guard after backward() to guard them.",
                 self.config.health.nan_policy)
        return iter((self.model, self.loader))

    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def loader(self) -> Any:
        return self.state.loader

    @property
    def optimizer(self) -> Optimizer | None:
        return self.state.optimizer

    @optimizer.setter
    def optimizer(self, value: Optimizer | None) -> None:
        self.state.optimizer = value
        self.guard.optimizer = value

    @property
    def scheduler(self) -> Stateful | None:
        return self.state.scheduler

    @scheduler.setter
    def scheduler(self, value: Stateful | None) -> None:
        self.state.scheduler = value

    @property
    def extras(self) -> dict[str, Stateful]:
        return self.state.extras

    @property
    def attempt(self) -> int:
        """This job's attempt number, the same on every rank: 0 on the first run, 1 after the first torchrun
        restart, and so on. It comes from the job's store (``init_report.attempt``), never from one node's
        ``TORCHELASTIC_RESTART_COUNT``, which torchrun counts per node (see :mod:`robustdist.init.process_group`)."""
        return self.init_report.attempt

    # ------------------------------------------------------------------ the loop
    def run(self, train_fn: Callable[[Hardened, int], T], *, optimizer: Optimizer | None = None,
            scheduler: Stateful | None = None, **extra: Any) -> T:
        """Resume, run ``train_fn(h, step)`` from the step resumed (0 on a fresh run), close, and return what it
        returned. Collective: every rank calls it. The README's loop, as a function::

            def train(h, step):
                while step < total_steps:
                    for x, y in h.loader:
                        ...
                        step += 1
                        h.save(step, optimizer=opt, scheduler=sched)
                        if step == total_steps:
                            break
                return step

            h = harden(model, loader, cfg, optimizer=opt)
            h.run(train, optimizer=opt, scheduler=sched)

        By default it is exactly ``with h: train(h, h.resume(...) or 0)``: a fault ends the process, and the
        launcher's restart resumes. With ``recovery.in_process: true`` (experimental, docs/recovery.md) a fault on
        any rank is recovered in the same processes: every rank tears down, ``h`` is hardened again (a new group,
        a new DDP; the same loader, optimizer and scheduler), resumes from the newest checkpoint (the in-memory
        tier's, when it has one) and calls ``train_fn`` again. Inside ``train_fn`` use ``h.model``, not a module
        kept from before: an earlier generation's DDP module is retired (using it raises). A fault that repeats,
        or one that must not be papered over, ends the process as before (:mod:`robustdist.recovery.loop`).
        """
        if self._closed:
            raise ConfigError("h.run() was called on a closed Hardened (h.run closes it when it returns, as does "
                              "h.close()); expected an open one. Fix: harden the model again for another run.",
                              rank=self._err_rank())
        if self._rebuild is None:
            with self:
                return train_fn(self, self.resume(optimizer=optimizer, scheduler=scheduler, **extra) or 0)
        return _recovery.run_hardened(self, train_fn, optimizer=optimizer, scheduler=scheduler, extra=extra)

    # ------------------------------------------------------------------ per step
    def step_guard(self, loss: Any, step: int, *, scaler: Any = None) -> StepDecision:
        """Call after ``backward()`` and before ``optimizer.step()``; step only if the result is true.

        With fp16 and a ``torch.amp.GradScaler`` (given here or to ``harden``), pass the *unscaled* loss and call
        ``scaler.step(optimizer)`` when the result is true and ``scaler.update()`` every step: an overflow
        returns true (``action == "overflow"``) and the scaler skips it; a non-finite loss follows
        ``health.nan_policy`` (:class:`~robustdist.health.StepGuard`).

        Beats the watchdog, checks the loss (and gradients) with ``health.nan_policy`` on every rank, and runs
        the divergence check every ``health.interval_steps`` steps. After a rollback, ``decision.resume_step``
        is the step to continue from and the loader must be iterated afresh (``break`` out of the loop over
        it): the next iteration starts at the checkpoint's position.
        """
        self._beat(step)
        decision = self.guard(loss, step, scaler=scaler)
        self._step = decision.resume_step if decision.rolled_back and decision.resume_step is not None else step + 1
        self._beat()
        return decision

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, *, optimizer: Optimizer | None = None, scheduler: Stateful | None = None,
             force: bool = False, metrics: Mapping[str, Any] | None = None,
             **extra: Any) -> CheckpointInfo | LocalSaveInfo | None:
        """Save when ``checkpoint.every_n_steps`` divides ``step`` (or always with ``force=True``), and take an
        in-memory checkpoint when ``checkpoint.local_every_n_steps`` divides it. Collective: every rank calls it.

        Saved: the model (prefix-free, or sharded for FSDP), the optimizer and scheduler (given here or
        earlier), ``extra`` entries (stateful objects or plain data), every rank's RNG state and loader
        position. ``metrics`` (e.g. ``{"loss": ...}``) go into the durable checkpoint's manifest and, inside Ray
        Train, are reported with it (``step`` added unless given); give the same keys on every rank (Ray keeps
        rank 0's). Returns the durable :class:`CheckpointInfo`, else the in-memory tier's
        :class:`~robustdist.checkpoint.LocalSaveInfo`, or None when this step is not a saving step.

        Inside Ray Train a synchronous durable save is reported to Ray as soon as it commits; an asynchronous
        one at the next durable save (once it has committed) or at ``close``. In a Ray Tune function trainable's
        trial, each call given ``metrics`` reports them to Tune once (``ray.tune.report``): with the checkpoint
        when this call committed a synchronous durable save, the metrics alone otherwise (so Tune's PBT can
        exploit it); without ``metrics`` nothing is reported.
        """
        if self.checkpointer is None:
            if force:
                raise ConfigError("save(force=True) was called but checkpoint.dir is None; expected a checkpoint "
                                  "directory. Fix: set checkpoint.dir in the config passed to harden().",
                                  rank=self._err_rank())
            self._report_uncommitted(step, metrics, 0)
            return None
        cfg = self.config.checkpoint
        durable = force or (cfg.every_n_steps is not None and step % cfg.every_n_steps == 0)
        local = self.local is not None and cfg.local_every_n_steps is not None and step % cfg.local_every_n_steps == 0
        if not durable and not local:
            self._report_uncommitted(step, metrics, 0)
            return None
        self._remember(optimizer, scheduler, extra)
        self._mark_progress()
        info: CheckpointInfo | LocalSaveInfo | None = None
        sent = 0
        if local and self.local is not None:
            with self._bounded("in-memory checkpoint save"):
                info = self.state.save_local(self.local, step, extra)
        if durable:
            shown = {"step": step, **_ray_train.json_metrics(metrics or {})}
            self._report_committed(wait=True)  # an async save before this one: committed by now (save waits)
            metadata: dict[str, Any] = {"metrics": shown}
            if self.identity is not None and not self.identity.empty:
                metadata["run"] = {"run": self.identity.run, "config": self.identity.config}
            if self._adopted is not None:
                metadata["adopted"] = self._adopted
            with self._bounded("checkpoint save"):
                info = self.state.save(self.checkpointer, step, extra, metadata=metadata)
            self._pending.append(info)
            if self.ray is not None or (self.tune is not None and metrics is not None and not cfg.async_save):
                self._unreported.append((info, {"step": step, **(metrics or {})}))
            if not cfg.async_save:
                sent = self._report_committed(wait=False)
        self._report_uncommitted(step, metrics, sent)
        self._mark_progress()
        return info

    def resume(self, *, optimizer: Optimizer | None = None, scheduler: Stateful | None = None,
               **extra: Any) -> int | None:
        """Restore the newest valid checkpoint: model, optimizer, scheduler, stateful ``extra`` objects, RNG and
        the loader's position. Collective: every rank calls it. Returns the step to continue from, or None
        when there is nothing to resume.

        Logged at INFO, or on rank 0 at WARNING while logging is not configured (so a resume is never silent)."""
        if self.checkpointer is None:
            return None
        self._remember(optimizer, scheduler, extra)
        self.checkpointer.check_ready("load")
        if _recovery.generation() == 0:  # an in-process recovery counts its own faults (robustdist.recovery.loop)
            self._guard_restarts(self.attempt, self.config.health.max_restarts_without_progress, self._err_rank())
        level = logging.INFO if logging_configured() or self.init_report.rank != 0 else logging.WARNING
        ray_checkpoint, why, ray_step, ray_first = self._ray_candidate(level)
        step = self._load(missing_ok=True, ray_checkpoint=ray_checkpoint, ray_step=ray_step, ray_first=ray_first)
        self._resumed(step)
        if step is None:
            log.log(level, "nothing to resume in %s%s: starting from step 0", self.checkpointer.directory,
                    " or in Ray Train's checkpoints" if self.ray is not None else "")
            return None
        loaded = self.last_loaded
        source = loaded.source_detail or loaded.source if loaded else "durable"
        where = loaded.path if loaded is not None and loaded.source == "ray" else self.checkpointer.directory
        written = loaded.manifest.get("torch") if loaded is not None else None
        versions = (f"; written by torch {written[:40]}, resumed under torch {torch.__version__}"
                    if isinstance(written, str) and written != torch.__version__ else "")
        log.log(level, "resumed from checkpoint step %d (%s%s) in %s%s", step, source, f"; {why}" if why else "",
                where, versions)
        return step

    def _load(self, *, missing_ok: bool = False, ray_checkpoint: Any = None, ray_step: int | None = None,
              ray_first: bool = False) -> int | None:
        if self.checkpointer is None:  # rollback and resume only reach here with a checkpointer
            raise ConfigError("no checkpointer to load from; expected checkpoint.dir to be set. Fix: set it.")
        loaded = None
        with self._bounded("checkpoint load"):
            if ray_checkpoint is not None and ray_first:
                loaded = self._load_ray(ray_checkpoint, ray_step)
            if loaded is None:
                failed: CheckpointError | None = None
                try:
                    loaded = self.state.load(self.checkpointer, missing_ok=missing_ok, local=self.local)
                except CheckpointError as e:  # every copy of robustdist's own failed: Ray's may still be good
                    if ray_checkpoint is None or ray_first:
                        raise
                    failed = e
                if ray_checkpoint is not None and not ray_first and (loaded is None or loaded.step < (ray_step or 0)):
                    log.warning("robustdist's own checkpoints gave %s, older than Ray Train's step %s: trying Ray's",
                                f"step {loaded.step}" if loaded is not None else "nothing valid", ray_step)
                    loaded = self._load_ray(ray_checkpoint, ray_step) or loaded
                if loaded is None and failed is not None:
                    raise failed
        if loaded is None:
            return None
        self.last_metrics = self._metrics_of(loaded)
        self._lineage(loaded)
        self.last_loaded, self._step = loaded, loaded.step
        self.guard.state_restored()
        self._beat()
        return loaded.step

    def _bounded(self, what: str) -> contextlib.AbstractContextManager[None]:
        """While a checkpoint operation runs, the watchdog allows its own bound (the checkpoint timeout plus the
        arrival bound) instead of calling a slow, healthy save a hang."""
        if self.watchdog is None or self.checkpointer is None:
            return contextlib.nullcontext()
        bound = self.checkpointer.timeout + self.checkpointer.arrival_timeout
        return self.watchdog.allow(bound, what)

    def _remember(self, optimizer: Optimizer | None, scheduler: Stateful | None, extra: dict[str, Any]) -> None:
        self.state.remember(optimizer=optimizer, scheduler=scheduler, extra=extra)
        self.guard.optimizer = self.state.optimizer

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, keep_local: bool = False) -> None:
        """Stop the watchdog (and its hooks), wait for an async save (re-raising its error), release the
        checkpoint directory's lock, remove the in-memory tier's files when every rank closes cleanly (unless
        ``keep_local``), and destroy the process group only if ``harden`` created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        reporting: BaseException | None = None
        try:
            self._report_at_close()
        except BaseException as e:  # still stop the watchdog, release the lock and the group; then raise it
            reporting = e
        try:
            if self.watchdog is not None:
                self.watchdog.close()
            try:
                if self.local is not None:
                    self.local.close(clean=not keep_local)
            finally:
                if self.checkpointer is not None:
                    self.checkpointer.close()
        finally:
            # A DDP freed after its group is destroyed must not own it last (runtime.group_teardown): a group
            # robustdist made is pinned as it is destroyed; one Ray or the script destroys later, here.
            if not self.init_report.created and _dist.is_up():
                group_teardown.pin_ddp_modules()
            destroy_process_group_if_owned(self.init_report)
        if reporting is not None:
            try:  # its traceback holds this frame: cleared, no cycle keeps this object alive
                raise reporting
            finally:
                reporting = None

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._closed

    def __enter__(self) -> Hardened:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Close; when an exception ends the block, record it for the restart-loop guard and keep the in-memory
        tier's files (the restart needs them)."""
        if exc is not None and self.checkpointer is not None and isinstance(exc, Exception):
            _restart_guard.record_error(self.checkpointer.directory, self.attempt, self.init_report.rank, exc)
        if exc is not None:
            self.ray = None  # no collective reports from a rank that is failing: the others may not be there
        self.close(keep_local=exc is not None)

    def _beat(self, step: int | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(self._step if step is None else step)

    def _err_rank(self) -> int | None:
        return self.init_report.rank if self.init_report.distributed else None
