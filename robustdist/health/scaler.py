"""The step guard beside an fp16 ``GradScaler``: an overflow is the scaler's business, not a bad step.

Pass the scaler (``StepGuard(scaler=...)``, ``guard(loss, step, scaler=...)``, or ``harden(..., scaler=...)``).
Non-finite gradients while every rank's loss is finite then return a true decision with ``action="overflow"``, so
the loop calls ``scaler.step(optimizer)`` (which skips the update) and ``scaler.update()`` (which lowers the
scale) as it always did. Each overflow is logged at INFO and counted (``StepGuard.overflows``);
``overflow_warn_after`` of them in a row log a WARNING (then every that many more). Once the scale is below
:data:`MIN_SCALE` (1), non-finite gradients are no overflow the scaler can fix (a NaN in an earlier micro-step,
one that backward made) and follow the policy. A non-finite *loss* on any rank always follows the policy.

Every rank decides alike: the guard's first call gathers once whether each rank has an enabled scaler (a
mismatch is a ``ConfigError`` everywhere); under ``"gradients"`` agreement every rank sees the same non-finite
gradients, and only then do the ranks gather their losses (and whether their scale is below the floor); under
``"allreduce"`` the one all-reduce carries each rank's loss flag and the flag of its gradient shard (a DTensor's
local part: no collective to read it), and only an agreed overflow adds a second one for the floor (not with
``check_gradients=False``: the losses alone decide, and the scaler skips its overflows uncounted).

Under ``skip`` and ``rollback`` the guard records the bad step with the scaler (``scaler.unscale_(optimizer)``,
unless the loop already called it) before zeroing the gradients, so the loop's ``scaler.update()`` still works
and backs the scale off, as it would for an overflow. A disabled scaler (``GradScaler(enabled=False)``, e.g.
nanoGPT under bf16) counts as none.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist

from robustdist.config.validate import show
from robustdist.health.grad_check import check, finite_loss, finite_number, local_part, loss_value, tensors_finite
from robustdist.runtime import _amp_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import ConfigError
from robustdist.runtime.log import get_logger

log = get_logger(__name__)

MIN_SCALE = 1.0
"""Below this GradScaler scale, non-finite gradients with finite losses are no longer treated as an overflow."""

Verdict = tuple[bool, bool, "tuple[int, ...] | None", "bool | str", "list[Any] | None"]


class Guard(Protocol):
    """What :func:`agree_scaled` reads of a :class:`~robustdist.health.step_guard.StepGuard`."""

    agreement: str
    params: list[torch.Tensor]
    group: Any
    rank: int
    world_size: int
    distributed: bool
    check_gradients: bool

    def device(self) -> torch.device: ...


def check_scaler(scaler: Any) -> Any:
    """``scaler`` itself when it has a GradScaler's API (or is None); else a ``ConfigError``."""
    if scaler is None:
        return None
    missing = [m for m in ("is_enabled", "unscale_", "get_scale", "step", "update")
               if not callable(getattr(scaler, m, None))]
    if missing:
        raise ConfigError(f"scaler= is {show(scaler)}, which has no {', '.join(missing)}; expected a "
                          "torch.amp.GradScaler (or one with its API, such as FSDP's ShardedGradScaler). Fix: pass "
                          "the GradScaler your loop calls scaler.step() on, or none.", rank=_dist.error_rank())
    return scaler


def active(scaler: Any) -> Any:
    """The scaler, or None when there is none or it is disabled (``GradScaler(enabled=False)``)."""
    return scaler if scaler is not None and scaler.is_enabled() else None


def scale_value(scaler: Any) -> float:
    try:
        return float(scaler.get_scale())
    except Exception:  # a scaler with another API: never below the floor by this reading
        return math.inf


def scale_text(scaler: Any) -> str:
    value = scale_value(scaler)
    return f"{value:g}" if math.isfinite(value) else "unknown"


def agree_scaled(guard: Guard, loss: Any, scaler: Any) -> Verdict:
    """With a GradScaler: (this rank's loss is non-finite, the ranks agree the step is bad, the ranks named
    when known, the overflow verdict, every rank's loss value when gathered). The overflow verdict is False,
    True (non-finite gradients while every loss was finite), or ``"exhausted"`` (so, with some rank's scale
    already below :data:`MIN_SCALE`). The same answers on every rank; see the module docstring."""
    if guard.agreement == "gradients":
        loss_finite, grads_ok = check(loss, guard.params)
        if grads_ok:  # no rank's loss was non-finite: it would have reached every gradient
            return not loss_finite, False, None, False, None
        # every rank sees the same non-finite gradients (DDP averaged them): all look at the losses together
        rows = _dist.gather_objects((loss_value(loss), scale_value(scaler) < MIN_SCALE), guard.group)
        values = [row[0] for row in rows]
        named = tuple(r for r, v in enumerate(values) if not finite_number(v))
        verdict: bool | str = False if named else ("exhausted" if any(row[1] for row in rows) else True)
        return not loss_finite, bool(named), named, verdict, values
    local_bad = not finite_loss(loss)
    grads = [local_part(p.grad) for p in guard.params if p.grad is not None]
    grads_bad = guard.check_gradients and not tensors_finite(grads)
    if not guard.distributed:
        overflow = grads_bad and not local_bad
        verdict = ("exhausted" if scale_value(scaler) < MIN_SCALE else True) if overflow else False
        return local_bad, local_bad, ((0,) if local_bad else ()), verdict, None
    device = guard.device()
    flags = torch.zeros(2 * guard.world_size, dtype=torch.float32, device=device)
    flags[guard.rank], flags[guard.world_size + guard.rank] = float(local_bad), float(grads_bad)
    dist.all_reduce(flags, group=guard.group)  # one all-reduce, as without a scaler: losses and shards agreed
    read = flags.tolist()
    named = tuple(r for r in range(guard.world_size) if read[r])
    verdict = not named and any(read[guard.world_size:])
    if verdict:  # a rare step, the same on every rank: one more all-reduce agrees on the scale's floor
        low = torch.tensor([float(scale_value(scaler) < MIN_SCALE)], device=device)
        dist.all_reduce(low, group=guard.group)
        verdict = "exhausted" if low.item() else True
    return local_bad, bool(named), named, verdict, None


def log_overflow(step: int, scaler: Any, streak: int, total: int, every: int) -> None:
    """Log one overflow the scaler handles: INFO, or a WARNING at ``every`` in a row (then every that many)."""
    scale = scale_text(scaler)
    if streak >= every and (streak - every) % every == 0:
        log.warning("step %d: %d optimizer steps in a row skipped by the GradScaler for overflowing gradients "
                    "(scale %s before this step's update; %d overflows in all); expected an occasional one. Fix: "
                    "look for exploding activations or gradients (a lower learning rate, gradient clipping after "
                    "scaler.unscale_), or train in bf16, which needs no scaler. Below scale %g the step guard "
                    "treats them as bad steps (health.nan_policy)", step, streak, scale, total, MIN_SCALE)
    else:
        log.info("step %d: gradients overflowed at GradScaler scale %s while every loss was finite: the scaler "
                 "skips this optimizer step and lowers the scale (%d in a row)", step, scale, streak)


def record_with(scaler: Any, optimizer: torch.optim.Optimizer | None, nan_policy: str, rank: int | None) -> None:
    """Let the GradScaler see this step's gradients before they are zeroed (``unscale_`` records its
    non-finite check), so that the loop's ``scaler.update()``, called without ``scaler.step()``, finds a
    check and backs the scale off instead of failing with "No inf checks were recorded"."""
    if optimizer is None:
        raise ConfigError(f"nan_policy={nan_policy!r} with a GradScaler needs the optimizer, to record the "
                          "skipped step with the scaler (scaler.unscale_(optimizer)) before the gradients are "
                          "zeroed; expected optimizer= (or harden(..., optimizer=...), or h.optimizer = ...). "
                          "Fix: pass it.", rank=rank)
    unscaled = _amp_compat.scaler_unscaled(scaler, optimizer)
    if unscaled:
        return  # the loop called unscale_ this step (to clip): the check is recorded
    try:
        scaler.unscale_(optimizer)
    except RuntimeError:
        if unscaled is None:  # this torch hides the stage: unscale_'s refusal to run twice is the answer
            return
        raise
    except AssertionError as e:  # torch's own check: no scale() call yet
        raise ConfigError(f"the GradScaler given to the step guard has not scaled a loss ({e}); expected "
                          "scaler.scale(loss).backward() before step_guard. Fix: scale the loss with the scaler "
                          "you pass, or pass none.", rank=rank) from e
