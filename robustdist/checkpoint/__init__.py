"""Crash-safe, verified, distributed checkpoints: :class:`AtomicCheckpointer` (protocol in ``checkpointer``)."""

from robustdist.checkpoint._layout import verify_all
from robustdist.checkpoint.checkpointer import AtomicCheckpointer, CheckpointInfo, LoadedCheckpoint

__all__ = ["AtomicCheckpointer", "CheckpointInfo", "LoadedCheckpoint", "verify_all"]
