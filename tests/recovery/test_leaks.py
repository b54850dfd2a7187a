"""Many in-process recoveries in one process leave threads, file descriptors, sockets, store keys and memory
flat (issue #34): 2 gloo ranks, a fault on alternating ranks in every generation, each one a step further (so
none repeats), with the DDP tutorial's shape (a two-layer model, MSE, SGD, a DataLoader)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist import harden
from robustdist.recovery import generation
from robustdist.runtime import dist as _dist
from robustdist.runtime import _torch_compat
from robustdist.runtime.group_sockets import open_sockets
from robustdist.testing.ranks import run_ranks

RECOVERIES = int(os.environ.get("ROBUSTDIST_LEAK_RECOVERIES", "100"))
pytestmark = pytest.mark.timeout(120 + 6 * RECOVERIES)


def _usage() -> dict[str, int]:
    fds = os.listdir("/proc/self/fd")
    sockets = len(open_sockets())
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    store = _torch_compat.innermost_store(_dist.default_store())
    return {"t": time.monotonic(), "threads": threading.active_count(), "fds": len(fds), "sockets": sockets, "rss": rss,
            "keys": int(store.num_keys()) if store is not None else -1}


def _job(rank: int, root: str, recoveries: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64, 10), torch.randn(64, 5)), batch_size=4, shuffle=True)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": 1000, "local_every_n_steps": 1,
                          "local_dir": f"{root}/shm"},
           "health": {"hang_timeout": 600},
           "recovery": {"in_process": True},
           "distributed": {"timeout": 60, "init_timeout": 60, "barrier_timeout": 60}}
    usage: list[dict[str, int]] = []

    def train(h, step: int) -> int:
        usage.append(_usage())
        while True:
            for x, y in h.loader:
                nn.functional.mse_loss(h.model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                h.save(step, optimizer=optimizer)
                if step > recoveries:
                    return step
                if generation() % 2 == rank:  # one step further each generation, on alternating ranks
                    raise ValueError(f"fault in generation {generation()}")

    h = harden(model, loader, cfg, optimizer=optimizer)
    end = h.run(train, optimizer=optimizer)
    return {"end": end, "usage": usage}


def test_a_hundred_recoveries_in_one_process_leave_resources_flat(tmp_path):
    out = run_ranks(_job, 2, args=(str(tmp_path), RECOVERIES), init=False, timeout=60 + 6 * RECOVERIES)
    for rank in range(2):
        usage = out[rank]["usage"]
        assert out[rank]["end"] == RECOVERIES + 1 and len(usage) == RECOVERIES + 1
        settled, last = usage[5], usage[-1]  # after the first generations (imports, first-use allocations)
        for what in ("threads", "fds", "sockets", "keys"):
            assert last[what] <= settled[what], (rank, what, [u[what] for u in usage])
        grown = last["rss"] - settled["rss"]
        assert grown < 64 * 2**20, (rank, [u["rss"] // 2**20 for u in usage])
