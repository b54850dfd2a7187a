"""robustdist: drop-in wrappers that harden PyTorch distributed training and Ray.

Importing robustdist changes no global state and imports neither torch nor ray: the public names below are
loaded on first use. See docs/failure-modes.md for the failure modes each part handles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist._version import __version__
from robustdist.runtime.lazy import attach as _attach

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
    from robustdist.checkpoint.train_state import Stateful, TrainState
    from robustdist.config.schema import (
        CheckpointConfig,
        DataConfig,
        DistributedConfig,
        FsdpConfig,
        HardenConfig,
        HealthConfig,
        RecoveryConfig,
        resolve_config,
    )
    from robustdist.data.dataloader import SafeDataLoader, safe_dataloader
    from robustdist.harden import Hardened, harden
    from robustdist.health.step_guard import HANG_EXIT_CODE, HangReport, StepDecision, StepGuard, Watchdog
    from robustdist.init.process_group import (
        InitReport,
        adopt_group,
        destroy_process_group_if_owned,
        distributed,
        safe_init_process_group,
    )
    from robustdist.parallel.consistency import ConsistencyReport, check_consistency
    from robustdist.parallel.ddp import DistributedDataParallel, wrap_ddp
    from robustdist.parallel.fsdp import Calibration, fsdp_calibrate, wrap_fsdp
    from robustdist.parallel.state_dict import LoadReport, load_model_state_dict, model_state_dict, unwrap_model
    from robustdist.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
    from robustdist.ray.actor import RobustGPUActor, gpu_actor_options
    from robustdist.ray.fit import FitFuture, fit_async
    from robustdist.ray.memory import MemoryPlan, estimate_offload_bytes, ray_default_object_store, ray_memory_plan
    from robustdist.runtime.errors import (
        CheckpointBusyError,
        CheckpointCorruptError,
        CheckpointError,
        CheckpointVersionError,
        ConfigError,
        HangError,
        InitError,
        MissingDependencyError,
        NonFiniteLossError,
        RankDivergenceError,
        RanksFailed,
        RanksTimeout,
        RecoveryError,
        RestartLoopError,
        RobustDistDeprecationWarning,
        RobustDistError,
        RobustDistWarning,
        StateDictMismatchError,
        TopologyError,
        UnsupportedVersionError,
    )
    from robustdist.runtime.log import get_logger
    from robustdist.runtime.topology import Topology, detect_topology, local_device
    from robustdist.testing.ranks import run_ranks

_LAZY: dict[str, str] = {
    **dict.fromkeys(
        ["CheckpointConfig", "DataConfig", "DistributedConfig", "FsdpConfig", "HardenConfig", "HealthConfig",
         "RecoveryConfig", "resolve_config"],
        "robustdist.config.schema",
    ),
    **dict.fromkeys(
        ["CheckpointBusyError", "CheckpointCorruptError", "CheckpointError", "CheckpointVersionError", "ConfigError",
         "HangError", "InitError", "MissingDependencyError", "NonFiniteLossError", "RankDivergenceError", "RanksFailed",
         "RanksTimeout",
         "RecoveryError", "RestartLoopError", "RobustDistDeprecationWarning", "RobustDistError",
         "RobustDistWarning", "StateDictMismatchError", "TopologyError", "UnsupportedVersionError"],
        "robustdist.runtime.errors",
    ),
    "get_logger": "robustdist.runtime.log",
    **dict.fromkeys(["Calibration", "fsdp_calibrate", "wrap_fsdp"], "robustdist.parallel.fsdp"),
    **dict.fromkeys(["Hardened", "harden"], "robustdist.harden"),
    **dict.fromkeys(["HANG_EXIT_CODE", "HangReport", "StepDecision", "StepGuard", "Watchdog"],
                    "robustdist.health.step_guard"),
    **dict.fromkeys(
        ["InitReport", "adopt_group", "destroy_process_group_if_owned", "distributed", "safe_init_process_group"],
        "robustdist.init.process_group",
    ),
    "run_ranks": "robustdist.testing.ranks",
    **dict.fromkeys(["RobustGPUActor", "gpu_actor_options"], "robustdist.ray.actor"),
    **dict.fromkeys(["FitFuture", "fit_async"], "robustdist.ray.fit"),
    **dict.fromkeys(["MemoryPlan", "estimate_offload_bytes", "ray_default_object_store", "ray_memory_plan"],
                    "robustdist.ray.memory"),
    **dict.fromkeys(["ConsistencyReport", "check_consistency"], "robustdist.parallel.consistency"),
    **dict.fromkeys(["AtomicCheckpointer", "CheckpointInfo", "LoadedCheckpoint", "LocalSaveInfo", "LocalTier"],
                    "robustdist.checkpoint"),
    **dict.fromkeys(["bf16_pickle_patch", "install_ray_serializers", "patch_bf16_pickle", "to_numpy", "to_python",
                     "unpatch_bf16_pickle"], "robustdist.bf16"),
    **dict.fromkeys(["DistributedDataParallel", "wrap_ddp"], "robustdist.parallel.ddp"),
    **dict.fromkeys(["SafeDataLoader", "safe_dataloader"], "robustdist.data.dataloader"),
    **dict.fromkeys(["LoadReport", "load_model_state_dict", "model_state_dict", "unwrap_model"],
                    "robustdist.parallel.state_dict"),
    **dict.fromkeys(["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"], "robustdist.parallel.syncbn"),
    **dict.fromkeys(["Stateful", "TrainState"], "robustdist.checkpoint.train_state"),
    "Topology": "robustdist.runtime.topology",
    "detect_topology": "robustdist.runtime.topology",
    "local_device": "robustdist.runtime.topology",
}

__getattr__, __dir__, _exported = _attach(__name__, _LAZY)
__all__ = ["__version__", *_exported]
del _exported
