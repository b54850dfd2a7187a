"""A DataLoader that resumes mid-epoch and avoids the usual traps: :func:`safe_dataloader`.

:mod:`.dataloader` (the :class:`SafeDataLoader` and its factory), :mod:`.sampler` (the distributed sampler it
adds), :mod:`.state` (the loader position a checkpoint holds), :mod:`.epochs` (epoch boundaries and
reshuffling), :mod:`.checks` (the traps it refuses). Imports :mod:`robustdist.runtime` and
:mod:`robustdist.config` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.data.dataloader import SafeDataLoader, safe_dataloader

__getattr__, __dir__, __all__ = _attach(__name__, dict.fromkeys(["SafeDataLoader", "safe_dataloader"],
                                                               "robustdist.data.dataloader"))
