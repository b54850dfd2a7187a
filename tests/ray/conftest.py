"""Ray Train V2's controller, in these tests, polls its workers every ``HEALTH_CHECK_INTERVAL_S`` instead of every
2 s (Ray's default, ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``).

A Train V2 run learns everything from those polls: that its workers started, each report (robustdist's
``h.save`` waits until the controller has registered its checkpoint), a worker's error or death, the end of the
run. At 2 s, a fit here waits about a second for each of them. Nothing else changes: a poll that a busy worker
does not answer in time is a missed health check, which Ray tolerates for ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``
(10 minutes), not a failure. The driver (this process) passes the variable on to each run's controller and
workers; Ray Tune's trial actors, started by Ray's own processes, keep the default.

``reference``: ``tests/clients/ray_train_v2.py``'s job run once without a fault, its final parameters: what
test_ray_train_v2.py's and test_ray_inprocess.py's faulted runs of the same job must equal bitwise.
"""

from __future__ import annotations

import json
import os

import pytest

HEALTH_CHECK_INTERVAL_S = "0.5"


@pytest.fixture(scope="module", autouse=True)
def _train_controller_polls_often():
    """Set for a module's whole life, its module-scoped fixtures' fits included; removed after it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", HEALTH_CHECK_INTERVAL_S)
        yield


REFERENCE = {"lr": 0.05, "total": 9, "every": 3}  # the job both files' faulted runs train (their _config)


@pytest.fixture(scope="session")
def reference(ray_cluster, tmp_path_factory):
    """One Ray Train V2 fit of ``train_fn`` (2 workers, Ray's own process group, no in-process recovery) without a
    fault: its final parameters. A faulted run with or without ``recovery.in_process`` trains the same model on
    the same data, so it must end bitwise equal to this. Inside a Ray Train worker the topology says ray_train,
    and harden used Ray's group as it is."""
    import torch
    from ray import cloudpickle

    from tests.clients import ray_train_v2 as client

    cloudpickle.register_pickle_by_value(client)  # workers import the client by value, not from tests/
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "run").mkdir()
    config = {"out": str(tmp / "run"), "ckpt": str(tmp / "ckpt"), **REFERENCE}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", HEALTH_CHECK_INTERVAL_S)
        result = client.trainer(config, storage=str(tmp / "ray"), name="reference").fit()
    assert result.error is None
    assert result.metrics["step"] == REFERENCE["total"] and result.checkpoint is not None  # every commit reported
    with open(os.path.join(config["out"], "resumes.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    assert sorted(r["topology"] for r in rows) == [["ray_train", r, 2, r, 2, "cpu", False] for r in range(2)]
    return torch.load(os.path.join(config["out"], "final.pt"), weights_only=True)
