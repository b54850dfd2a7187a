"""Runtime health guards, each usable alone: :class:`Watchdog` (hangs) and :class:`StepGuard` (non-finite
losses and gradients, and periodic cross-rank divergence checks).

**Watchdog.** ``beat(step)`` only stores the step, a counter and a monotonic time read. A detecting
thread wakes about once a second and does no store I/O. With a store and more than one rank, a separate
heartbeat thread writes this rank's liveness record (wall time, node label, pid, last step) to the c10d store
every ``min(5, hang_timeout / 4)`` s, whether or not training beats, over a connection of its own: one small
``set`` per interval per rank. From the last 3.5 intervals before a hang verdict on, it also reads every rank's
record once an interval, to see on this rank's own clock which records stopped changing
(:mod:`robustdist.runtime.liveness`). When no beat arrived for ``hang_timeout`` seconds, the detecting thread:

1. dumps every thread's stack with ``faulthandler`` to stderr and to ``dump_dir/hang-rank<r>-<pid>.txt``;
2. on every rank that sees the hang (not only rank 0), publishes where its main thread is and reads every
   rank's record, and names, apart, the ranks it *lost* (a record seen unchanged for 3 intervals, closed, or
   never written), grouped by node: ``lost ranks 2, 3 on node 1 (host gpu-07, 10.0.0.2): no heartbeat for 12 s
   or more``, and the live ranks that are *behind*: ``rank 1 last beat at step 120, 610 s ago; ranks 0, 2, 3 at
   step 121``. It waits at most ``grace`` s for live ranks' records and never for lost ones. Every store call runs
   on a thread the report abandons half a second after ``grace``, so a store that stops answering delays nothing
   (the report then says so). The report is logged at ERROR, appended to the dump file and kept in ``reports``
   (:class:`HangReport`: ``lost``, ``lost_nodes``, ``behind``);
3. then, with ``action="dump"``, keeps waiting (and logs when beats resume); with ``action="abort"`` it
   exits the process with :data:`HANG_EXIT_CODE` (86), so torchrun (``--max-restarts``) or Ray restarts it.

A partitioned or frozen node is thus named within about ``hang_timeout`` + ``grace`` + 1 s of the hang, by
every rank that can still reach the store, instead of after the collective timeout (30 min on gloo).

Ranks are compared by (step, number of beats), so when every rank beats at the same points of a step (as
``harden`` does: forward start, backward start, ``step_guard``), a rank stuck between two beats is named
even though the others, blocked in the next collective, never finished that step either.

**StepGuard.** ``guard(loss, step)`` is called once per optimizer step, after ``backward()`` and before
``optimizer.step()``; it returns a :class:`StepDecision`, true when the optimizer should step. Every rank
reaches the same decision, by one of three agreements:

* ``"local"`` (world size 1): nothing to agree; the loss alone is checked.
* ``"gradients"`` (a DDP model, unless ``check_gradients=False``): after DDP's backward all-reduce every rank
  holds the same averaged gradients, and a non-finite loss on any rank makes them non-finite (NaN/Inf
  propagate through the sum). Every rank checks its gradients, with no collective, and decides alike
  (:mod:`robustdist.health.grad_check`: on the CPU one sum per tensor; on an accelerator GradScaler's fused
  non-finite check, read back together with the loss in one host sync per step). Non-finite gradients from
  finite losses (an overflow) count as bad too. A loss that is non-finite while every gradient is finite
  changes no parameter: that rank warns and the step goes on.
* ``"allreduce"`` (any other model, e.g. FSDP whose gradients are sharded, and a DDP model with
  ``check_gradients=False``): one all-reduce of a world-size vector of loss flags per step, which also names
  the ranks. Only the losses are checked: a NaN loss on one rank is still caught on every rank before
  ``optimizer.step()`` (any rank's flag makes the step bad everywhere), but non-finite gradients from finite
  losses (an overflow in backward) are not: they reach ``optimizer.step()``.

Only when something *is* wrong do the ranks exchange their loss values (one ``all_gather_object``) to name
the ranks that saw them. Policies, identical on every rank:

* ``raise``: :class:`~robustdist.runtime.errors.NonFiniteLossError` naming the step and the ranks.
* ``skip``: zero the gradients, put BatchNorm running statistics back as they were before this step's
  forward, and return a false decision: do not call ``optimizer.step()``.
* ``rollback``: restore the last committed checkpoint (model, optimizer, RNG; with ``harden`` also the
  scheduler and the loader's position) and return a false decision whose ``resume_step`` is the step to
  continue from. The same step failing again after ``max_rollbacks`` rollbacks raises instead.
* ``warn``: log and return a true decision.

**With a GradScaler** (fp16): pass it (``StepGuard(scaler=...)``, ``guard(loss, step, scaler=...)``, or
``harden(..., scaler=...)``); an overflow is then the scaler's business, not a bad step
(:mod:`robustdist.health.scaler` says exactly how the ranks agree on one).

With ``divergence_interval`` set, every that many steps (after the finiteness check) the guard runs
:func:`~robustdist.parallel.consistency.check_consistency` on the parameters; a mismatch rolls back under
``rollback``, is logged under ``warn``, and raises :class:`~robustdist.runtime.errors.RankDivergenceError` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from robustdist.config.validate import show
from robustdist.health import scaler as _scaler
from robustdist.health.grad_check import check, finite_loss, finite_number, loss_value
from robustdist.health.watchdog import HANG_EXIT_CODE, HangReport, Watchdog
from robustdist.parallel.consistency import check_consistency
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteLossError,
    RankDivergenceError,
    ranks_phrase,
)
from robustdist.runtime.log import get_logger

__all__ = ["HANG_EXIT_CODE", "HangReport", "StepDecision", "StepGuard", "Watchdog"]

if TYPE_CHECKING:
    from robustdist.checkpoint import AtomicCheckpointer

log = get_logger(__name__)
POLICIES = ("raise", "skip", "rollback", "warn")
AGREEMENTS = ("auto", "local", "gradients", "allreduce")


@dataclass
class StepDecision:
    """What the guard decided for one step. ``bool(decision)`` says whether to call ``optimizer.step()``."""

    step: int
    action: str = "ok"  # ok | overflow (the GradScaler skips it) | skip | rollback | warn
    ranks: tuple[int, ...] = ()
    resume_step: int | None = None
    reason: str = ""

    def __bool__(self) -> bool:
        return self.action in ("ok", "overflow", "warn")

    @property
    def rolled_back(self) -> bool:
        return self.action == "rollback"


@dataclass
class _Snapshot:
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module | None) -> _Snapshot:
        if model is None:
            return cls()
        norms = (m for m in model.modules() if isinstance(m, _torch_compat.norm_base()))
        return cls([(b, b.detach().clone()) for m in norms for b in m.buffers(recurse=False) if b is not None])

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.pairs:
                live.copy_(saved)


class StepGuard:
    """Per-step non-finite check and divergence check with one policy on every rank (see the module docstring).

    Args:
        nan_policy: "raise", "skip", "rollback" or "warn".
        model: the trained model (needed for "gradients" agreement, "skip" and divergence checks).
        optimizer: zeroed on skip/rollback (default: the model's gradients are zeroed).
        checkpointer: an ``AtomicCheckpointer`` to roll back with (restores ``model`` and ``optimizer``).
        restore: instead of ``checkpointer``: a callable that restores the last checkpoint and returns its step.
        group: the process group (default: the default group).
        agreement: "auto", "local", "gradients" or "allreduce".
        max_rollbacks: rollbacks of the same step before giving up.
        divergence_interval: run the cross-rank parameter check every this many steps (None: never).
        check_gradients: with a DDP model, decide from its all-reduced gradients ("gradients" agreement, which
            also catches an overflow whose loss is finite). False: decide from the losses alone with one
            all-reduce per step ("allreduce"), which lets such an overflow reach ``optimizer.step()``. Other
            models check only the loss either way.
        scaler: a ``torch.amp.GradScaler`` (or one with its API, e.g. FSDP's ``ShardedGradScaler``) whose
            overflows are its own business (see the module docstring); ``guard(..., scaler=...)`` overrides it.
        overflow_warn_after: GradScaler overflows in a row before a WARNING.
    """

    def __init__(self, nan_policy: str = "raise", *, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, checkpointer: AtomicCheckpointer | None = None,
                 restore: Callable[[], int | None] | None = None, group: Any = None, agreement: str = "auto",
                 max_rollbacks: int = 3, divergence_interval: int | None = None, check_gradients: bool = True,
                 scaler: Any = None, overflow_warn_after: int = 10):
        if nan_policy not in POLICIES:
            raise ConfigError(f"nan_policy={nan_policy!r}; expected one of {POLICIES}. Fix: pass one of those.")
        if agreement not in AGREEMENTS:
            raise ConfigError(f"agreement={agreement!r}; expected one of {AGREEMENTS}. Fix: pass one of those.")
        if not isinstance(check_gradients, bool):
            raise ConfigError(f"check_gradients is {show(check_gradients)}; expected True or False. Fix: pass a bool "
                              "(with harden(), set health.check_gradients: true or false).")
        if agreement == "gradients" and not check_gradients:
            raise ConfigError("agreement='gradients' reads the gradients, but check_gradients=False; expected one "
                              "or the other. Fix: drop agreement= (auto then agrees by 'allreduce') or drop "
                              "check_gradients=False.")
        if nan_policy == "rollback" and checkpointer is None and restore is None:
            raise ConfigError("nan_policy='rollback' needs a checkpoint to roll back to; expected checkpointer= or "
                              "restore=. Fix: pass the AtomicCheckpointer you save with (or use harden()).")
        if not isinstance(overflow_warn_after, int) or isinstance(overflow_warn_after, bool) or overflow_warn_after < 1:
            raise ConfigError(f"overflow_warn_after is {show(overflow_warn_after)}; expected an integer >= 1. Fix: "
                              "pass one (with harden(), health.scaler_overflow_warn_after).")
        self.scaler = _scaler.check_scaler(scaler)
        self.overflow_warn_after = overflow_warn_after
        self.overflows = 0  # GradScaler overflows seen (steps the scaler skipped)
        self._overflow_streak = 0
        self._scaler_agreed: bool | None = None  # every rank passes an enabled scaler, or none (first call)
        self.nan_policy, self.model, self.optimizer, self.group = nan_policy, model, optimizer, group
        self.checkpointer, self._restore_fn, self.max_rollbacks = checkpointer, restore, max_rollbacks
        self.divergence_interval, self.check_gradients = divergence_interval, check_gradients
        self.distributed = _dist.is_multi(group)
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.agreement = self._choose_agreement(agreement)
        # the parameters are fixed once the model is wrapped; walking the module tree every step costs more
        # than the check itself
        self.params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self._failing: tuple[int, int] | None = None  # (step, rollbacks of it so far)
        self._snapshot = _Snapshot.of(model) if nan_policy == "skip" else _Snapshot()
        self.last: StepDecision | None = None

    def _choose_agreement(self, wanted: str) -> str:
        if not self.distributed:
            return "local"
        if wanted == "auto":
            from torch.nn.parallel import DistributedDataParallel

            ddp = _all_data_parallel(self.model, DistributedDataParallel)
            return "gradients" if ddp and self.check_gradients else "allreduce"
        if wanted == "gradients" and self.model is None:
            raise ConfigError("agreement='gradients' needs the DDP model (model=); expected one. Fix: pass model= "
                              "or use agreement='allreduce'.")
        return wanted

    @property
    def err_rank(self) -> int | None:
        return self.rank if self.distributed else None

    def state_restored(self) -> None:
        """Call after restoring the model outside the guard (a resume): ``skip`` then restores BatchNorm
        statistics to the restored values, not to those from before the restore."""
        self._take_snapshot()

    def _take_snapshot(self) -> None:
        if self.nan_policy == "skip":
            self._snapshot = _Snapshot.of(self.model)

    # ------------------------------------------------------------------ the per-step hook
    def __call__(self, loss: Any, step: int, *, scaler: Any = None) -> StepDecision:
        """Check ``loss`` (a tensor or a float) for step ``step``; act by the policy; see the module docstring.
        ``scaler``: this step's GradScaler (default: the one given at construction)."""
        scaler = self._scaler_for(_scaler.active(_scaler.check_scaler(scaler) if scaler is not None else self.scaler))
        values: list[Any] | None = None
        if scaler is None:
            local_bad, bad, ranks = self._agree(loss)
            overflow = False
        else:
            local_bad, bad, ranks, overflow, values = _scaler.agree_scaled(self, loss, scaler)
        if overflow == "exhausted":  # agreed on every rank: some rank's scale fell below MIN_SCALE
            bad, ranks = True, ()
            values = values if values is not None else [loss_value(loss)]
        if not bad:
            if local_bad:
                log.warning("step %d: the loss is %s on this rank but every gradient is finite after DDP's "
                            "all-reduce, so no parameter is affected; continuing", step, loss_value(loss),
                            all_ranks=True)
            if self._failing is not None and step > self._failing[0]:
                self._failing = None
            self._count_overflow(step, scaler, bool(overflow))
            decision = self._check_divergence(step)
            if decision is None:
                self._take_snapshot()  # the state after this good step is the one a skip returns to
                decision = StepDecision(step, "overflow", reason="gradient overflow under GradScaler") if overflow \
                    else StepDecision(step)
        else:
            if values is None:
                ranks, values = self._name(local_bad, loss, ranks)
            what = self._describe(step, ranks or (), values)
            if overflow == "exhausted":
                what = (f"step {step}: gradients still non-finite at GradScaler scale {_scaler.scale_text(scaler)}, "
                        f"below {_scaler.MIN_SCALE:g}, after {self._overflow_streak} overflows in a row, with every "
                        "loss finite: not an fp16 overflow the scaler can fix (a NaN in an earlier micro-step, or one "
                        "backward made)")
            decision = self._act(step, ranks or (), what, scaler)
        self.last = decision
        return decision

    def _scaler_for(self, scaler: Any) -> Any:
        """The step's active scaler, checked once against every rank's: the ranks must all pass an enabled scaler,
        or none, since they decide an overflow differently (one gather, at the first call only)."""
        active = scaler is not None
        if self._scaler_agreed is None:
            flags = _dist.gather_objects(active, self.group) if self.distributed else [active]
            if len(set(flags)) > 1:
                mine = [r for r, f in enumerate(flags) if f]
                raise ConfigError(f"the step guard was given an enabled GradScaler on {ranks_phrase(mine)} but not "
                                  "on the others; expected the same on every rank (each decides an overflow "
                                  "differently without one). Fix: pass the same scaler= on every rank, enabled alike.",
                                  rank=self.err_rank)
            self._scaler_agreed = active
        elif active != self._scaler_agreed:
            raise ConfigError(f"the step guard was {'given' if active else 'not given'} an enabled GradScaler at this "
                              f"step but {'was not' if active else 'was'} at its first; expected the same every step "
                              "(every rank must decide alike). Fix: pass scaler= on every call, or give it once to "
                              "harden() or StepGuard().", rank=self.err_rank)
        return scaler

    def _count_overflow(self, step: int, scaler: Any, overflow: bool) -> None:
        if not overflow:
            self._overflow_streak = 0
            return
        self.overflows += 1
        self._overflow_streak += 1
        _scaler.log_overflow(step, scaler, self._overflow_streak, self.overflows, self.overflow_warn_after)

    def _agree(self, loss: Any) -> tuple[bool, bool, tuple[int, ...] | None]:
        """(this rank's loss is non-finite, the ranks agree the step is bad, the ranks named when known)."""
        if self.agreement == "gradients":  # one host sync on an accelerator, the loss's included
            loss_finite, grads_finite = check(loss, self.params)
            return not loss_finite, not grads_finite, None
        local_bad = not finite_loss(loss)
        if self.agreement == "local":
            return local_bad, local_bad, ((0,) if local_bad else ())
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=self.device())
        flags[self.rank] = float(local_bad)
        dist.all_reduce(flags, group=self.group)
        named = tuple(r for r, f in enumerate(flags.tolist()) if f)
        return local_bad, bool(named), named

    def device(self) -> torch.device:
        """The device this guard's collectives use (the group's backend decides)."""
        return _dist.collective_device(_dist.backend_kind(self.group))

    def _name(self, local_bad: bool, loss: Any, ranks: tuple[int, ...] | None) -> tuple[tuple[int, ...], list[Any]]:
        """Every rank's loss value, gathered only on the rare bad path (every rank is on it: they agreed)."""
        if not self.distributed:
            return ((0,) if local_bad else ()), [loss_value(loss)]
        values = _dist.gather_objects(loss_value(loss), self.group)
        named = tuple(r for r, v in enumerate(values) if not finite_number(v))
        return (ranks if ranks is not None and not named else named), values

    def _describe(self, step: int, ranks: tuple[int, ...], values: list[Any]) -> str:
        if ranks:
            shown = ", ".join(f"rank {r}: {values[r] if r < len(values) else '?'}" for r in ranks)
            what = f"a non-finite loss on {ranks_phrase(ranks)} ({shown})" if self.distributed \
                else f"a non-finite loss ({values[0]})"
        else:
            what = "non-finite gradients while every rank's loss was finite (exploding gradients or an overflow)"
        return f"step {step}: {what}"

    # ------------------------------------------------------------------ policies
    def _act(self, step: int, ranks: tuple[int, ...], what: str, scaler: Any = None) -> StepDecision:
        fix = ("Fix: find the batch or the operation that produced it (torch.autograd.set_detect_anomaly(True) "
               "names the backward op), lower the learning rate or clip gradients; health.nan_policy='skip' "
               "or 'rollback' lets training continue past it.")
        if not ranks and scaler is None:  # the gradients alone: the usual cause in fp16 is the scaler's overflow
            fix += (" If you train with torch.amp.GradScaler (fp16), pass it (h.step_guard(loss, step, "
                    "scaler=scaler), or harden(..., scaler=scaler)): its overflows are then skipped by the scaler, "
                    "not treated as a bad step.")
        if self.nan_policy == "raise":
            raise NonFiniteLossError(f"{what}; expected finite values on every rank. {fix}", rank=self.err_rank,
                                     ranks=ranks)
        if self.nan_policy == "warn":
            log.warning("%s; nan_policy='warn': stepping anyway", what)
            return StepDecision(step, "warn", ranks, reason=what)
        if scaler is not None:
            _scaler.record_with(scaler, self.optimizer, self.nan_policy, self.err_rank)
        self._zero_grad()
        if self.nan_policy == "skip":
            self._snapshot.restore()
            log.warning("%s; nan_policy='skip': gradients zeroed, optimizer step skipped", what)
            return StepDecision(step, "skip", ranks, reason=what)
        return self._rollback(step, ranks, what)

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def _rollback(self, step: int, ranks: tuple[int, ...], what: str) -> StepDecision:
        count = self._failing[1] + 1 if self._failing is not None and self._failing[0] == step else 1
        if count > self.max_rollbacks:
            raise NonFiniteLossError(
                f"{what}, again after {self.max_rollbacks} rollback(s) of this step (health.max_rollbacks); expected "
                "a rollback to get past it. Fix: the failure is deterministic: inspect that step's batch, or use "
                "nan_policy='skip' to step over it.", rank=self.err_rank, ranks=ranks)
        self._failing = (step, count)
        try:
            resumed = self._restore()
        except CheckpointError as e:
            raise NonFiniteLossError(f"{what}; nan_policy='rollback' found no checkpoint to restore ({e.message}); "
                                     "expected a committed checkpoint. Fix: save one before (checkpoint.every_n_steps)"
                                     ", or use nan_policy='skip'.", rank=self.err_rank, ranks=ranks) from e
        self.state_restored()
        log.warning("%s; nan_policy='rollback': restored checkpoint step %d (rollback %d of at most %d for step %d)",
                    what, resumed, count, self.max_rollbacks, step)
        return StepDecision(step, "rollback", ranks, resume_step=resumed, reason=what)

    def _restore(self) -> int:
        if self._restore_fn is not None:
            return int(self._restore_fn())
        state = {k: v for k, v in (("model", self.model), ("optimizer", self.optimizer)) if v is not None}
        return self.checkpointer.load(state=state).step

    def _check_divergence(self, step: int) -> StepDecision | None:
        interval = self.divergence_interval
        if not self.distributed or not interval or step <= 0 or step % interval or self.model is None:
            return None
        try:
            check_consistency(self.model, group=self.group, buffers=False)
        except RankDivergenceError as e:
            what = f"step {step}: parameters differ across ranks ({e.message.splitlines()[0]})"
            if self.nan_policy == "rollback":
                return self._rollback(step, e.ranks or (), what)
            if self.nan_policy == "warn":
                log.warning("%s; nan_policy='warn': continuing", what)
                return None
            raise RankDivergenceError(f"step {step}: {e.message}", rank=self.err_rank, ranks=e.ranks) from e
        return None


def _all_data_parallel(model: Any, ddp_type: type) -> bool:
    """Every parameter of ``model`` is all-reduced by one DDP: ``model`` is one, or wraps exactly one that holds all
    its parameters (a framework's wrapper, such as Lightning Fabric's around its DDP). Then every rank sees the same
    gradients, and a local check of them agrees without a collective."""
    if isinstance(model, ddp_type):
        return True
    if model is None:
        return False
    inner = [m for m in model.modules() if isinstance(m, ddp_type)]
    return len(inner) == 1 and {id(p) for p in inner[0].parameters()} == {id(p) for p in model.parameters()}
