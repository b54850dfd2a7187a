"""Wrapping a model for data parallelism: DDP, FSDP2, SyncBatchNorm, their state dicts, and consistency.

:mod:`.ddp` (:func:`wrap_ddp`), :mod:`.fsdp` with :mod:`.fsdp_wrap` (:func:`fsdp_calibrate`, :func:`wrap_fsdp`),
:mod:`.strategy` (the wrapper ``distributed.strategy`` names, as ``harden`` applies it),
:mod:`.syncbn`, :mod:`.state_dict` (one state dict whatever the wrapper) and :mod:`.consistency` (are the ranks'
parameters the same). Imports :mod:`robustdist.runtime` and :mod:`robustdist.config` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.parallel.consistency import ConsistencyReport, check_consistency
    from robustdist.parallel.ddp import DistributedDataParallel, wrap_ddp
    from robustdist.parallel.fsdp import Calibration, fsdp_calibrate, wrap_fsdp
    from robustdist.parallel.state_dict import LoadReport, load_model_state_dict, model_state_dict, unwrap_model
    from robustdist.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm

__getattr__, __dir__, __all__ = _attach(__name__, {
    **dict.fromkeys(["ConsistencyReport", "check_consistency"], "robustdist.parallel.consistency"),
    **dict.fromkeys(["DistributedDataParallel", "wrap_ddp"], "robustdist.parallel.ddp"),
    **dict.fromkeys(["Calibration", "fsdp_calibrate", "wrap_fsdp"], "robustdist.parallel.fsdp"),
    **dict.fromkeys(["LoadReport", "load_model_state_dict", "model_state_dict", "unwrap_model"],
                    "robustdist.parallel.state_dict"),
    **dict.fromkeys(["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"], "robustdist.parallel.syncbn"),
})
