"""In-process recovery with DataLoader worker processes (``num_workers=2``, with and without
``persistent_workers``), on real gloo ranks, in a DDP-tutorial-shaped loop under ``h.run``: a fault mid-epoch
(while the workers have batches prefetched) recovers bitwise, every step trains on the batch an uninterrupted run
trains on (no sample lost or repeated), and the workers of the torn-down generation are gone (no process left
behind; persistent workers are kept, never doubled)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from robustdist import harden
from robustdist.recovery import generation
from robustdist.testing.ranks import run_ranks
from tests._torchrun import once_per_session

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
TOTAL, FAULT_AT = 14, 9  # 64 samples, 2 ranks, batch 4: 8 steps an epoch; the fault is in the second epoch


class Indexed(Dataset):
    """Sample i: features (i, sin i, ...) and a target; the first feature says which sample a batch holds."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        x = torch.sin(torch.arange(10, dtype=torch.float32) + i)
        x[0] = float(i)
        return x, torch.cos(torch.arange(5, dtype=torch.float32) * i)


def _children() -> list[str]:
    """This process's child processes but multiprocessing's forkserver and resource tracker: ``pid state name
    command`` each (a zombie counts: it is not reaped yet)."""
    me, out = os.getpid(), []
    for task in Path(f"/proc/{me}/task").iterdir():
        try:
            pids = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                              if ":\t" in line)
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if "multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd:
                    continue  # multiprocessing's own helpers: one per process, started at the first use, kept
                out.append(f"{pid} {status.get('State', '?')} {status.get('Name', '?')} {cmd[:200]}")
            except OSError:
                out.append(f"{pid} gone")
    return sorted(out)


def _job(rank: int, root: str, fault: bool, persistent: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": 100, "local_every_n_steps": 3,
                          "local_dir": f"{root}/shm"},
           "health": {"hang_timeout": None},
           "distributed": {"timeout": 60, "init_timeout": 60, "barrier_timeout": 60},
           "recovery": {"in_process": True}}
    trained: dict[int, list[int]] = {}  # step -> the sample indices it trained on (the last time it ran)
    children_at_start: list[list[str]] = []

    def train(h, step: int) -> int:
        children_at_start.append(_children())
        while step < TOTAL:
            for x, y in h.loader:
                loss = nn.functional.mse_loss(h.model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                trained[step] = [int(i) for i in x[:, 0].tolist()]
                if fault and rank == 1 and step == FAULT_AT and generation() == 0:
                    raise ValueError(f"boom at step {step}")
                h.save(step, optimizer=optimizer)
                if step == TOTAL:
                    break
        return step

    h = harden(model, loader, cfg, optimizer=optimizer)
    end = h.run(train, optimizer=optimizer)
    return {"end": end, "trained": trained, "children_at_start": children_at_start,
            "children_after": _children(), "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_a_fault_with_loader_workers_recovers_bitwise_without_a_lost_or_repeated_sample(tmp_path, tmp_path_factory,
                                                                                        persistent):
    """The reference is one uninterrupted run (workers not persistent), made once per session: which batch each step
    trains on is the sampler's, in the rank's own process, whatever the workers' lifetime."""
    faulted = run_ranks(_job, 2, args=(str(tmp_path / "f"), True, persistent), init=False, timeout=240)

    def make(root):
        torch.save(run_ranks(_job, 2, args=(str(root), False, False), init=False, timeout=240), root / "out.pt")

    straight = torch.load(once_per_session(tmp_path_factory, f"{__name__} straight", make) / "out.pt",
                          weights_only=False)
    for rank in range(2):
        got, ref = faulted[rank], straight[rank]
        assert got["end"] == ref["end"] == TOTAL
        assert got["trained"] == ref["trained"]  # every step's batch, the last time it ran: the same samples
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
        # generation 1 started with no worker of generation 0 left (non-persistent: the old iterator's workers
        # shut down; persistent: at most the loader's own two, kept), and nothing is left at the end
        assert len(got["children_at_start"]) == 2, got["children_at_start"]
        assert len(got["children_at_start"][1]) <= (2 if persistent else 0), got["children_at_start"]
        assert len(got["children_after"]) <= (2 if persistent else 0), got["children_after"]
