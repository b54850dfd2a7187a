"""Testing distributed code for real on CPU; never imported by the product itself.

:mod:`.ranks`: :func:`run_ranks` (real processes, one per rank, every failure reported, never waited out) and
:func:`use_forkserver`. :mod:`.nodelab`: several simulated nodes on one machine (network namespaces joined by
veth pairs, one torchrun agent each), with real partitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.testing.ranks import free_port, run_ranks, use_forkserver

__getattr__, __dir__, __all__ = _attach(__name__, dict.fromkeys(["free_port", "run_ranks", "use_forkserver"],
                                                               "robustdist.testing.ranks"))
