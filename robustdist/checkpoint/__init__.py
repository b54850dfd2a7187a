"""Crash-safe, verified, distributed checkpoints: :class:`AtomicCheckpointer`.

The commit protocol of ``save`` is in the docstring of :mod:`._protocol`, the load protocol in :mod:`._loading`.
Layers, bottom up (each module imports only modules named before it): ``_types``, ``_faults``,
``_pickle_scan``, ``_schema``, ``_live`` (types, limits and validators); ``_io``, ``_safeio``, ``_confined`` (the
write rule: every file robustdist writes or deletes in a directory it does not trust), ``_layout``,
``_payload``, ``_sharded``, ``_restore``, ``_cleanup``, ``_collective``, ``_shared``, ``_snapshot`` (mechanisms);
``_protocol`` (save) and ``_loading`` (load), ``_verify`` (load's verdict without the live objects: ``verify_all``);
``checkpointer`` (the facade). The in-memory tier, the package
:mod:`.local`, stands on them: ``local.memory``, ``local.layout``, ``local.lineage``, ``local.wire`` (mechanisms),
``local.restore`` (recovery), ``local.tier`` (its facade). :mod:`.train_state` (``TrainState``: what a run
checkpoints) stands on the checkpointer and on :mod:`robustdist.data`.
"""

from robustdist.checkpoint._verify import verify_all
from robustdist.checkpoint.checkpointer import AtomicCheckpointer, CheckpointInfo, LoadedCheckpoint
from robustdist.checkpoint.local.tier import LocalSaveInfo, LocalTier

__all__ = ["AtomicCheckpointer", "CheckpointInfo", "LoadedCheckpoint", "LocalSaveInfo", "LocalTier", "verify_all"]
