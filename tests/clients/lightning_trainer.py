"""A client in the shape of a Lightning ``Trainer`` + ``LightningModule`` script, with robustdist's plugin and
callback. Our own code: a small MLP regressor on synthetic data.

The usual shape, kept: a ``LightningModule`` with ``training_step`` and ``configure_optimizers``, a
``ModelCheckpoint`` (``save_last=True``), ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` and
``trainer.fit(model, loader, ckpt_path="last" if it exists)``. What the port adds (docs/porting.md, "(e)"):

* ``plugins=[robustdist.frameworks.lightning.checkpoint_io()]`` and ``callbacks=[..., callback(...)]``, nothing
  else: under torchrun the plugin makes the process group (a fresh store per attempt) before the ``Trainer`` is
  built, and Lightning uses it (its own ``init_process_group`` may not rendezvous again after torchrun restarts
  the job). ``group_before_trainer`` in the result says the group was there before the ``Trainer``.

Lightning restarts an epoch's data from its start when it resumes mid-epoch, so the checkpoint is taken at epoch
ends (``every_n_epochs=1``): the resumed run is then bitwise the straight one. Run under ``torchrun
--standalone --nproc_per_node=2``. ``--kill-at k``: on the first attempt, rank 1 SIGKILLs itself at global step k.
Every rank writes ``final-<tag>-rank<r>.pt`` and ``result-<tag>-rank<r>.json`` to ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist.frameworks import lightning as rdl


class Regressor(L.LightningModule):
    def __init__(self, kill_at: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.kill_at = kill_at
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.kill_at is not None and attempt == 0 and self.global_rank == 1 and self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description="Lightning Trainer client with robustdist's plugin and callback.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    ckpt_dir = workdir / "ckpt"
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_last=True)
    io = rdl.checkpoint_io()
    group_before_trainer = torch.distributed.is_initialized()
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                        plugins=[io],
                        callbacks=[saver, rdl.callback(hang_timeout=120.0, nan_policy="raise")])
    model = Regressor(args.kill_at)
    last = ckpt_dir / "last.ckpt"
    resumed = last.exists()
    trainer.fit(model, loader, ckpt_path=str(last) if resumed else None)
    rank = trainer.global_rank
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, workdir / f"final-{args.tag}-rank{rank}.pt")
    (workdir / f"result-{args.tag}-rank{rank}.json").write_text(json.dumps({
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "world": trainer.world_size,
        "steps": trainer.global_step, "losses": model.losses, "resumed": resumed, "group_before_trainer": group_before_trainer,
        "records": sorted(p.name for p in ckpt_dir.iterdir() if p.name.endswith(rdl.RECORD_SUFFIX))}))


if __name__ == "__main__":
    main()
