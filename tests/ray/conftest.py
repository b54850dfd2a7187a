"""Ray Train V2's controller, in these tests, polls its workers every ``HEALTH_CHECK_INTERVAL_S`` instead of every
2 s (Ray's default, ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``).

A Train V2 run learns everything from those polls: that its workers started, each report (robustdist's
``h.save`` waits until the controller has registered its checkpoint), a worker's error or death, the end of the
run. At 2 s, a fit here waits about a second for each of them. Nothing else changes: a poll that a busy worker
does not answer in time is a missed health check, which Ray tolerates for ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``
(10 minutes), not a failure. The driver (this process) passes the variable on to each run's controller and
workers; Ray Tune's trial actors, started by Ray's own processes, keep the default.
"""

from __future__ import annotations

import pytest

HEALTH_CHECK_INTERVAL_S = "0.5"


@pytest.fixture(scope="module", autouse=True)
def _train_controller_polls_often():
    """Set for a module's whole life, its module-scoped fixtures' fits included; removed after it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", HEALTH_CHECK_INTERVAL_S)
        yield
