"""``TrainState``: what a training run checkpoints and restores, in one object.

The model, the optimizer, the LR scheduler, any other stateful objects (``extras``: a GradScaler, an EMA,
anything with ``state_dict``/``load_state_dict``) and the loader's position. ``harden`` keeps one
(``Hardened.state``); the checkpointer saves it, and ``resume`` and the step guard's rollback restore it.
Usable alone with an :class:`~robustdist.checkpoint.AtomicCheckpointer`::

    state = TrainState(model, optimizer=opt, loader=safe_loader)
    state.save(ckpt, step)                # collective: every rank calls it
    loaded = state.load(ckpt, missing_ok=True)

Every rank saves and loads its own loader position and RNG state (``per_rank``); the model, optimizer, scheduler
and stateful extras are saved once (rank 0's; DDP keeps them identical, FSDP's sharded state is saved by every
rank through DCP). **Plain extras** (data with no ``load_state_dict``: numbers, lists, dicts, tensors) are saved
by every rank for itself as well, and ``load`` gives each rank its own value back in ``loaded.state[name]``: a
per-rank counter or a per-rank buffer resumes as that rank left it. A rank that saved nothing (the job resumed
with more ranks than it saved with) gets rank 0's value, with a warning naming the entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer

from robustdist.checkpoint import AtomicCheckpointer, CheckpointInfo, LoadedCheckpoint, LocalSaveInfo, LocalTier
from robustdist.checkpoint._payload import is_sharded
from robustdist.checkpoint._restore import IfSaved
from robustdist.data.dataloader import SafeDataLoader
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.log import get_logger

log = get_logger(__name__)

EXTRAS = "extras"
"""The per-rank entry that holds this rank's own plain extras."""
SCALER = "grad_scaler"
"""The entry of :attr:`TrainState.scaler`."""

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
    scaler: Any = None
    """An fp16 loop's ``torch.amp.GradScaler``: saved as ``grad_scaler``; restored when the checkpoint holds it
    (one written before the scaler was given loads too, the scaler keeping its state), and not from a scaler
    saved disabled, nor into a disabled one."""

    def remember(self, *, optimizer: Optimizer | None = None, scheduler: Stateful | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        """Adopt a newly given optimizer/scheduler, and the stateful objects among ``extra`` (plain data given to
        ``save`` is saved but has nothing to be restored into)."""
        if optimizer is not None:
            self.optimizer = optimizer
        if scheduler is not None:
            self.scheduler = scheduler
        self.extras.update({k: v for k, v in (extra or {}).items() if hasattr(v, "load_state_dict")})

    def entries(self, *, loading: bool = False) -> dict[str, Any]:
        """The replicated/sharded entries, by name: ``model``, ``optimizer``, ``scheduler``, ``grad_scaler`` (when
        set), extras. ``loading``: the scaler as an entry restored only if the checkpoint holds it."""
        live = {k: v for k, v in (("optimizer", self.optimizer), ("scheduler", self.scheduler)) if v is not None}
        if self.scaler is not None:
            live[SCALER] = IfSaved(self.scaler) if loading else self.scaler
        return {"model": self.model, **live, **self.extras}

    def save(self, checkpointer: AtomicCheckpointer, step: int, extra: Mapping[str, Any] | None = None,
             **kwargs: Any) -> CheckpointInfo:
        """Save every entry, plus ``extra`` (stateful objects or plain data), this rank's loader position and
        this rank's own plain extras."""
        return checkpointer.save(step, {**self.entries(), **(extra or {})}, per_rank=self._per_rank(extra), **kwargs)

    def save_local(self, tier: LocalTier, step: int, extra: Mapping[str, Any] | None = None) -> LocalSaveInfo:
        """Take an in-memory checkpoint of every entry, ``extra``, this rank's loader position and plain extras
        (``LocalTier.save``): the same content as :meth:`save`."""
        return tier.save(step, {**self.entries(), **(extra or {})}, per_rank=self._per_rank(extra))

    def _per_rank(self, extra: Mapping[str, Any] | None) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        if isinstance(self.loader, SafeDataLoader):
            out["loader"] = self.loader.state_dict()
        own = {k: v for k, v in (extra or {}).items() if _plain(v)}
        if own:
            out[EXTRAS] = own
        return out or None

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
            loaded = local.load(state=self.entries(loading=True), per_rank=per_rank, at_least=floor)
            if loaded is not None:
                return _own_extras(loaded, checkpointer.rank, checkpointer.world_size, set(self.entries()))
        loaded = checkpointer.load(checkpoint, state=self.entries(loading=True), per_rank=per_rank,
                                   missing_ok=missing_ok)
        if loaded is None:
            if local is not None and local.overwritten:
                raise CheckpointError(
                    "an in-memory checkpoint restore wrote into the live objects and then failed "
                    f"({local.overwritten[:500]}); no other copy restored them and the durable tier holds no "
                    "checkpoint, so the live objects hold part of a checkpoint and training cannot start from scratch "
                    "with them. Expected a complete restore or untouched objects. Fix: restart the job (a copy whose "
                    f"checksum failed was removed); if this repeats, remove {local.directory} to start from step 0.",
                    rank=checkpointer.rank)
            return None
        return _own_extras(loaded, checkpointer.rank, checkpointer.world_size, set(self.entries()))


def _plain(value: Any) -> bool:
    """A plain extra: saved per rank too (not a module, not stateful, not sharded)."""
    return not (isinstance(value, nn.Module) or hasattr(value, "load_state_dict") or is_sharded(value))


def _own_extras(loaded: LoadedCheckpoint, rank: int, world_size: int, live: set[str]) -> LoadedCheckpoint:
    """Put this rank's own plain extras into ``loaded.state`` (in place of rank 0's). Only names the checkpoint
    holds as plain data (not a live entry: ``live``) are taken: a rank file is input and may be forged."""
    kinds = loaded.manifest.get("entries", {}) if isinstance(loaded.manifest, dict) else {}
    plain = {k for k in loaded.state if k not in live and kinds.get(k, "data") == "data"}
    own = loaded.per_rank.get(EXTRAS)
    if isinstance(own, dict):
        loaded.state.update({k: v for k, v in own.items() if k in plain})
    elif plain and rank != 0 and kinds:
        log.warning("checkpoint step %d holds no values of this rank's own for the plain extras %s (saved by %s "
                    "rank(s); %s): this rank gets rank 0's", loaded.step, ", ".join(sorted(plain)),
                    loaded.manifest.get("world_size", "?"), _why_missing(loaded, rank), all_ranks=True)
    saved = loaded.manifest.get("world_size") if isinstance(loaded.manifest, dict) else None
    if plain and rank == 0 and isinstance(saved, int) and saved > world_size:
        log.warning("checkpoint step %d was saved by %d ranks and is loaded by %d: the plain extras %s of ranks "
                    "%d to %d are not restored (no rank here has their number)", loaded.step, saved, world_size,
                    ", ".join(sorted(plain)), world_size, saved - 1)
    return loaded


def _why_missing(loaded: LoadedCheckpoint, rank: int) -> str:
    saved = loaded.manifest.get("world_size")
    if isinstance(saved, int) and rank >= saved:
        return "the job now has more ranks"
    return "written by a robustdist that saved plain extras once"
