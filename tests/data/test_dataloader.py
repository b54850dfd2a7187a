"""safe_dataloader: the contract against plain DataLoader (hypothesis), each guard, and real gloo ranks."""

from __future__ import annotations

import gc
import inspect
import logging
import multiprocessing
import os
import random
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from robustdist import harden
from robustdist.config.schema import DataConfig, HardenConfig, HealthConfig
from robustdist.data import dataloader as dl
from robustdist.data.dataloader import SafeDataLoader, WorkerSeeder, safe_dataloader
from robustdist.runtime import log
from robustdist.runtime.errors import ConfigError, RobustDistWarning
from robustdist.testing.ranks import run_ranks

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


@pytest.mark.processes
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
    if multiprocessing.active_children():  # persistent workers: they end when their loader is collected
        gc.collect()  # a full collection costs a third of a second in a process that imported torch


def _user_init(worker_id):
    torch.manual_seed(1234 + worker_id)  # the user's own seeding runs last and wins


def test_keeps_every_user_setting():
    gen = torch.Generator().manual_seed(3)
    source = DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=2, collate_fn=_collate_pairs,
                        drop_last=True, timeout=30, worker_init_fn=_user_init, generator=gen, prefetch_factor=3,
                        persistent_workers=True, multiprocessing_context="spawn", in_order=False)
    safe = safe_dataloader(source, DataConfig(pin_memory=False))
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


@pytest.mark.processes
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
        safe_dataloader(Squares(), DataConfig(strict=True), persistent_workers=True)


def test_descriptor_leak_warning(monkeypatch):
    monkeypatch.setattr(dl, "_accelerator_available", lambda: True)  # pinning needs an accelerator
    monkeypatch.setattr(dl, "_pinned_persistent", 0)
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(dl.LEAK_WARN_THRESHOLD + 1):
            safe_dataloader(Squares(), DataConfig(check_shm=False), num_workers=1, pin_memory=True,
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
    loader = safe_dataloader(Squares(10), DataConfig(seed=seed), batch_size=2, shuffle=shuffle)
    epochs = [[i for b in loader for i in b[:, 0].tolist()] for _ in range(2)]
    gathered = [None] * world
    dist.all_gather_object(gathered, epochs)
    return gathered, type(loader.sampler).__name__


@pytest.mark.processes
@pytest.mark.parametrize("world", [2, 3])
def test_inserted_sampler_shards_disjointly_and_reshuffles(world):
    first = run_ranks(_shards, world, args=(world, True, 7), timeout=60)
    gathered, sampler_name = first[0]
    assert sampler_name == "ShardSampler"  # a DistributedSampler that Accelerate may not shard again
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


@pytest.mark.processes
@pytest.mark.parametrize("world", [2])  # 3 ranks x 2 workers added nothing 2 x 2 does not show, at 45 s
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


@pytest.mark.processes
@pytest.mark.parametrize("world", [2])
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


@pytest.mark.processes
def test_iterable_dataset_warns_with_guidance():
    for messages, batches in run_ranks(_iterable, 2, timeout=60):
        assert any("an IterableDataset is not sharded automatically" in m and "(a hang)" in m for m in messages)
        assert batches == [[0, 1], [2, 3]]


# ----------------------------------------------------------------------------- config forms, warnings
def test_config_forms():
    for config in (DataConfig(strict=True), HardenConfig(data=DataConfig(strict=True))):
        with pytest.raises(ConfigError, match="data.strict=True"):
            safe_dataloader(Squares(), config, persistent_workers=True)
        with pytest.raises(ConfigError, match="data.strict=True"):  # the argument's earlier name still works
            safe_dataloader(Squares(), cfg=config, persistent_workers=True)
    deprecated = r"safe_dataloader\(cfg=<dict>\): pass a DataConfig or a HardenConfig"
    with pytest.warns(DeprecationWarning, match=deprecated), pytest.raises(ConfigError, match="data.strict=True"):
        safe_dataloader(Squares(), {"data": {"strict": True}}, persistent_workers=True)
    with pytest.raises(ConfigError, match=r"got both config= \(the second argument\) and cfg=; expected one\. Fix: "):
        safe_dataloader(Squares(), DataConfig(), cfg=DataConfig())


NO_WATCHDOG = HardenConfig(health=HealthConfig(hang_timeout=None))


def _ours(caught):
    return [(w.filename, w.lineno) for w in caught if w.category is RobustDistWarning]


def test_warnings_point_at_the_users_line():
    log._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        safe_dataloader(Squares(), persistent_workers=True)
        harden(nn.Linear(2, 2), DataLoader(Squares(), pin_memory=True), NO_WATCHDOG).close()
    assert _ours(caught) == [(__file__, line), (__file__, line + 1)]  # directly, and through harden()


# ----------------------------------------------------------------------------- epochs
def _epoch_sampler():
    return DistributedSampler(Squares(), num_replicas=1, rank=0, shuffle=True, seed=1)


def _peek_then_loop(loader, epochs, set_epoch):
    """The tutorial's epoch: a batch-size peek, ``set_epoch`` (after or before the peek, or never), a full loop."""
    out = []
    for epoch in range(epochs):
        if set_epoch == "before":
            loader.sampler.set_epoch(epoch)
        peek = next(iter(loader)).tolist()
        if set_epoch == "after":
            loader.sampler.set_epoch(epoch)
        out.append((peek, [b.tolist() for b in loader]))
    return out


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("set_epoch", ["after", "before", "never"])
def test_an_abandoned_iteration_replays_the_epoch_like_plain_set_epoch(set_epoch, workers):
    kw = {"batch_size": 3, "num_workers": workers, "persistent_workers": workers > 0}  # one iterator, reset
    plain = DataLoader(Squares(), sampler=_epoch_sampler(), **kw)
    expected = []
    for epoch in range(3):
        plain.sampler.set_epoch(epoch)
        batches = [b.tolist() for b in plain]
        expected.append((batches[0], batches))
    assert expected[0] != expected[1] != expected[2]
    safe = safe_dataloader(DataLoader(Squares(), sampler=_epoch_sampler(), **kw), DataConfig(check_shm=False))
    assert _peek_then_loop(safe, 3, set_epoch) == expected
    del plain, safe
    gc.collect()


def test_an_epoch_ends_when_every_batch_was_yielded():
    loader = safe_dataloader(Squares(), sampler=_epoch_sampler(), batch_size=3)
    for i, _ in enumerate(loader):
        if i == len(loader) - 1:
            break  # no StopIteration was seen, but the epoch is complete
    first = next(iter(loader))
    assert loader.sampler.epoch == 1
    it = iter(loader)
    next(it), next(it)
    del it  # abandoned: epoch 1 is replayed
    assert next(iter(loader)).tolist() == first.tolist() and loader.sampler.epoch == 1


def test_a_single_process_shuffle_draws_like_a_plain_dataloader():
    def run(loader):
        torch.manual_seed(0)
        return [(next(iter(loader)).tolist(), [b.tolist() for b in loader]) for _ in range(2)]

    assert run(safe_dataloader(DataLoader(Squares(), batch_size=3, shuffle=True))) == run(
        DataLoader(Squares(), batch_size=3, shuffle=True))


# ----------------------------------------------------------------------------- samplers
def test_a_prebuilt_distributed_sampler_is_kept_with_its_settings(caplog):
    sampler = DistributedSampler(Squares(), num_replicas=1, rank=0, shuffle=False, seed=5, drop_last=True)
    with caplog.at_level(logging.INFO, logger="robustdist"):
        safe = safe_dataloader(DataLoader(Squares(), batch_size=2, shuffle=False, sampler=sampler))
    assert safe.sampler is sampler
    assert "kept the loader's DistributedSampler (rank 0 of 1, shuffle=False, seed 5, drop_last=True)" in caplog.text


def test_a_prebuilt_sampler_for_another_job_is_refused_with_the_fix():
    sampler = DistributedSampler(Squares(), num_replicas=2, rank=1)
    with pytest.raises(ConfigError) as info:
        safe_dataloader(DataLoader(Squares(), sampler=sampler))
    assert str(info.value) == (
        "the loader's DistributedSampler was built with num_replicas=2, rank=1, but this process is rank 0 of 1 (a "
        "single process: no process group and no launcher environment); expected num_replicas=1, rank=0, else "
        "ranks read the wrong or overlapping shards. Fix: build it as DistributedSampler(dataset, "
        "num_replicas=int(os.environ['WORLD_SIZE']), rank=int(os.environ['RANK'])) (torchrun's env; "
        "DistributedSampler(dataset) alone needs a process group, so build it after harden()/init_process_group), "
        "or drop sampler= and let robustdist insert one (DataLoader(dataset, shuffle=True) shuffles); or set "
        "data.auto_sampler=False if this shard is on purpose.")
    assert safe_dataloader(DataLoader(Squares(), sampler=sampler), DataConfig(auto_sampler=False)).sampler is sampler
    with pytest.raises(ConfigError, match=r"built on a dataset of 5 samples, but the loader's dataset has 11; "
                                          r"expected the same dataset.*Fix: pass the loader's own dataset"):
        safe_dataloader(DataLoader(Squares(), sampler=DistributedSampler(Squares(5), num_replicas=1, rank=0)))


class Reversed(DistributedSampler):
    """A user's DistributedSampler subclass."""

    def __iter__(self):
        return reversed(list(super().__iter__()))


class Evens(Sampler):
    """A custom sampler that does not shard."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return (self.n + 1) // 2


def _sampler_cases(rank):
    """Built before any process group exists: rank and world come from the launcher's env."""
    out = {"group": dist.is_initialized()}
    own = DistributedSampler(Squares(), num_replicas=2, rank=rank, shuffle=True, seed=3)
    out["kept"] = safe_dataloader(DataLoader(Squares(), batch_size=2, sampler=own)).sampler is own
    sub = Reversed(Squares(), num_replicas=2, rank=rank, shuffle=False)
    out["subclass"] = [i for b in safe_dataloader(DataLoader(Squares(), batch_size=2, sampler=sub)) for i in b[:, 0]]
    for name, sampler in (("swapped", DistributedSampler(Squares(), num_replicas=2, rank=1 - rank)),
                          ("bigger", DistributedSampler(Squares(), num_replicas=4, rank=rank)), ("custom", Evens(N))):
        try:
            safe_dataloader(DataLoader(Squares(), sampler=sampler))
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    for shuffle, plain in ((True, RandomSampler), (False, SequentialSampler)):  # safe_dataloader(ds, sampler=...)
        ds = Squares()
        loader = safe_dataloader(ds, sampler=plain(ds), batch_size=2)
        out[f"kwargs {shuffle}"] = (type(loader.sampler).__name__, loader.sampler.shuffle)
    return out


@pytest.mark.processes
def test_prebuilt_samplers_on_real_ranks_before_the_group():
    for rank, out in enumerate(run_ranks(_sampler_cases, 2, init=False, timeout=90)):
        assert out["group"] is False and out["kept"]
        expected = list(reversed(list(DistributedSampler(Squares(), num_replicas=2, rank=rank, shuffle=False))))
        assert [int(i) for i in out["subclass"]] == expected
        source = "from the manual launcher's environment; no process group exists yet"
        assert out["swapped"].startswith(
            f"[rank {rank}] the loader's DistributedSampler was built with num_replicas=2, rank={1 - rank}, but this "
            f"process is rank {rank} of 2 ({source}); expected num_replicas=2, rank={rank}, else ranks read the wrong "
            "or overlapping shards. Fix: build it as DistributedSampler(dataset, num_replicas=")
        assert f"built with num_replicas=4, rank={rank}," in out["bigger"]
        assert out["custom"].startswith(f"[rank {rank}] the loader has a custom sampler (Evens) and the job has 2 "
                                        "ranks; robustdist cannot shard a custom sampler safely")
        assert ("Fix: make the sampler yield only this rank's indices, the way a DistributedSampler does: subclass "
                "torch.utils.data.distributed.DistributedSampler") in out["custom"]
        assert out["kwargs True"] == ("ShardSampler", True)
        assert out["kwargs False"] == ("ShardSampler", False)


def test_set_epoch_with_the_same_value_twice_runs_that_epoch_twice():
    # regression: a repeated value was taken for "no set_epoch since the last epoch" and auto-advanced (0,1,2,1)
    plain = DataLoader(Squares(), sampler=_epoch_sampler(), batch_size=3)
    safe = safe_dataloader(Squares(), sampler=_epoch_sampler(), batch_size=3)
    ran = []
    for epoch in (0, 0, 1, 1):
        plain.sampler.set_epoch(epoch)
        safe.sampler.set_epoch(epoch)
        expected = [b.tolist() for b in plain]
        assert [b.tolist() for b in safe] == expected
        ran.append(safe.sampler.epoch)
    assert ran == [0, 0, 1, 1]
    for epoch in (2, 3):  # no more set_epoch calls: the loader advances by itself again, after whole epochs
        next(iter(safe))  # an abandoned iteration does not advance
        plain.sampler.set_epoch(epoch)
        assert [b.tolist() for b in safe] == [b.tolist() for b in plain]
        assert safe.sampler.epoch == epoch


def test_the_set_epoch_watch_travels_with_a_copied_or_pickled_sampler():
    import copy
    import pickle

    safe = safe_dataloader(Squares(), sampler=_epoch_sampler(), batch_size=3)
    list(safe)
    for clone in (copy.deepcopy(safe.sampler), pickle.loads(pickle.dumps(safe.sampler))):
        clone.set_epoch(5)
        assert (clone.epoch, safe.sampler.epoch) == (5, 0)
