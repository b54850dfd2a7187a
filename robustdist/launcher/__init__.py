"""``robustdist run`` (experimental): torchrun whose agent starts a worker killed by a signal again alone, from a warm
spare, while the other workers recover in process.

What exists: :mod:`.launch` (the command: torchrun's parser and agent), :mod:`.agent` (the agent's hook: which
worker to replace, and how), :mod:`.attempt_store` (each attempt's store, served by node 0's agent),
:mod:`.warm_spare` (the agent's side of the spare: starting, watching and taking it), :mod:`.spare` (the spare
process), :mod:`.idle` (its warm-up at idle priority), :mod:`.forked` (the workers it forks, as the agent sees them)
and :mod:`.deaths` (the agent's wait for a worker's end). The replacement's own side, joining the survivors'
in-process recovery, is :mod:`robustdist.recovery.replacement` and :mod:`robustdist.recovery.joining`; what both
sides read from the environment and the agent's store is :mod:`robustdist.runtime.replacing`.
"""
