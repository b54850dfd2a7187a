"""A client in the shape of Lightning's Fabric image-classifier example (``examples/fabric/image_classifier``),
ported to robustdist. Our own code: a small CNN on synthetic 12x12 "digits" stands in for MNIST.

The upstream shape, kept: ``Fabric(accelerator=..., devices=..., strategy=...)``, ``fabric.launch()``,
``fabric.seed_everything``, a CNN with dropout, ``Adadelta`` with a per-epoch ``StepLR``, ``fabric.setup(model,
optimizer)``, ``fabric.backward(loss)``, the test loader through ``fabric.setup_dataloaders`` and the test loss
summed with ``fabric.all_gather`` after each epoch.

What the port changes (docs/porting.md, "Fabric"):

* ``robustdist.safe_init_process_group()`` before ``Fabric(...).launch()``, which uses that group: its own
  ``init_process_group`` cannot rendezvous again after torchrun restarts the job;
* after ``fabric.setup``: ``h = robustdist.harden(model, train_loader, cfg, optimizer=optimizer)`` with the plain
  train loader (not ``setup_dataloaders``): harden keeps Fabric's DDP, shards the loader itself and checkpoints
  its position, so the resumed run continues mid-epoch; ``optimizer.step()`` runs ``if h.step_guard(loss, step)``;
* ``h.resume(scheduler=scheduler)`` at start, ``h.save(step, scheduler=scheduler)`` inside the epoch and once more
  after the epoch's ``scheduler.step()`` (so a checkpoint at an epoch's end holds the stepped schedule);
* the test loader gets its own ``generator=``: an unseeded DataLoader draws from the global RNG at each epoch.

Run under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo). ``--kill-at k``: on the first attempt, rank 1
SIGKILLs itself at step k. Every rank writes ``final-<tag>-rank<r>.pt`` and ``result-<tag>-rank<r>.json`` to
``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import robustdist


def digits(n: int, seed: int) -> TensorDataset:
    """Synthetic 1x12x12 images whose class (of 4) sets which quadrant is bright, plus noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    images = torch.randn(n, 1, 12, 12, generator=g) * 0.5
    for i, c in enumerate(labels.tolist()):
        r, k = divmod(c, 2)
        images[i, 0, r * 6:(r + 1) * 6, k * 6:(k + 1) * 6] += 1.0
    return TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.dropout2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu(self.conv1(x))
        x = nn.functional.max_pool2d(nn.functional.relu(self.conv2(x)), 2)
        x = self.dropout1(x).flatten(1)
        x = self.dropout2(nn.functional.relu(self.fc1(x)))
        return nn.functional.log_softmax(self.fc2(x), dim=1)


def run(hparams: argparse.Namespace) -> None:
    robustdist.safe_init_process_group()  # before Fabric, which uses it: a restarted attempt can rendezvous
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(hparams.seed)
    train_loader = DataLoader(digits(96, 1), batch_size=hparams.batch_size, shuffle=True)
    test_loader = DataLoader(digits(32, 2), batch_size=hparams.batch_size,
                             generator=torch.Generator().manual_seed(hparams.seed))
    test_loader = fabric.setup_dataloaders(test_loader)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=hparams.lr)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=hparams.gamma)
    h = robustdist.harden(model, train_loader, {
        "health": {"hang_timeout": 120.0, "nan_policy": "skip"},
        "checkpoint": {"dir": str(Path(hparams.workdir) / "ckpt"), "every_n_steps": hparams.checkpoint_every}},
        optimizer=optimizer)
    assert h.model is model, "harden re-wrapped what Fabric set up"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    step = h.resume(scheduler=scheduler) or 0
    resumed_from = step or None
    per_epoch = len(h.loader)
    losses: list[float] = []
    decisions: list[str] = []
    test_losses: list[float] = []
    for _epoch in range(step // per_epoch, hparams.epochs):
        model.train()
        for data, target in h.loader:
            if hparams.kill_at is not None and attempt == 0 and fabric.global_rank == 1 and step == hparams.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            output = model(data)
            loss = nn.functional.nll_loss(output, target)
            fabric.backward(loss)
            decision = h.step_guard(loss, step)
            decisions.append(str(decision.action))
            if decision:
                optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if step % per_epoch:  # the epoch's last checkpoint comes after its scheduler step, below
                h.save(step, scheduler=scheduler)
        scheduler.step()
        h.save(step, scheduler=scheduler)
        model.eval()
        test_loss = torch.zeros(())
        with torch.no_grad():
            for data, target in test_loader:
                test_loss += nn.functional.nll_loss(model(data), target, reduction="sum")
        test_losses.append(float(fabric.all_gather(test_loss).sum() / len(test_loader.dataset)))
    rank = fabric.global_rank
    workdir = Path(hparams.workdir)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, workdir / f"final-{hparams.tag}-rank{rank}.pt")
    (workdir / f"result-{hparams.tag}-rank{rank}.json").write_text(json.dumps({
        "world": fabric.world_size, "attempt": attempt, "resumed_from": resumed_from, "losses": losses,
        "decisions": decisions, "test_losses": test_losses, "steps": step, "per_epoch": per_epoch,
        "inner": type(model._forward_module).__name__, "lr": scheduler.get_last_lr()}))
    h.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Fabric image-classifier-shaped client, hardened.")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--kill-at", type=int, default=None)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
