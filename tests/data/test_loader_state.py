"""SafeDataLoader.state_dict/load_state_dict: a new loader continues exactly where a saved one stopped."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from robustdist.config.schema import DataConfig
from robustdist.data.dataloader import safe_dataloader
from robustdist.runtime.errors import CheckpointError, RobustDistWarning
from robustdist.testing.ranks import run_ranks

DATA = TensorDataset(torch.arange(40).float())


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _run(loader, batches, stop_after=None):
    """Iterate epochs until ``batches`` batches; draw one random number per batch (the training's RNG use).
    Returns (batches, draws, state and RNG captured after ``stop_after`` batches)."""
    seen, draws, saved = [], [], None
    while len(seen) < batches:
        for (b,) in loader:
            seen.append(b.tolist())
            draws.append(torch.rand(1).item())
            if len(seen) == stop_after:
                saved = (loader.state_dict(), torch.get_rng_state())
            if len(seen) == batches:
                break
    return seen, draws, saved


def _fresh(num_workers=0, **kw):
    return safe_dataloader(DataLoader(DATA, batch_size=3, shuffle=True, num_workers=num_workers, **kw))


@pytest.mark.processes
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_after", [5, 14, 20, 33])  # 14 batches per epoch: mid-epoch and on a boundary
def test_resume_yields_the_remaining_batches_and_random_stream(num_workers, stop_after):
    torch.manual_seed(0)
    reference, ref_draws, _ = _run(_fresh(), 40)
    torch.manual_seed(0)
    _, _, (state, rng) = _run(_fresh(num_workers), stop_after, stop_after=stop_after)
    assert state["in_flight"] == (stop_after % 14 != 0)
    torch.manual_seed(999)  # a restarted process: other RNG, a new loader
    loader = _fresh(num_workers)
    loader.load_state_dict(state)
    torch.set_rng_state(rng)  # what the checkpoint restores
    rest, draws, _ = _run(loader, 40 - stop_after)
    assert rest == reference[stop_after:]
    assert draws == ref_draws[stop_after:]


def test_a_loader_generator_is_replayed_too():
    def fresh():
        return _fresh(generator=torch.Generator().manual_seed(5))

    reference, _, _ = _run(fresh(), 20)
    _, _, (state, _) = _run(fresh(), 6, stop_after=6)
    loader = fresh()
    loader.load_state_dict(state)
    assert _run(loader, 14)[0] == reference[6:]


def test_state_is_plain_and_loads_with_weights_only(tmp_path):
    loader = _fresh()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["batches"] == 2 and state["in_flight"] and state["iterations"] == 1
    torch.save(state, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True)["batches"] == 2
    assert _fresh().state_dict()["in_flight"] is False  # never iterated


def test_bad_state_and_changed_length():
    with pytest.raises(CheckpointError, match=r"`version` is 99 \(int\); expected 1 \(the version of "
                       r"SafeDataLoader.state_dict\(\) in this robustdist\)\. Fix: pass the state saved by"):
        _fresh().load_state_dict({"version": 99})
    with pytest.raises(CheckpointError, match=r"loader state is \[\] \(list\); expected a dict from "
                       r"SafeDataLoader.state_dict\(\) \(version 1\)\. Fix: pass the dict"):
        _fresh().load_state_dict([])
    _, _, (state, _) = _run(_fresh(), 4, stop_after=4)
    other = safe_dataloader(DataLoader(DATA, batch_size=5, shuffle=True))
    with pytest.warns(RobustDistWarning, match="8 batches per epoch but the saved state was taken with 14") as record:
        other.load_state_dict(state)
    assert record[0].filename == __file__  # the user's line, not robustdist's
    assert len([b for b in other]) == 8  # the interrupted epoch restarts whole


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_iterable_datasets_restart_the_epoch_with_a_warning():
    loader = safe_dataloader(DataLoader(Stream(), batch_size=2))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    fresh = safe_dataloader(DataLoader(Stream(), batch_size=2))
    with pytest.warns(RobustDistWarning, match="IterableDataset.*restarts from the beginning"):
        fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh][0] == [0, 1]


def _distributed_resume(rank):
    def fresh():
        return safe_dataloader(DataLoader(DATA, batch_size=3, shuffle=True), DataConfig(seed=4))

    reference, _, _ = _run(fresh(), 16)  # 20 samples per rank: 7 batches per epoch
    _, _, (state, rng) = _run(fresh(), 9, stop_after=9)
    loader = fresh()
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rest, _, _ = _run(loader, 7)
    return rest == reference[9:], state["epoch"], loader.sampler.epoch


@pytest.mark.processes
def test_distributed_sampler_resumes_mid_epoch_on_every_rank():
    assert run_ranks(_distributed_resume, 2, timeout=60) == [(True, 1, 2), (True, 1, 2)]


# ----------------------------------------------------------------------------- abandoned iterations
def _same_state(a, b):
    rng_a, rng_b = a.pop("rng"), b.pop("rng")
    same_rng = (rng_a is None and rng_b is None) or (rng_a.keys() == rng_b.keys() and all(
        (rng_a[k] is None and rng_b[k] is None) or torch.equal(rng_a[k], rng_b[k]) for k in rng_a))
    return a == b and same_rng


@pytest.mark.processes
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_abandoned_iteration_after_a_resume_starts_again_at_the_restored_position(num_workers):
    torch.manual_seed(0)
    reference, ref_draws, _ = _run(_fresh(), 28)
    torch.manual_seed(0)
    _, _, (state, rng) = _run(_fresh(), 5, stop_after=5)
    loader = _fresh(num_workers)
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    assert _same_state(loader.state_dict(), dict(state))  # a save before iterating keeps the position
    it = iter(loader)
    assert next(it)[0].tolist() == reference[5]  # the batch-size peek
    del it  # abandoned
    assert _same_state(loader.state_dict(), dict(state))  # still the restored position, not "epoch done"
    rest, draws, _ = _run(loader, 23)
    assert rest == reference[5:] and draws == ref_draws[5:]  # the peek changed neither the data nor the RNG


def _epoch_loader():
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=2)
    return safe_dataloader(DataLoader(DATA, batch_size=3, sampler=sampler))


def test_a_checkpoint_after_an_abandoned_iteration_replays_that_epoch():
    loader = _epoch_loader()
    list(loader)  # epoch 0
    peek = next(iter(loader))[0]  # epoch 1 starts, and is abandoned
    state = loader.state_dict()
    assert (state["epoch"], state["iterations"], state["in_flight"], state["batches"]) == (1, 2, True, 0)
    live = [b.tolist() for (b,) in loader]  # the live loader replays epoch 1
    assert live[0] == peek.tolist() and len(live) == 14
    restored = _epoch_loader()
    restored.load_state_dict(state)
    assert [b.tolist() for (b,) in restored] == live
    assert restored.sampler.epoch == 1
    next(iter(restored))
    assert restored.sampler.epoch == 2  # epoch 1 ran out: the next iteration is epoch 2


@pytest.mark.parametrize("set_epoch", [True, False])
def test_a_peek_at_the_last_batch_of_a_restored_epoch_does_not_end_it(set_epoch):
    """The DDP tutorial's loop (a batch-size peek, then set_epoch(epoch), then the epoch) resumed one batch before an
    epoch ends: the peek takes that batch and is abandoned; the loop then trains on it, and only it (regression: the
    peek counted as the epoch's last batch, and the loop ran the whole epoch again)."""
    straight = _epoch_loader()
    reference = [[b.tolist() for (b,) in straight] for _ in range(2)]  # epochs 0 and 1, 14 batches each
    loader = _epoch_loader()
    list(loader)
    it = iter(loader)
    for _ in range(13):  # epoch 1, one batch left
        next(it)
    state = loader.state_dict()
    restored = _epoch_loader()
    restored.load_state_dict(state)
    assert next(iter(restored))[0].tolist() == reference[1][13]  # the peek: abandoned
    assert restored.state_dict()["batches"] == 13  # still the restored position
    if set_epoch:
        restored.sampler.set_epoch(1)  # the tutorial's own epoch counter: step // len(loader) == 1
    assert [b.tolist() for (b,) in restored] == [reference[1][13]]
    assert restored.sampler.epoch == 1
    next(iter(restored))
    assert restored.sampler.epoch == 2  # then the next epoch, as after any epoch


@pytest.mark.processes
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_save_after_the_last_batch_of_a_restored_epoch_resumes_in_the_next(num_workers):
    """The loop's own save after the restored epoch's one remaining batch (before the loop asks for the next): the
    epoch has ended, so a resume from that save starts the next epoch, not an empty replay of this one."""
    def make():
        sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=2)
        return safe_dataloader(DataLoader(DATA, batch_size=3, sampler=sampler, num_workers=num_workers))
    reference = make()
    epochs = [[b.tolist() for (b,) in reference] for _ in range(3)]
    loader = make()
    list(loader)
    it = iter(loader)
    for _ in range(13):
        next(it)
    restored = make()
    restored.load_state_dict(loader.state_dict())
    for (b,) in restored:  # one batch: the loop saves after it, still inside the loop
        assert b.tolist() == epochs[1][13]
        state = restored.state_dict()
    assert (state["epoch"], state["in_flight"], state["batches"]) == (1, False, 0)
    again = make()
    again.load_state_dict(state)
    assert [b.tolist() for (b,) in again] == epochs[2]


def test_set_epoch_to_another_epoch_after_a_resume_starts_that_epoch_whole():
    loader = _epoch_loader()
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    restored = _epoch_loader()
    restored.load_state_dict(state)
    restored.sampler.set_epoch(3)  # the user's own epoch counter disagrees with the restored epoch 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        batches = [b.tolist() for (b,) in restored]
    plain = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=2)
    plain.set_epoch(3)
    assert batches == [b.tolist() for (b,) in DataLoader(DATA, batch_size=3, sampler=plain)]
    ours = [w for w in caught if w.category is RobustDistWarning]
    assert [(w.filename, w.lineno) for w in ours] == [(__file__, line)]
    assert str(ours[0].message) == (
        "set_epoch(3) was called on a loader restored to epoch 0, batch 4, before that epoch ended: epoch 3 starts "
        "from its beginning and the restored position is not used. Fix: continue your epoch counter from "
        "loader.sampler.epoch after a resume.")


def _plain_epoch(shuffle=False):
    return [b.tolist() for (b,) in DataLoader(DATA, batch_size=3, shuffle=shuffle)]


@pytest.mark.processes
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_peek_with_persistent_workers_is_not_checkpointed_as_consumed(num_workers):
    # regression: the loader keeps a persistent-workers iterator, so a peek counted as a live loop (batches == 1)
    def make():
        return safe_dataloader(DataLoader(DATA, batch_size=3, num_workers=num_workers,
                                          persistent_workers=num_workers > 0))
    loader = make()
    next(iter(loader))  # a batch-size peek, abandoned
    state = loader.state_dict()
    assert (state["in_flight"], state["batches"]) == (True, 0)
    assert [b.tolist() for (b,) in loader] == _plain_epoch()  # the live loader replays the epoch
    restored = make()
    restored.load_state_dict(state)
    assert [b.tolist() for (b,) in restored] == _plain_epoch()  # and so does a restored one
    if num_workers:
        it = iter(loader)  # a live loop with persistent workers still records its own position
        next(it), next(it)
        assert loader.state_dict()["batches"] == 2
        del it


def test_two_iterators_after_a_resume_both_start_at_the_restored_batch():
    # regression: the restored start was one slot, taken by whichever iterator drew first
    loader = safe_dataloader(DataLoader(DATA, batch_size=3))
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it
    restored = safe_dataloader(DataLoader(DATA, batch_size=3))
    restored.load_state_dict(state)
    a, b = iter(restored), iter(restored)
    assert [x.tolist() for (x,) in a] == [x.tolist() for (x,) in b] == _plain_epoch()[2:]
