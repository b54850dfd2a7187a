"""Step 3 of the load protocol (:mod:`._loading`): restore a checked candidate into the live objects, and put
them back as they were when the restore fails on any rank.

Every restore is one of two kinds:

* *checked*: torch modules, optimizers, LR schedulers and grad scalers, whose saved state step 2 already
  checked against the live object (:mod:`._live`), so restoring them cannot fail. They are restored last and
  never copied.
* *unchecked*: any other stateful object (``state`` or ``per_rank``: a data loader, a user's class), a module
  with ``_extra_state`` (its ``set_extra_state`` is user code) and sharded entries (DCP). Only when some rank
  has one (step 2's all_gather says so) does every rank copy the state of every live object it is about to
  restore in that stage (modules and optimizers to CPU, sharded tensors where they are), restore them, and
  agree on the outcome (one more all_gather); on a problem anywhere, each rank loads its copies back. So the
  common load (a model, its optimizer and scheduler) copies nothing.

RNG states are restored only once every rank succeeded (:mod:`._loading`), so they never need putting back.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from robustdist.checkpoint import _payload
from robustdist.checkpoint._live import validated
from robustdist.checkpoint._sharded import load_sharded
from robustdist.runtime import _torch_compat
from robustdist.runtime.errors import CheckpointError

__all__ = ["Plan", "plan", "put_back", "restore_checked", "restore_unchecked"]

Item = tuple[str, Any, Callable[[], None]]
"""``(label, live object, restore)``: ``restore()`` loads the checked saved state into the live object."""


@dataclass
class Plan:
    """What one rank restores for one candidate, in the order it does it."""

    unchecked: list[Item] = field(default_factory=list)
    checked: list[Item] = field(default_factory=list)
    sharded: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_copies(self) -> bool:
        return bool(self.unchecked or self.sharded)


@dataclass(frozen=True)
class IfSaved:
    """A live object to restore only when the checkpoint holds its entry: ``state={"grad_scaler":
    IfSaved(scaler)}`` loads a checkpoint written before the entry existed, leaving the object as it is."""

    obj: Any


def present(state: dict[str, Any], kinds: dict[str, str], where: str) -> dict[str, Any]:
    """``state`` with :class:`IfSaved` entries unwrapped, or dropped when ``where`` lacks them; any other entry
    the checkpoint lacks is a :class:`CheckpointError`."""
    out = {}
    for name, live in state.items():
        if name in kinds:
            out[name] = live.obj if isinstance(live, IfSaved) else live
        elif not isinstance(live, IfSaved):
            raise CheckpointError(f"state[{name!r}] is not in {where} (it holds {sorted(kinds)}); expected the same "
                                  "entries as when saving. Fix: drop it or load a checkpoint that has it.")
    return out


def plan(kinds: dict[str, str], saved: dict[str, Any], state: dict[str, Any], saved_per_rank: dict[str, Any],
         per_rank: dict[str, Any]) -> Plan:
    """Sort the restores of one checked candidate (kinds and live types were checked in step 2)."""
    out = Plan()

    def add(label: str, live: Any, value: Any, kind: str, name: str) -> None:
        item = (label, live, lambda: _payload.restore_entry(name, live, value, kind))
        extra = kind == "module" and any(str(k).endswith("_extra_state") for k in value)  # user code runs
        (out.checked if validated(live) and not extra else out.unchecked).append(item)

    for name, live in state.items():
        if kinds[name] == "sharded":
            out.sharded[name] = live
        elif kinds[name] in ("module", "stateful"):
            add(f"state[{name!r}]", live, saved[name], kinds[name], name)
    for name, live in per_rank.items():
        if name in saved_per_rank:
            kind = "module" if isinstance(live, nn.Module) else "stateful"
            add(f"per_rank[{name!r}]", live, saved_per_rank[name], kind, name)
    return out


def _clone(value: Any, cpu: bool) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return t.to("cpu") if cpu and t.device.type != "cpu" and type(t).__name__ != "DTensor" else t.clone()
    if isinstance(value, OrderedDict):
        out = type(value)((k, _clone(v, cpu)) for k, v in value.items())
        meta = _torch_compat.STATE_DICT_METADATA  # a module's state dict carries its version numbers here
        if hasattr(value, meta):
            setattr(out, meta, getattr(value, meta))
        return out
    if isinstance(value, dict):
        return {k: _clone(v, cpu) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_clone(v, cpu) for v in value)
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be copied: keep it (it is put back as it is)
        return value


def _capture(live: Any) -> Any:
    """A copy of ``live``'s state: on CPU for modules and optimizers (their ``load_state_dict`` copies each
    tensor back to its device), on the tensors' own devices for anything else (which may keep what it is given)."""
    if isinstance(live, dict):
        return {k: _clone(v, False) for k, v in live.items()}
    return _clone(live.state_dict(), isinstance(live, (nn.Module, torch.optim.Optimizer)))


def _load_back(live: Any, copied: Any) -> None:
    if isinstance(live, dict):  # a plain mapping of sharded tensors, loaded in place by DCP
        for key, value in copied.items():
            if isinstance(live.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                live[key].copy_(value)
            else:
                live[key] = value
    else:
        live.load_state_dict(copied)


def put_back(copies: list[tuple[str, Any, Any]]) -> list[str]:
    """Load each copy back into its live object; the labels of those that could not be (with the reason)."""
    failed = []
    for label, live, copied in reversed(copies):
        try:
            _load_back(live, copied)
        except Exception as e:  # reported with the load's error; the other copies still go back
            failed.append(f"{label} ({type(e).__name__}: {str(e)[:200]})")
    return failed


def _apply(items: list[Item]) -> tuple[int, str | None]:
    """Restore ``items`` in order until one fails: ``(how many were restored, the problem or None)``."""
    for i, (label, _, restore) in enumerate(items):
        try:
            restore()
        except Exception as e:
            text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            return i, f"{label}: {text}"[:2000]
    return len(items), None


def restore_unchecked(p: Plan, step_dir: str, dcp_metadata: Any, group: Any) -> tuple[list[Any], str | None]:
    """Copy, then restore, the unchecked entries and the sharded ones (DCP: every rank calls it, whatever
    failed before). Returns the copies (for :func:`put_back`) and the problem, or None."""
    copies, problem = [], None
    targets = [(label, live) for label, live, _ in p.unchecked] + [(f"state[{n!r}]", v) for n, v in p.sharded.items()]
    for label, live in targets:
        try:
            copies.append((label, live, _capture(live)))
        except Exception as e:  # this candidate is refused; the other copies are still taken (DCP runs anyway)
            problem = problem or f"{label}: could not copy its live state before restoring ({type(e).__name__}: {e})"
    if problem is None:
        problem = _apply(p.unchecked)[1]
    if p.sharded:
        try:
            load_sharded(p.sharded, step_dir, dcp_metadata, group)
        except Exception as e:
            text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            problem = problem or text
    return copies, None if problem is None else problem[:2000]


def restore_checked(p: Plan) -> str | None:
    """Restore the entries step 2 checked against their live objects (this cannot fail short of a bug or
    running out of memory; if it does, the ones already restored are named: they are not copied first)."""
    done, problem = _apply(p.checked)
    if problem and done:
        before = ", ".join(label for label, _, _ in p.checked[:done])
        problem += f" (restored from this candidate before it, not put back: {before})"
    return problem
