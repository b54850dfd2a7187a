"""The checkpointer's collectives: :class:`robustdist.runtime.dist.Collectives` set up for ``save()``/``load()``.

``save()`` and ``load()`` (and so ``Hardened.save``/``resume``) are collective: every rank of the
checkpointer's group must call them, in the same order. A script that saves only on rank 0 (as the
pytorch/examples DDP tutorial does) would otherwise leave rank 0 waiting in a broadcast for the whole
collective timeout while the other ranks train on; the arrival check names the absent rank instead.
"""

from __future__ import annotations

from typing import Any

from robustdist.runtime.dist import Collectives
from robustdist.runtime.errors import CheckpointError

OPS = ("save", "load")


def checkpoint_collectives(group: Any, rank: int, world_size: int, *, timeout: float,
                           arrival_timeout: float) -> Collectives:
    """Collectives raising :class:`CheckpointError`, with the checkpoint's store scope and messages."""
    return Collectives(group, rank, world_size, timeout=timeout, arrival_timeout=arrival_timeout,
                       error=CheckpointError, scope="ckpt", noun="checkpoint", owner="checkpointer", ops=OPS,
                       knob="checkpoint.arrival_timeout")
