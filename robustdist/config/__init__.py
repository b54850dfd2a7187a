"""``HardenConfig`` and its sections: one keyword-only, frozen, validated configuration for every part.

:mod:`.schema` holds the dataclasses and :func:`resolve_config`; :mod:`.validate` the field validators that
other parts reuse; :mod:`.io` reading YAML, dicts and ``ROBUSTDIST_*`` environment variables. Imports only
:mod:`robustdist.runtime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.config.schema import (
        CheckpointConfig,
        DataConfig,
        DistributedConfig,
        FsdpConfig,
        HardenConfig,
        HealthConfig,
        RecoveryConfig,
        config_reference,
        resolve_config,
        section_of,
    )

__getattr__, __dir__, __all__ = _attach(__name__, dict.fromkeys(
    ["CheckpointConfig", "DataConfig", "DistributedConfig", "FsdpConfig", "HardenConfig", "HealthConfig",
     "RecoveryConfig", "config_reference", "resolve_config", "section_of"], "robustdist.config.schema"))
