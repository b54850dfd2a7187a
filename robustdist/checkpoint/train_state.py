"""``TrainState``: what a training run checkpoints and restores, in one object.

The model, the optimizer, the LR scheduler, any other stateful objects (``extras``: a GradScaler, an EMA,
anything with ``state_dict``/``load_state_dict``) and the loader's position. ``harden`` keeps one
(``Hardened.state``); the checkpointer saves it, and ``resume`` and the step guard's rollback restore it.
Usable alone with an :class:`~robustdist.checkpoint.AtomicCheckpointer`::

    state = TrainState(model, optimizer=opt, loader=safe_loader)
    state.save(ckpt, step)                # collective: every rank calls it
    loaded = state.load(ckpt, missing_ok=True)

Every rank saves and loads its own loader position and RNG state (``per_rank``); the rest is saved once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer

from robustdist.checkpoint import AtomicCheckpointer, CheckpointInfo, LoadedCheckpoint, LocalSaveInfo, LocalTier
from robustdist.data.dataloader import SafeDataLoader

__all__ = ["Stateful", "TrainState"]


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


@dataclass
class TrainState:
    """The run's restorable state (see the module docstring). ``loader`` is checkpointed only when it is a
    :class:`~robustdist.data.dataloader.SafeDataLoader` (whose position can be saved)."""

    model: nn.Module
    optimizer: Optimizer | None = None
    scheduler: Stateful | None = None
    extras: dict[str, Stateful] = field(default_factory=dict)
    loader: Any = None

    def remember(self, *, optimizer: Optimizer | None = None, scheduler: Stateful | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        """Adopt a newly given optimizer/scheduler, and the stateful objects among ``extra`` (plain data given to
        ``save`` is saved but has nothing to be restored into)."""
        if optimizer is not None:
            self.optimizer = optimizer
        if scheduler is not None:
            self.scheduler = scheduler
        self.extras.update({k: v for k, v in (extra or {}).items() if hasattr(v, "load_state_dict")})

    def entries(self) -> dict[str, Any]:
        """The replicated/sharded entries, by name: ``model``, ``optimizer``, ``scheduler`` (when set), extras."""
        live = {k: v for k, v in (("optimizer", self.optimizer), ("scheduler", self.scheduler)) if v is not None}
        return {"model": self.model, **live, **self.extras}

    def save(self, checkpointer: AtomicCheckpointer, step: int, extra: Mapping[str, Any] | None = None,
             **kwargs: Any) -> CheckpointInfo:
        """Save every entry, plus ``extra`` (stateful objects or plain data), and this rank's loader position."""
        per_rank = {"loader": self.loader.state_dict()} if isinstance(self.loader, SafeDataLoader) else None
        return checkpointer.save(step, {**self.entries(), **(extra or {})}, per_rank=per_rank, **kwargs)

    def save_local(self, tier: LocalTier, step: int, extra: Mapping[str, Any] | None = None) -> LocalSaveInfo:
        """Take an in-memory checkpoint of every entry, ``extra`` and this rank's loader position
        (``LocalTier.save``): the same content as :meth:`save`."""
        per_rank = {"loader": self.loader.state_dict()} if isinstance(self.loader, SafeDataLoader) else None
        return tier.save(step, {**self.entries(), **(extra or {})}, per_rank=per_rank)

    def load(self, checkpointer: AtomicCheckpointer, *, missing_ok: bool = False, local: LocalTier | None = None,
             checkpoint: Any = None, at_least: int | None = None) -> LoadedCheckpoint | None:
        """Restore the newest valid checkpoint into every entry and the loader (see ``AtomicCheckpointer.load``);
        None when there is none and ``missing_ok``. With ``local``, the in-memory tier is tried first: its
        newest step complete across the job, if not older than the durable tier's newest and ``at_least``
        (``LocalTier.load``); the durable tier otherwise. ``checkpoint``: load that one (a committed step, or a
        ``ray.train.Checkpoint``) instead of the durable tier's newest."""
        per_rank = {"loader": self.loader} if isinstance(self.loader, SafeDataLoader) else None
        if local is not None:
            steps = checkpointer.steps() if checkpointer.rank == 0 else []
            floor = max((s for s in (steps[-1] if steps else None, at_least) if s is not None), default=None)
            loaded = local.load(state=self.entries(), per_rank=per_rank, at_least=floor)
            if loaded is not None:
                return loaded
        return checkpointer.load(checkpoint, state=self.entries(), per_rank=per_rank, missing_ok=missing_ok)
