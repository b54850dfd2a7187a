"""robustdist: drop-in wrappers that harden PyTorch distributed training and Ray.

Importing robustdist changes no global state and imports neither torch nor ray: the public names below are
loaded on first use. See docs/failure-modes.md for the failure modes each part handles.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from robustdist._version import __version__

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.bf16 import (
        bf16_pickle_patch,
        install_ray_serializers,
        patch_bf16_pickle,
        to_numpy,
        to_python,
        unpatch_bf16_pickle,
    )
    from robustdist.checkpoint import AtomicCheckpointer, CheckpointInfo, LoadedCheckpoint, LocalSaveInfo, LocalTier
    from robustdist.consistency import ConsistencyReport, check_consistency
    from robustdist.dataloader import SafeDataLoader, safe_dataloader
    from robustdist.ddp import DistributedDataParallel, wrap_ddp
    from robustdist.config import (
        CheckpointConfig,
        DataConfig,
        DistributedConfig,
        FsdpConfig,
        HardenConfig,
        HealthConfig,
        resolve_config,
    )
    from robustdist.errors import (
        CheckpointBusyError,
        CheckpointCorruptError,
        CheckpointError,
        ConfigError,
        HangError,
        InitError,
        MissingDependencyError,
        NonFiniteLossError,
        RankDivergenceError,
        RanksFailed,
        RanksTimeout,
        RestartLoopError,
        RobustDistError,
        RobustDistWarning,
        StateDictMismatchError,
        TopologyError,
    )
    from robustdist.fsdp import Calibration, fsdp_calibrate, wrap_fsdp
    from robustdist.harden import Hardened, harden
    from robustdist.health import HANG_EXIT_CODE, HangReport, StepDecision, StepGuard, Watchdog
    from robustdist.log import get_logger
    from robustdist.process_group import (
        InitReport,
        adopt_group,
        destroy_process_group_if_owned,
        distributed,
        safe_init_process_group,
    )
    from robustdist.ray_actor import RobustGPUActor, gpu_actor_options
    from robustdist.ray_fit import FitFuture, fit_async
    from robustdist.ray_memory import MemoryPlan, estimate_offload_bytes, ray_default_object_store, ray_memory_plan
    from robustdist.state_dict import LoadReport, load_model_state_dict, model_state_dict, unwrap_model
    from robustdist.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
    from robustdist.testing import run_ranks
    from robustdist.topology import Topology, detect_topology
    from robustdist.train_state import Stateful, TrainState

_LAZY: dict[str, str] = {
    **dict.fromkeys(
        ["CheckpointConfig", "DataConfig", "DistributedConfig", "FsdpConfig", "HardenConfig", "HealthConfig",
         "resolve_config"],
        "robustdist.config",
    ),
    **dict.fromkeys(
        ["CheckpointBusyError", "CheckpointCorruptError", "CheckpointError", "ConfigError", "HangError", "InitError",
         "MissingDependencyError", "NonFiniteLossError", "RankDivergenceError", "RanksFailed", "RanksTimeout",
         "RestartLoopError", "RobustDistError",
         "RobustDistWarning", "StateDictMismatchError", "TopologyError"],
        "robustdist.errors",
    ),
    "get_logger": "robustdist.log",
    **dict.fromkeys(["Calibration", "fsdp_calibrate", "wrap_fsdp"], "robustdist.fsdp"),
    **dict.fromkeys(["Hardened", "harden"], "robustdist.harden"),
    **dict.fromkeys(["HANG_EXIT_CODE", "HangReport", "StepDecision", "StepGuard", "Watchdog"], "robustdist.health"),
    **dict.fromkeys(
        ["InitReport", "adopt_group", "destroy_process_group_if_owned", "distributed", "safe_init_process_group"],
        "robustdist.process_group",
    ),
    "run_ranks": "robustdist.testing",
    **dict.fromkeys(["RobustGPUActor", "gpu_actor_options"], "robustdist.ray_actor"),
    **dict.fromkeys(["FitFuture", "fit_async"], "robustdist.ray_fit"),
    **dict.fromkeys(["MemoryPlan", "estimate_offload_bytes", "ray_default_object_store", "ray_memory_plan"],
                    "robustdist.ray_memory"),
    **dict.fromkeys(["ConsistencyReport", "check_consistency"], "robustdist.consistency"),
    **dict.fromkeys(["AtomicCheckpointer", "CheckpointInfo", "LoadedCheckpoint", "LocalSaveInfo", "LocalTier"],
                    "robustdist.checkpoint"),
    **dict.fromkeys(["bf16_pickle_patch", "install_ray_serializers", "patch_bf16_pickle", "to_numpy", "to_python",
                     "unpatch_bf16_pickle"], "robustdist.bf16"),
    **dict.fromkeys(["DistributedDataParallel", "wrap_ddp"], "robustdist.ddp"),
    **dict.fromkeys(["SafeDataLoader", "safe_dataloader"], "robustdist.dataloader"),
    **dict.fromkeys(["LoadReport", "load_model_state_dict", "model_state_dict", "unwrap_model"],
                    "robustdist.state_dict"),
    **dict.fromkeys(["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"], "robustdist.syncbn"),
    **dict.fromkeys(["Stateful", "TrainState"], "robustdist.train_state"),
    "Topology": "robustdist.topology",
    "detect_topology": "robustdist.topology",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'robustdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
