"""Ray Train with robustdist: a TorchTrainer with 2 CPU workers and a hardened training loop.

Run: python examples/ray_train_example.py   (starts a local Ray cluster with 2 CPUs)

Inside each worker, ``harden()`` finds the process group Ray created and uses it as it is (it never
re-initialises it, and ``close()`` leaves it alone); ``detect_topology()`` reports launcher "ray_train";
the model is wrapped by ``wrap_ddp`` (SyncBatchNorm included), the loader by ``safe_dataloader``; the step
guard and the hang watchdog run; a checkpoint is committed every epoch and reported to Ray Train (every rank
its own files, with the metrics given to ``save``); ``h.resume()`` resumes from the newest of robustdist's and
Ray's checkpoints after a restart. Checkpoints go to ``<checkpoint_dir>/<RunConfig.name>``.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn
from torch.utils.data import TensorDataset


def train_loop_per_worker(config: dict) -> None:
    from robustdist import harden

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    loader = torch.utils.data.DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True,
                                         drop_last=True)
    cfg = {"data": {"seed": 3}, "checkpoint": {"dir": config["checkpoint_dir"], "keep_last": 2},
           "health": {"hang_timeout": 120}}
    with harden(model, loader, cfg) as h:
        opt = torch.optim.SGD(h.model.parameters(), lr=0.05)
        start = h.resume(optimizer=opt)
        step = 0
        for epoch in range(0 if start is None else start + 1, config["epochs"]):
            total = 0.0
            for xb, yb in h.loader:
                loss = nn.functional.mse_loss(h.model(xb), yb)
                loss.backward()
                if h.step_guard(loss, step):
                    opt.step()
                opt.zero_grad()
                step += 1
                total += loss.item()
            metrics = {"epoch": epoch, "loss": total, "launcher": h.topology.launcher,
                       "world_size": h.topology.world_size, "created_group": h.init_report.created,
                       "model": type(h.model).__name__, "agreement": h.guard.agreement}
            # Every rank: the save commits, then it is reported to Ray with these metrics (each rank its files).
            h.save(epoch, optimizer=opt, force=True, metrics=metrics)


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
             runtime_env={"worker_process_setup_hook": "robustdist.ray.hook.worker_setup"})
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
