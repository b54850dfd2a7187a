"""A checkpoint written under one torch and resumed under another (a base image upgraded between a save and a
resume): ``write DIR`` trains a few steps and saves model, optimizer, scheduler, GradScaler, a mid-epoch
safe_dataloader position and the RNG; ``read DIR`` resumes it into fresh objects. Both print one JSON line:
the torch version and a digest of every restored value (bitwise: tensors by their bytes), so the two sides
compare exactly. Run by ``tests/checkpoint/test_checkpoint_across_versions.py`` with another lane's Python."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from robustdist import safe_dataloader
from robustdist.checkpoint import AtomicCheckpointer


def _objects(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    loader = safe_dataloader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    return model, opt, sched, scaler, loader


def _digest(model, opt, sched, scaler, loader, batch) -> str:
    h = hashlib.sha256()
    tensors = list(model.state_dict().values()) + [batch[0], batch[1]]
    tensors += [t for state in opt.state_dict()["state"].values() for t in state.values()]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().numpy().tobytes())
    h.update(json.dumps([sched.state_dict()["last_epoch"], scaler.get_scale(), torch.rand(2).tolist()]).encode())
    return h.hexdigest()


def write(path: str) -> dict:
    model, opt, sched, scaler, loader = _objects(0)
    it = iter(loader)
    for _ in range(3):
        x, y = next(it)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    with AtomicCheckpointer(path) as ckpt:
        ckpt.save(3, {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "loader": loader})
    return {"torch": torch.__version__, "digest": _digest(model, opt, sched, scaler, loader, next(it))}


def read(path: str) -> dict:
    model, opt, sched, scaler, loader = _objects(1)
    with AtomicCheckpointer(path) as ckpt:
        loaded = ckpt.load(state={"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
                                  "loader": loader})
    assert loaded.step == 3, loaded.step
    return {"torch": torch.__version__, "digest": _digest(model, opt, sched, scaler, loader, next(iter(loader)))}


if __name__ == "__main__":
    command, directory = sys.argv[1], sys.argv[2]
    print(json.dumps(write(directory) if command == "write" else read(directory)))
