"""The in-memory checkpoint tier (:class:`~robustdist.checkpoint.LocalTier`, exported by the checkpoint package).

Bottom up: :mod:`.memory`, :mod:`.layout`, :mod:`.lineage`, :mod:`.wire` (mechanisms), :mod:`.restore`
(recovery), :mod:`.tier` (its facade). It stands on the checkpoint package's own modules.
"""
