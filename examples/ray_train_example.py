"""Ray Train with robustdist: a TorchTrainer with 2 CPU workers and a hardened training loop.

Run: python examples/ray_train_example.py   (starts a local Ray cluster with 2 CPUs)

Inside each worker: detect_topology() reports launcher "ray_train"; safe_init_process_group() validates the
group Ray created (barrier, smoke test, agreement) without re-initialising it; wrap_ddp() and
safe_dataloader() do their usual work; an AtomicCheckpointer commits a checkpoint every epoch, and rank 0
reports it to Ray Train as a ray.train.Checkpoint.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn
from torch.utils.data import TensorDataset


def train_loop_per_worker(config: dict) -> None:
    import ray.train

    from robustdist import AtomicCheckpointer, detect_topology, safe_dataloader, safe_init_process_group, wrap_ddp

    topo = detect_topology()
    init = safe_init_process_group({"distributed": {"timeout": 120, "barrier_timeout": 60}})
    torch.manual_seed(0)
    model = wrap_ddp(nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = safe_dataloader(data, {"data": {"seed": 3}}, batch_size=8, shuffle=True, drop_last=True)
    ckpt = AtomicCheckpointer(config["checkpoint_dir"], keep_last=2, timeout=120)
    for epoch in range(config["epochs"]):
        total = 0.0
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        ckpt.save(epoch, {"model": model, "optimizer": opt})
        metrics = {"epoch": epoch, "loss": total, "launcher": topo.launcher, "world_size": topo.world_size,
                   "created_group": init.created}
        report_ckpt = ckpt.ray_checkpoint(epoch) if topo.rank == 0 else None
        ray.train.report(metrics, checkpoint=report_ckpt)
    ckpt.close()


def build_trainer(storage_path: str, checkpoint_dir: str, epochs: int = 2):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"checkpoint_dir": checkpoint_dir, "epochs": epochs},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=storage_path, name="robustdist-example"),
    )


def main() -> None:
    import ray

    from robustdist import AtomicCheckpointer

    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"worker_process_setup_hook": "robustdist.bf16.ray_worker_setup"})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = build_trainer(os.path.join(tmp, "ray"), os.path.join(tmp, "ckpt")).fit()
            print("metrics:", result.metrics)
            loaded = AtomicCheckpointer(os.path.join(tmp, "restore")).load(result.checkpoint)
            print("reported checkpoint: step", loaded.step, "entries", sorted(loaded.state))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
