"""Inside a real Ray Train worker (a local cluster, 2 CPU workers), the topology says ray_train."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240, method="thread")]  # Ray Train's loop can swallow signals


def test_topology_inside_ray_train_workers(ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out_dir = str(tmp_path)

    def train_loop(config):
        import json as _json
        import os as _os

        import torch.distributed as dist

        from robustdist.topology import detect_topology

        topo = detect_topology()
        record = {
            "launcher": topo.launcher, "rank": topo.rank, "world_size": topo.world_size,
            "local_rank": topo.local_rank, "local_world_size": topo.local_world_size,
            "group_rank": dist.get_rank(), "device": str(topo.device),
        }
        with open(_os.path.join(config["out"], f"rank{topo.rank}.json"), "w") as fh:
            _json.dump(record, fh)

    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"out": out_dir},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="topology"),
    )
    result = trainer.fit()
    assert result.error is None
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        assert rec == {"launcher": "ray_train", "rank": r, "world_size": 2, "local_rank": r,
                       "local_world_size": 2, "group_rank": r, "device": "cpu"}
