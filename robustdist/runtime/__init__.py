"""The ground floor every other part stands on: nothing here imports from another robustdist package.

* :mod:`.errors`: the exception and warning tree (floor 0: imports nothing from robustdist);
* :mod:`.dist`: is a group up, rank and world size, the default store, bounded collectives that name absent
  ranks (:class:`~robustdist.runtime.dist.Collectives`);
* :mod:`.log`: rank-aware logging and warnings;
* :mod:`.agreement`: what every rank must agree on before a group is trusted;
* :mod:`.topology`: ranks, nodes and devices, from torchrun, Ray Train, SLURM or a single process;
* :mod:`.launcher_env`, :mod:`.netenv`, :mod:`.node`: the launcher's and the network's environment, and which
  node this is;
* :mod:`.lazy`: the lazy exports every package ``__init__`` uses.

Public names are exported from ``robustdist`` itself (``robustdist.HangError``, ``robustdist.Topology``, ...).
"""
