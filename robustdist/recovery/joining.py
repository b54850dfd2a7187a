"""``harden``'s side of a replacement (``robustdist run``): a worker started in place of a dead one joins
the others' in-process recovery (:func:`robustdist.recovery.replacement.join`) before it makes its group, then
builds as their next generation, so a failure of its build is told to them as theirs is
(:mod:`robustdist.recovery.generations`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from robustdist.recovery import generations, loop, replacement

__all__ = ["joining"]


@contextlib.contextmanager
def joining(config: Any, topo: Any, first: bool) -> Iterator[None]:
    """Around harden's build: in a replacement's first build (``first``: not a recovery's rebuild), join first and
    build inside the joined generation; elsewhere, nothing."""
    joined = replacement.join(in_process=config.recovery.in_process, rank=topo.rank, world=topo.world_size,
                              init_timeout=config.distributed.init_timeout,
                              fingerprint=config.fingerprint()) if first and topo.is_distributed else None
    if joined is None:
        yield
        return
    loop.continue_as(*joined)
    generation = generations.Generation(loop.scope_of(joined[0]), joined[1])
    try:
        with generations.building(generation):
            yield
    finally:
        generation.close()  # its watch: the recovery loop watches the generation from here on
