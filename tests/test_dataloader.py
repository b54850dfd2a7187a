"""safe_dataloader: the contract against plain DataLoader (hypothesis), each guard, and real gloo ranks."""

from __future__ import annotations

import gc
import os
import random
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from robustdist import dataloader as dl
from robustdist import log
from robustdist.dataloader import SafeDataLoader, WorkerSeeder, safe_dataloader
from robustdist.errors import ConfigError, RobustDistWarning
from robustdist.testing import run_ranks

N = 11


class Squares(Dataset):
    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


class WorkerProbe(Dataset):
    """Returns which process produced each sample and what its RNGs say."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return {"index": i, "worker": -1 if info is None else info.id, "ppid": os.getppid(),
                "torch": torch.randint(0, 2**31, (1,)).item(), "random": random.random()}


def _collate_pairs(batch):
    return torch.stack(batch).sum(dim=1)


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _drain(loader, seed=0):
    torch.manual_seed(seed)
    out = [b.tolist() for b in loader]
    return out


kwargs_st = st.fixed_dictionaries({
    "num_workers": st.integers(0, 2), "batch_size": st.integers(1, 4), "drop_last": st.booleans(),
    "shuffle": st.booleans(),
}, optional={
    "pin_memory": st.booleans(), "persistent_workers": st.booleans(), "prefetch_factor": st.integers(1, 3),
    "collate_fn": st.just(_collate_pairs),
})


@settings(max_examples=30, deadline=None)
@given(kwargs_st)
def test_same_samples_as_plain_dataloader_or_a_working_fix(kw):
    log._warned.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own pin_memory warning on CPU
            plain = DataLoader(Squares(), **kw)
            expected = _drain(plain)
        del plain
    except ValueError:
        expected = None  # torch rejects it: persistent_workers/prefetch_factor without workers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safe = safe_dataloader(Squares(), **kw)
        got = _drain(safe)
    assert isinstance(safe, DataLoader) and safe.pin_memory is False  # the documented pinning change on CPU
    ours = [str(w.message) for w in caught if w.category is RobustDistWarning]
    if expected is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            allowed = {k: v for k, v in kw.items() if k not in ("persistent_workers", "prefetch_factor")}
            assert got == _drain(DataLoader(Squares(), **allowed))
        assert any("need num_workers > 0" in m for m in ours)
    else:
        assert got == expected
    if kw.get("pin_memory"):
        assert any("disabled pin_memory: no accelerator" in m for m in ours)
    del safe
    gc.collect()


def _user_init(worker_id):
    torch.manual_seed(1234 + worker_id)  # the user's own seeding runs last and wins


def test_keeps_every_user_setting():
    gen = torch.Generator().manual_seed(3)
    source = DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=2, collate_fn=_collate_pairs,
                        drop_last=True, timeout=30, worker_init_fn=_user_init, generator=gen, prefetch_factor=3,
                        persistent_workers=True, multiprocessing_context="spawn", in_order=False)
    safe = safe_dataloader(source, cfg={"data": {"pin_memory": False}})
    assert isinstance(safe, SafeDataLoader)
    assert (safe.batch_size, safe.drop_last, safe.timeout, safe.num_workers, safe.prefetch_factor) == (3, True, 30, 2, 3)
    assert safe.collate_fn is _collate_pairs and safe.generator is gen and safe.persistent_workers
    assert safe.multiprocessing_context.get_start_method() == "spawn" and safe.in_order is False
    assert type(safe.sampler).__name__ == "RandomSampler"  # shuffle intent kept
    assert isinstance(safe.worker_init_fn, WorkerSeeder) and safe.worker_init_fn.user_fn is _user_init
    again = safe_dataloader(safe)  # idempotent: no double chaining
    assert again.worker_init_fn.user_fn is _user_init


def test_custom_sampler_and_batch_sampler_are_kept_single_process():
    ds = Squares()
    bs = BatchSampler(SequentialSampler(range(N)), batch_size=4, drop_last=False)
    safe = safe_dataloader(DataLoader(ds, batch_sampler=bs))
    assert safe.batch_sampler is bs and [b.tolist()[0] for b in safe] == [[0, 0], [4, 16], [8, 64]]


def test_epochs_advance_and_user_set_epoch_is_respected():
    sampler = DistributedSampler(Squares(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = safe_dataloader(Squares(), sampler=sampler, batch_size=N)
    epochs = []
    for _ in range(2):
        list(loader)
        epochs.append(sampler.epoch)
    sampler.set_epoch(5)
    for _ in range(2):
        list(loader)
        epochs.append(sampler.epoch)
    assert epochs == [0, 1, 5, 6]


def test_forkserver_when_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(dl.checks, "cuda_initialized", lambda: True)  # only the CUDA probe is faked
    with pytest.warns(RobustDistWarning, match="switched the workers' start method from fork to forkserver"):
        loader = safe_dataloader(WorkerProbe(), batch_size=4, num_workers=2)
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    batches = list(loader)
    parents = {p for b in batches for p in b["ppid"].tolist()}
    assert os.getpid() not in parents  # workers were forked by the forkserver, not by this process
    del loader
    gc.collect()


class Unpicklable(Squares):
    def __init__(self):
        super().__init__()
        self.cache = {"lock": None}
        self.lock = threading.Lock()


def test_unpicklable_dataset_is_named(monkeypatch):
    monkeypatch.setattr(dl.checks, "cuda_initialized", lambda: True)
    with pytest.raises(ConfigError) as exc:
        safe_dataloader(Unpicklable(), num_workers=1)
    assert str(exc.value).startswith("the dataset must pickle to reach forkserver/spawn workers, but the dataset.lock "
                                     "(lock; TypeError: cannot pickle '_thread.lock' object) does not. Fix: open files")


def test_shm_capacity_reduces_prefetch_then_workers():
    batch = 4 * 2 * 8  # 4 samples of two int64
    with pytest.warns(RobustDistWarning) as record:
        loader = safe_dataloader(Squares(), batch_size=4, num_workers=2, prefetch_factor=2,
                                 shm_free_bytes=batch * 2 * 2 + 1)  # budget: half the free space
    assert (loader.num_workers, loader.prefetch_factor) == (2, 1)  # prefetch goes first
    message = str(record[0].message)
    assert message == ("2 workers x prefetch_factor 2 x 64 B per batch = 256 B in flight does not fit half of the 257 B "
                       "free in /dev/shm (workers die with 'Bus error'); reduced to num_workers=2, prefetch_factor=1. "
                       "Fix the cause: give the container more shared memory (docker run --shm-size=8g, or --ipc=host).")
    fewer = safe_dataloader(Squares(), batch_size=4, num_workers=3, prefetch_factor=1, shm_free_bytes=batch * 4)
    assert (fewer.num_workers, fewer.prefetch_factor) == (2, 1)  # then workers
    tiny = safe_dataloader(Squares(), batch_size=4, num_workers=2, shm_free_bytes=10)
    assert tiny.num_workers == 0 and tiny.prefetch_factor is None
    assert [b.tolist() for b in tiny][0] == [[0, 0], [1, 1], [2, 4], [3, 9]]
    roomy = safe_dataloader(Squares(), batch_size=4, num_workers=2, shm_free_bytes=1 << 30)
    assert (roomy.num_workers, roomy.prefetch_factor) == (2, 2)


def test_fit_in_flight():
    assert dl.checks.fit_in_flight(10, 1000, 4, 3) == (4, 3)
    assert dl.checks.fit_in_flight(10, 200, 4, 3) == (4, 2)  # budget 100: fewer prefetched batches first
    assert dl.checks.fit_in_flight(10, 100, 4, 3) == (4, 1)
    assert dl.checks.fit_in_flight(10, 60, 4, 3) == (3, 1)  # then fewer workers
    assert dl.checks.fit_in_flight(10, 10, 4, 3) == (0, 0)  # not even one batch: load in the main process


def test_strict_raises_instead_of_fixing():
    with pytest.raises(ConfigError, match=r"dropped persistent_workers: they need num_workers > 0 .*data.strict=True"):
        safe_dataloader(Squares(), cfg={"data": {"strict": True}}, persistent_workers=True)


def test_descriptor_leak_warning(monkeypatch):
    monkeypatch.setattr(dl, "_accelerator_available", lambda: True)  # pinning needs an accelerator
    monkeypatch.setattr(dl, "_pinned_persistent", 0)
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(dl.LEAK_WARN_THRESHOLD + 1):
            safe_dataloader(Squares(), {"data": {"check_shm": False}}, num_workers=1, pin_memory=True,
                                persistent_workers=True)
    leaks = [str(w.message) for w in caught if "leaks file descriptors" in str(w.message)]
    assert leaks == [f"{dl.LEAK_WARN_THRESHOLD + 1} DataLoaders with pin_memory=True and persistent_workers=True were "
                     f"created in this process (pid {os.getpid()}); each recreation leaks file descriptors (torch "
                     f"#91252) and RLIMIT_NOFILE is {soft}. Fix: create the loader once and reuse it across epochs."]


def test_unknown_keyword_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown keyword argument\(s\) \['batchsize'\]"):
        safe_dataloader(Squares(), batchsize=3)


# ----------------------------------------------------------------------------- real ranks
def _shards(rank, world, shuffle, seed):
    loader = safe_dataloader(Squares(10), cfg={"data": {"seed": seed}}, batch_size=2, shuffle=shuffle)
    epochs = [[i for b in loader for i in b[:, 0].tolist()] for _ in range(2)]
    gathered = [None] * world
    dist.all_gather_object(gathered, epochs)
    return gathered, type(loader.sampler).__name__


@pytest.mark.parametrize("world", [2, 3])
def test_inserted_sampler_shards_disjointly_and_reshuffles(world):
    first = run_ranks(_shards, world, args=(world, True, 7), timeout=60)
    gathered, sampler_name = first[0]
    assert sampler_name == "DistributedSampler"
    epoch0 = [i for rank_epochs in gathered for i in rank_epochs[0]]
    per_rank = -(-10 // world)
    assert len(epoch0) == per_rank * world and set(epoch0) == set(range(10))  # covers; padding repeats a few
    assert len(epoch0) - len(set(epoch0)) == per_rank * world - 10
    assert [g[0] for g in gathered] != [g[1] for g in gathered]  # epoch 1 is a different order
    again = run_ranks(_shards, world, args=(world, True, 7), timeout=60)[0][0]
    assert again == gathered  # the same seed reproduces across runs


def _worker_seeds(rank):
    loader = safe_dataloader(WorkerProbe(), batch_size=2, num_workers=2)
    return [(int(w), int(t)) for b in loader for w, t in zip(b["worker"], b["torch"])]


@pytest.mark.parametrize("world", [2, 3])
def test_worker_seeds_differ_across_ranks_and_workers(world):
    per_rank = run_ranks(_worker_seeds, world, timeout=90)
    draws = {(rank, w): t for rank, pairs in enumerate(per_rank) for w, t in pairs}
    assert len(set(draws.values())) == len(draws) == world * 2  # every (rank, worker) draws differently
    assert run_ranks(_worker_seeds, world, timeout=90) == per_rank  # and reproducibly


def _custom_batch_sampler(rank):
    bs = BatchSampler(SequentialSampler(range(N)), batch_size=2, drop_last=False)
    try:
        safe_dataloader(DataLoader(Squares(), batch_sampler=bs))
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("world", [2, 3])
def test_custom_batch_sampler_raises_when_distributed(world):
    for rank, message in enumerate(run_ranks(_custom_batch_sampler, world, timeout=60)):
        assert message.startswith(f"[rank {rank}] the loader has a custom batch_sampler (BatchSampler) and the job has "
                                  f"{world} ranks; robustdist cannot shard a custom batch_sampler safely")
        assert "Fix: make the sampler yield only this rank's indices" in message


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _iterable(rank):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = safe_dataloader(Stream(), batch_size=2)
    return [str(w.message) for w in caught], [b.tolist() for b in loader]


def test_iterable_dataset_warns_with_guidance():
    for messages, batches in run_ranks(_iterable, 2, timeout=60):
        assert any("an IterableDataset is not sharded automatically" in m and "(a hang)" in m for m in messages)
        assert batches == [[0, 1], [2, 3]]
