"""Starting a process group that cannot hang silently: :func:`safe_init_process_group`.

:mod:`.process_group` is the init sequence (its docstring has the protocol); :mod:`.rendezvous` checks the
launcher's rendezvous before any collective; :mod:`.reach` and :mod:`.reach_verdict` probe whether ranks can
reach each other and say which link is missing; :mod:`.store` and :mod:`.elastic_store` give each restart
attempt a fresh store. Imports :mod:`robustdist.runtime` and :mod:`robustdist.config` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.init.process_group import (
        InitReport,
        adopt_group,
        destroy_process_group_if_owned,
        distributed,
        safe_init_process_group,
    )

__getattr__, __dir__, __all__ = _attach(__name__, dict.fromkeys(
    ["InitReport", "adopt_group", "destroy_process_group_if_owned", "distributed", "safe_init_process_group"],
    "robustdist.init.process_group"))
