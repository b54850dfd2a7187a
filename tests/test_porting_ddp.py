"""Porting a DDP tutorial-shaped script to ``harden``: no traps.

The client below has the shape of the multi-GPU torchrun tutorial: the loader is built with
``shuffle=False, sampler=DistributedSampler(dataset, num_replicas=..., rank=...)`` *before* any process group
exists, each epoch peeks at the batch size with ``next(iter(loader))`` and then calls
``loader.sampler.set_epoch(epoch)``, and rank 0 alone writes a snapshot. Every rank must read its own disjoint
shard in exactly the order plain torch gives, the peek must change nothing, and a resume must continue where
the checkpoint left the loader.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from robustdist import harden
from robustdist.config.schema import CheckpointConfig, HardenConfig, HealthConfig
from robustdist.testing.ranks import run_ranks

pytestmark = pytest.mark.processes

N, BATCH, EPOCHS = 24, 4, 2


class Points(Dataset):
    """Sample i is (features [i, 1], target 2i + 1): the first feature tells which sample a batch holds."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([float(i), 1.0]), torch.tensor([2.0 * i + 1.0])


class Trainer:
    """The tutorial's trainer, written for this test: peek, set_epoch, loop; rank 0 alone writes a snapshot."""

    def __init__(self, model, train_data, optimizer, snapshot_path, *, set_epoch=True):
        self.rank = int(os.environ["RANK"])
        self.model, self.train_data, self.optimizer = model, train_data, optimizer
        self.snapshot_path, self.set_epoch = snapshot_path, set_epoch
        self.seen: list[list[int]] = []
        self.peeks: list[int] = []

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = nn.functional.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch, *, stop_after=None, on_stop=None):
        b_sz = len(next(iter(self.train_data))[0])  # the tutorial's batch-size peek
        self.peeks.append(b_sz)
        if self.set_epoch:
            self.train_data.sampler.set_epoch(epoch)
        order = []
        for source, targets in self.train_data:
            order.extend(int(i) for i in source[:, 0].tolist())
            self._run_batch(source, targets)
            if stop_after is not None and len(order) == stop_after * BATCH:
                on_stop()
                break
        self.seen.append(order)

    def _save_snapshot(self, epoch):
        torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}, self.snapshot_path)

    def train(self, epochs):
        for epoch in epochs:
            self._run_epoch(epoch)
            if self.rank == 0:
                self._save_snapshot(epoch)


def _plain_order(rank, epoch, **sampler_kw):
    """What plain torch gives this rank in ``epoch``: a DistributedSampler with set_epoch, in batches."""
    sampler = DistributedSampler(Points(), num_replicas=2, rank=rank, **sampler_kw)
    sampler.set_epoch(epoch)
    return [int(b[0][k, 0]) for b in DataLoader(Points(), batch_size=BATCH, sampler=sampler) for k in range(len(b[0]))]


def _config(directory=None):
    return HardenConfig(health=HealthConfig(hang_timeout=None), checkpoint=CheckpointConfig(dir=directory))


def _fit(model_seed, loader, cfg, snapshot, epochs=range(EPOCHS), *, set_epoch=True):
    torch.manual_seed(model_seed)
    h = harden(nn.Linear(2, 1), loader, cfg)
    trainer = Trainer(h.model, h.loader, torch.optim.SGD(h.model.parameters(), lr=1e-4), snapshot,
                      set_epoch=set_epoch)
    trainer.train(epochs)
    return h, trainer


def _tutorial(rank, directory):
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("robustdist.data.sampler").addHandler(handler)
    logging.getLogger("robustdist.data.sampler").setLevel(logging.DEBUG)
    snapshot = os.path.join(directory, f"snapshot{rank}.pt")
    # the tutorial's loader, built before any process group exists (explicit num_replicas/rank)
    group_before = dist.is_initialized()
    sampler = DistributedSampler(Points(), num_replicas=int(os.environ["WORLD_SIZE"]), rank=rank)
    loader = DataLoader(Points(), batch_size=BATCH, pin_memory=True, shuffle=False, sampler=sampler)
    h, tutorial = _fit(0, loader, _config(), snapshot)
    out = {"group_before": group_before, "kept": h.loader.sampler is sampler, "tutorial": tutorial.seen,
           "peeks": tutorial.peeks, "snapshot": os.path.exists(snapshot)}
    # no sampler of its own: the loader's shuffle intent decides (the group exists now and is reused)
    shuffled = _fit(1, DataLoader(Points(), batch_size=BATCH, shuffle=True), _config(), snapshot)
    ordered = _fit(2, DataLoader(Points(), batch_size=BATCH, shuffle=False), _config(), snapshot, set_epoch=False)
    out.update(shuffled=shuffled[1].seen, ordered=ordered[1].seen)
    for other, _ in (shuffled, ordered):
        other.close()
    out["resume"] = _resume(rank, directory, snapshot)
    out["logs"] = records
    h.close()
    return out


def _resume(rank, directory, snapshot):
    """Stop mid-epoch 1 with a checkpoint, then resume in a new harden() and train on with the same script."""
    def tutorial_loader():
        return DataLoader(Points(), batch_size=BATCH, shuffle=False,
                          sampler=DistributedSampler(Points(), num_replicas=2, rank=rank))

    cfg = _config(os.path.join(directory, "ckpt"))
    first, trainer = _fit(3, tutorial_loader(), cfg, snapshot, epochs=[0])
    trainer._run_epoch(1, stop_after=1, on_stop=lambda: first.save(7, force=True))
    first.close()
    torch.manual_seed(4)
    again = harden(nn.Linear(2, 1), tutorial_loader(), cfg)
    step = again.resume()
    resumed = Trainer(again.model, again.loader, torch.optim.SGD(again.model.parameters(), lr=1e-4), snapshot)
    resumed.train([1, 2])
    again.close()
    return {"step": step, "stopped": trainer.seen[1], "resumed": resumed.seen, "peeks": resumed.peeks}


@pytest.mark.timeout(240)
def test_the_tutorial_script_ported_to_harden_reads_the_shards_plain_torch_reads(tmp_path):
    results = run_ranks(_tutorial, 2, args=(str(tmp_path),), init=False, timeout=200)
    for rank, out in enumerate(results):
        assert out["group_before"] is False  # the loader really was built before the group
        assert out["kept"]  # the user's own sampler object, not a replacement
        assert out["tutorial"] == [_plain_order(rank, e) for e in range(EPOCHS)]  # the peek changed nothing
        assert out["tutorial"][0] != out["tutorial"][1]  # and epochs reshuffle
        assert out["peeks"] == [BATCH] * EPOCHS
        assert out["shuffled"] == [_plain_order(rank, e, shuffle=True, seed=0) for e in range(EPOCHS)]
        assert out["ordered"] == [_plain_order(rank, e, shuffle=False) for e in range(EPOCHS)]
        assert out["ordered"][0] == list(range(rank, N, 2)) == out["ordered"][1]  # contiguous shards, in order
        resume = out["resume"]
        assert resume["step"] == 7
        assert resume["stopped"] == _plain_order(rank, 1)[:BATCH]
        assert resume["resumed"] == [_plain_order(rank, 1)[BATCH:], _plain_order(rank, 2)]
        assert resume["peeks"] == [BATCH, BATCH]
    assert results[0]["snapshot"] and not results[1]["snapshot"]  # rank 0 alone wrote its snapshot
    for epoch in range(EPOCHS):  # disjoint shards that cover the dataset
        for case in ("tutorial", "shuffled", "ordered"):
            shards = [set(out[case][epoch]) for out in results]
            assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(N))
    logs = results[0]["logs"]
    assert ("[rank 0/2] kept the loader's DistributedSampler (rank 0 of 2, shuffle=True, seed 0, "
            "drop_last=False)") in logs
    assert ("[rank 0/2] inserted a DistributedSampler (rank 0 of 2, shuffle=True because the loader shuffled "
            "(shuffle=True, a RandomSampler), seed 0 from data.seed, drop_last=False)") in logs
    assert ("[rank 0/2] inserted a DistributedSampler (rank 0 of 2, shuffle=False because the loader did not shuffle "
            "(shuffle=False), seed 0 from data.seed, drop_last=False)") in logs
