"""robustdist on Ray: GPU actors, the object-store memory plan, Ray Train V2, ``fit_async`` and the worker hook.

:mod:`.actor` (:class:`RobustGPUActor`), :mod:`.callbacks` (:func:`fail_fast`), :mod:`.memory` (:func:`ray_memory_plan`), :mod:`.fit`
(:func:`fit_async`), :mod:`.hook` (the ``worker_process_setup_hook``: ``"robustdist.ray.hook.worker_setup"``),
:mod:`.train` (the Ray Train V2 calls ``harden`` makes) and :mod:`.reporting` (the Ray side of
:class:`~robustdist.harden.Hardened`). Imports every part below the facade; nothing imports it but the facade.
Importing this package imports neither ray nor torch: the hook runs before a worker may import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robustdist.runtime.lazy import attach as _attach

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from robustdist.ray.actor import RobustGPUActor, gpu_actor_options
    from robustdist.ray.callbacks import fail_fast
    from robustdist.ray.fit import FitFuture, fit_async
    from robustdist.ray.hook import cancel_worker_setup, worker_setup
    from robustdist.ray.memory import MemoryPlan, estimate_offload_bytes, ray_default_object_store, ray_memory_plan

__getattr__, __dir__, __all__ = _attach(__name__, {
    **dict.fromkeys(["RobustGPUActor", "gpu_actor_options"], "robustdist.ray.actor"),
    "fail_fast": "robustdist.ray.callbacks",
    **dict.fromkeys(["FitFuture", "fit_async"], "robustdist.ray.fit"),
    **dict.fromkeys(["cancel_worker_setup", "worker_setup"], "robustdist.ray.hook"),
    **dict.fromkeys(["MemoryPlan", "estimate_offload_bytes", "ray_default_object_store", "ray_memory_plan"],
                    "robustdist.ray.memory"),
})
