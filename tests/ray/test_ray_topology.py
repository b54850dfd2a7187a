"""Topology inside a real Ray Train V1 worker (``RAY_TRAIN_V2_ENABLED=0``): ``launcher="ray_train"`` with the
worker's ranks, and ``harden()`` uses Ray's process group as it is. V1's context outside a worker is a stub
(local world size 0) that robustdist must not take for a worker's (``tests/runtime/test_topology_ray.py``); this
checks the other side, that a real V1 worker is still recognised. Train V2 workers: ``test_ray_actor.py`` and
``test_ray_train_v2.py``.

The session cluster's driver runs Train V2, and the Train version is chosen where the trainer is built, so a
second driver process joins the session cluster with Train V1 and runs one ``TorchTrainer`` of 2 workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(360, method="thread")]

ROOT = Path(__file__).resolve().parents[2]

DRIVER = r"""
import json, sys
import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train(config):
    import torch
    import ray.train
    from robustdist import harden
    from robustdist.runtime.topology import detect_topology

    topo = detect_topology()
    h = harden(torch.nn.Linear(2, 2))
    with h:
        h.model(torch.ones(1, 2)).sum().backward()
        ray.train.report({"rank": topo.rank, "world": topo.world_size, "local_rank": topo.local_rank,
                          "local_world": topo.local_world_size, "launcher": topo.launcher,
                          "harden": h.topology.launcher, "created_group": h.init_report.created,
                          "model": type(h.model).__name__})


ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
try:
    trainer = TorchTrainer(train, scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                               trainer_resources={"CPU": 0}),
                           run_config=RunConfig(storage_path=sys.argv[2], name="v1-topology"))
    result = trainer.fit()
    print(json.dumps({"error": repr(result.error) if result.error else None, "metrics": result.metrics,
                      "v2": type(trainer).__module__.startswith("ray.train.v2")}))
finally:
    ray.shutdown()
"""


def test_a_train_v1_worker_is_ray_train(ray_cluster, tmp_path):
    ray = ray_cluster
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0.0) < 2.0:  # an earlier test's run may still be releasing
        assert time.monotonic() < deadline, f"the cluster's CPUs were busy: {ray.available_resources()}"
        time.sleep(0.5)
    env = {**os.environ, "RAY_TRAIN_V2_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", DRIVER, ray.get_runtime_context().gcs_address, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["v2"] is False, "RAY_TRAIN_V2_ENABLED=0 must give a Train V1 trainer"
    assert seen["error"] is None, seen
    metrics = seen["metrics"]  # rank 0's report
    assert (metrics["launcher"], metrics["harden"], metrics["rank"], metrics["world"], metrics["local_rank"],
            metrics["local_world"]) == ("ray_train", "ray_train", 0, 2, 0, 2), metrics
    assert metrics["created_group"] is False and metrics["model"] == "DistributedDataParallel", metrics
