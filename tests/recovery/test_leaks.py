"""Repeated in-process recoveries in one process leave threads, file descriptors, sockets, store keys and memory
flat: 2 gloo ranks, a fault on alternating ranks in every generation, each one a step further (so
none repeats), with the DDP tutorial's shape (a two-layer model, MSE, SGD, a DataLoader).

An in-memory save that a recovery leaves behind (its background part stuck in a gloo collective that a socket
shutdown does not end) keeps its thread, and its old group's sockets, until that collective's timeout
(``distributed.timeout``, ``TIMEOUT`` here): during the run a few may be alive at once; after the run, once they
have timed out, everything is back where it was when the first generation started.

How the bounds catch a leak of one thread, fd, socket or store key per recovery in ``RECOVERIES`` (20) recoveries:

* what outlives the run: after it, with no leak, threads, fds and sockets are at or below their count at the start
  of generation 0 (which no recovery precedes, so no save left behind is counted in it): the run's own watchdog,
  store and group are closed by then, up to 4 threads and 10 fds or sockets below it. A leak of one per recovery
  puts them 20 above their no-leak count, 10 or more above generation 0's.
* threads that live until the run ends: at every generation start the threads other than the saves left behind
  stay at generation 0's count, give or take one ending (2 of slack); a leak of one per recovery is 20 above it
  by the last generation.
* store keys: a generation's store holds no more keys than a generation's usually does (the most common count)
  unless rank 0 keeps an older store for a save left behind; keys carried from generation to generation make
  every count a different one (the most common is then generation 0's), so the first generation not served by
  such an older store fails.
* memory: see ``RSS_PER_RECOVERY``.
"""

from __future__ import annotations

import gc
import os
import statistics
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

RECOVERIES = int(os.environ.get("ROBUSTDIST_LEAK_RECOVERIES", "20"))
# distributed.timeout: how long a collective left behind by a recovery lives. A healthy collective here waits only
# for its peer's step (the ranks rebuild each generation together, through the rendezvous' own bound), well under
# a second even on a loaded 2-core machine, so 10 s is a generous bound for it
TIMEOUT = 10
SETTLED = 5  # memory is compared from this generation's start on: the first generations grow it (imports, first use)
# A leak of this much memory per recovery or more fails: the bound on the growth from generation SETTLED's start to
# after the run is RSS_PER_RECOVERY times the recoveries in between (12 MiB for 15). Without a leak it grows by
# up to about 4 MiB there. (A whole generation kept alive costs less than this at this model's size: its fds,
# sockets and store keys are what catch it.)
RSS_PER_RECOVERY = 0.8 * 2**20
THREAD_SLACK = 2  # a thread of the previous generation still ending as a generation starts
pytestmark = [pytest.mark.processes, pytest.mark.timeout(180 + 6 * RECOVERIES)]


def _usage() -> dict[str, int]:
    fds = os.listdir("/proc/self/fd")
    sockets = len(open_sockets())
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    store = _dist.default_store()
    store = _torch_compat.innermost_store(store) if store is not None else None
    # in-memory saves still running when a generation starts: ones an earlier generation left behind
    saves = sum(t.name.startswith("robustdist-local-ckpt") for t in threading.enumerate())
    return {"t": time.monotonic(), "threads": threading.active_count(), "fds": len(fds), "sockets": sockets,
            "rss": rss, "keys": int(store.num_keys()) if store is not None else -1, "saves": saves}


def _job(rank: int, root: str, recoveries: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64, 10), torch.randn(64, 5)), batch_size=4, shuffle=True)
    cfg = {"checkpoint": {"dir": f"{root}/ckpt", "every_n_steps": 1000, "local_every_n_steps": 1,
                          "local_dir": f"{root}/shm"},
           "health": {"hang_timeout": 600},
           "recovery": {"in_process": True},
           "distributed": {"timeout": TIMEOUT, "init_timeout": 60, "barrier_timeout": 60}}
    usage: list[dict[str, int]] = []

    def train(h, step: int) -> int:
        usage.append(_usage() | {"loader": id(h.loader)})
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
    deadline = time.monotonic() + 2 * TIMEOUT + 10  # saves left behind end by their collectives' timeout
    while any(t.name.startswith("robustdist-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.5)
    gc.collect()
    return {"end": end, "usage": usage, "after": _usage()}


def test_repeated_recoveries_in_one_process_leave_resources_flat(tmp_path):
    out = run_ranks(_job, 2, args=(str(tmp_path), RECOVERIES), init=False, timeout=120 + 6 * RECOVERIES)
    for rank in range(2):
        usage = out[rank]["usage"]
        assert out[rank]["end"] == RECOVERIES + 1 and len(usage) == RECOVERIES + 1
        assert len({u["loader"] for u in usage}) == 1  # one SafeDataLoader, kept across every recovery
        start, after = usage[0], out[rank]["after"]
        for what in ("threads", "fds", "sockets"):  # back where they were, once the left-behind saves timed out
            assert after[what] <= start[what], (rank, what, after[what], [u[what] for u in usage])
        # meanwhile: each save left behind is one thread, and every other thread is one generation 0 has too
        assert all(u["threads"] - u["saves"] <= start["threads"] + THREAD_SLACK for u in usage), (
            rank, [(u["threads"], u["saves"]) for u in usage])
        # and the saves left behind are bounded: each lives about TIMEOUT s, and a recovery that leaves one behind
        # waits 2 s for it first (robustdist.checkpoint._background.ABANDON_S), so about TIMEOUT / 2 + 1 (6) are
        # alive at once at most; TIMEOUT leaves room for their ends' scheduling on a loaded machine
        assert max(u["saves"] for u in usage) <= TIMEOUT, [u["saves"] for u in usage]
        # a fresh store each generation, except while a save left behind on rank 0 (where the server lives) holds
        # the old one: the next generation is then served by it, until that save's collective times out
        # (generation by generation, on rank 0's clock: a save seen there in the last TIMEOUT + 5 s). Otherwise no
        # more keys than a generation's store holds (the most common count; one may hold fewer, a heartbeat not yet
        # written as it is counted): a key of an earlier generation written late (a closed watchdog's heartbeat
        # whose connect reached the next server on the same port) is one more
        zero, per_generation = out[0]["usage"], statistics.mode(u["keys"] for u in usage)
        for g, u in enumerate(usage):
            assert u["keys"] <= per_generation or any(
                zero[h]["saves"] and zero[g]["t"] - zero[h]["t"] <= TIMEOUT + 5 for h in range(g + 1)), (
                rank, g, u["keys"], per_generation,
                [(i, round(v["t"] - zero[0]["t"], 1), v["keys"], v["saves"])
                 for i, v in enumerate(zero) if v["keys"] != per_generation or v["saves"]])
        grown = after["rss"] - usage[SETTLED]["rss"]
        assert grown < RSS_PER_RECOVERY * (RECOVERIES - SETTLED), (
            rank, after["rss"] // 2**20, [u["rss"] // 2**20 for u in usage])
