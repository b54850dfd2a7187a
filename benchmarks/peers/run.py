"""`make bench-peers` (`make bench-peers PEERS="plain robustdist"` for a subset): the same small DDP job written
the idiomatic way in plain torch, Accelerate, Lightning Fabric, Ray Train and robustdist, and robustdist composed with
Accelerate and with Fabric (``v_rd_*.py``), measured side by side
(step and save time, exact resume, a kill during a save, a stuck rank, a NaN, CPU SyncBatchNorm).

Writes ``benchmarks/peers/results.json`` and the "Side by side with the peers" section of
``benchmarks/RESULTS.md``. The columns are in :mod:`_columns`, launching in :mod:`_launch`, the table in
:mod:`_table`, the run as a whole in :mod:`_suite`; the job and its flags in :mod:`_common` (the contract).
``--smoke`` runs one tiny round (the test suite's ``tests/test_bench_peers.py`` does, per variant).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _suite import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
