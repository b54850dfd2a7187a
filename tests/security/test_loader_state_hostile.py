"""A saved loader state comes from a checkpoint file: every malformed one is refused up front with a
CheckpointError naming the field, and the refused loader is left exactly as it was."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from robustdist.data.dataloader import safe_dataloader
from robustdist.data.epochs import Position
from robustdist.data.state import FIELDS, MAX_COUNT
from robustdist.runtime.errors import CheckpointError

DATA = TensorDataset(torch.arange(40).float())
BATCHES = 14  # 40 samples in batches of 3


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _fresh():
    """A loader whose order depends on its sampler's epoch, with a generator: both are part of its state."""
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=3)
    return safe_dataloader(DataLoader(DATA, batch_size=3, sampler=sampler, generator=torch.Generator().manual_seed(7)))


def _epochs(loader, n=2):
    return [[b.tolist() for (b,) in loader] for _ in range(n)]


def _state_after(batches):
    loader = _fresh()
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


IN_FLIGHT = _state_after(4)
IDLE = _state_after(BATCHES)  # a whole epoch: nothing in flight
assert IN_FLIGHT["in_flight"] and not IDLE["in_flight"]
RNG = IN_FLIGHT["rng"]


def _with(base, **changes):
    state = copy.deepcopy(base)
    state.update(changes)
    return state


def _without(base, key):
    state = copy.deepcopy(base)
    del state[key]
    return state


def _rng(**changes):
    return _with(IN_FLIGHT, rng={**RNG, **changes})


_NONCONTIGUOUS = torch.stack([RNG["torch"], RNG["torch"]], 1)[:, 0]
_GARBAGE = torch.full_like(RNG["torch"], 0xFF)

HOSTILE = {  # name: (state, what the message must name)
    "negative batches": (_with(IN_FLIGHT, batches=-1), "`batches` is -1 (int)"),
    "batches past num_batches": (_with(IN_FLIGHT, batches=BATCHES + 1), "`batches` is 15 (int)"),
    "batches bool": (_with(IN_FLIGHT, batches=True), "`batches` is True (bool)"),
    "batches float": (_with(IN_FLIGHT, batches=2.0), "`batches` is 2.0 (float)"),
    "batches huge": (_with(IN_FLIGHT, num_batches=None, batches=10**5000), "`batches` is"),
    "missing iterations": (_without(IN_FLIGHT, "iterations"), "missing key(s) ['iterations']"),
    "missing version": (_without(IN_FLIGHT, "version"), "missing key(s) ['version']"),
    "missing rng": (_without(IDLE, "rng"), "missing key(s) ['rng']"),
    "unknown key": (_with(IN_FLIGHT, extra=1), "unknown key(s) 'extra' (str)"),
    "iterations str": (_with(IN_FLIGHT, iterations="3"), "`iterations` is '3' (str)"),
    "iterations negative": (_with(IDLE, iterations=-2), "`iterations` is -2 (int)"),
    "iterations huge": (_with(IN_FLIGHT, iterations=MAX_COUNT + 1), "`iterations` is 9223372036854775808 (int)"),
    "iterations zero in flight": (_with(IN_FLIGHT, iterations=0), "`iterations` is 0 (int)"),
    "epoch negative": (_with(IN_FLIGHT, epoch=-1), "`epoch` is -1 (int)"),
    "epoch str": (_with(IN_FLIGHT, epoch="0"), "`epoch` is '0' (str)"),
    "epoch bool": (_with(IDLE, epoch=False), "`epoch` is False (bool)"),
    "epoch huge": (_with(IDLE, epoch=2**64), "`epoch` is"),
    "num_batches negative": (_with(IDLE, num_batches=-3), "`num_batches` is -3 (int)"),
    "num_batches list": (_with(IDLE, num_batches=[14]), "`num_batches` is [14] (list)"),
    "in_flight int": (_with(IN_FLIGHT, in_flight=1), "`in_flight` is 1 (int)"),
    "in_flight str": (_with(IN_FLIGHT, in_flight="yes"), "`in_flight` is 'yes' (str)"),
    "rng missing in flight": (_with(IN_FLIGHT, rng=None), "`rng` is None (NoneType)"),
    "rng while idle": (_with(IDLE, rng=RNG), "`rng` is"),
    "rng list": (_with(IN_FLIGHT, rng=[RNG["torch"]]), "`rng` is"),
    "rng missing generator key": (_with(IN_FLIGHT, rng={"torch": RNG["torch"]}), "`rng` is"),
    "rng torch float": (_rng(torch=RNG["torch"].float()), "`rng['torch']` is a torch.float32 tensor"),
    "rng torch str": (_rng(torch="state"), "`rng['torch']` is 'state' (str)"),
    "rng torch meta": (_rng(torch=torch.empty(5056, dtype=torch.uint8, device="meta")), "`rng['torch']` is"),
    "rng torch wrong size": (_rng(torch=torch.zeros(3, dtype=torch.uint8)), "`rng['torch']` is a torch.uint8 tensor "
                             "of shape (3,)"),
    "rng torch garbage": (_rng(torch=_GARBAGE), "`rng['torch']` is"),
    "rng torch non-contiguous": (_rng(torch=_NONCONTIGUOUS), "`rng['torch']` is"),
    "rng generator wrong size": (_rng(generator=torch.zeros(7, dtype=torch.uint8)), "`rng['generator']` is"),
    "rng generator int": (_rng(generator=5), "`rng['generator']` is 5 (int)"),
    "version future": (_with(IN_FLIGHT, version=2), "`version` is 2 (int)"),
    "version str": (_with(IN_FLIGHT, version="1"), "`version` is '1' (str)"),
    "version bool": (_with(IN_FLIGHT, version=True), "`version` is True (bool)"),
    "not a dict: list": ([("version", 1)], "loader state is [('version', 1)] (list)"),
    "not a dict: None": (None, "loader state is None (NoneType)"),
    "not a dict: tensor": (torch.zeros(3), "loader state is a torch.float32 tensor"),
}


def test_an_epoch_that_would_overflow_the_samplers_seed_is_refused():
    # regression: seed + epoch past 2**64-1 passed validation and raised torch's raw ValueError at iter()
    def big_seed():
        sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=2**63)
        return safe_dataloader(DataLoader(DATA, batch_size=3, sampler=sampler))
    limit = 2**64 - 2 - 2**63  # seed + epoch + 1 (the next epoch) must fit manual_seed's 2**64-1
    for epoch in (2**63 - 1, limit + 1):
        loader = big_seed()
        with pytest.raises(CheckpointError) as info:
            loader.load_state_dict(_with(IDLE, epoch=epoch))
        assert f"loader state `epoch` is {epoch}; expected at most {limit}" in str(info.value)
        assert "its seed is 9223372036854775808" in str(info.value) and "Fix:" in str(info.value)
        assert loader._pos == Position() and loader.sampler.epoch == 0
    loader = big_seed()
    loader.load_state_dict(_with(IDLE, epoch=limit))  # the largest epoch whose next epoch still seeds
    assert len(_epochs(loader, 1)[0]) == BATCHES and loader.sampler.epoch == limit + 1


def test_the_valid_states_load_and_resume():
    torch.manual_seed(0)
    reference = [b for epoch in _epochs(_fresh(), 2) for b in epoch]
    for state, skip in ((IN_FLIGHT, 4), (IDLE, BATCHES)):
        loader = _fresh()
        loader.load_state_dict(copy.deepcopy(state))
        assert [b for epoch in _epochs(loader, 2) for b in epoch][: 2 * BATCHES - skip] == reference[skip:]


@pytest.mark.parametrize("name", list(HOSTILE))
def test_malformed_state_is_refused_and_the_loader_is_unchanged(name):
    state, named = HOSTILE[name]
    torch.manual_seed(0)
    expected = _epochs(_fresh())
    torch.manual_seed(0)
    loader = _fresh()
    with pytest.raises(CheckpointError) as info:
        loader.load_state_dict(state)
    message = str(info.value)
    assert named in message and "expected" in message and "Fix: " in message
    assert len(message) < 600
    assert loader._pos == Position() and loader.sampler.epoch == 0
    assert _epochs(loader) == expected  # same batches as a fresh loader: no field was applied


@pytest.mark.parametrize("name", ["batches past num_batches", "rng torch garbage", "epoch negative", "version future"])
def test_a_refused_state_leaves_a_loader_mid_epoch_where_it_was(name):
    torch.manual_seed(0)
    reference = [b for epoch in _epochs(_fresh(), 2) for b in epoch]
    loader = _fresh()
    list(loader)  # epoch 0
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(3)]
    before = loader.state_dict()
    with pytest.raises(CheckpointError):
        loader.load_state_dict(HOSTILE[name][0])
    after = loader.state_dict()
    assert {k: v for k, v in after.items() if k != "rng"} == {k: v for k, v in before.items() if k != "rng"}
    assert all(torch.equal(after["rng"][k], before["rng"][k]) for k in ("torch", "generator"))
    assert first == reference[BATCHES:BATCHES + 3]
    del it
    assert [b.tolist() for (b,) in loader] == reference[BATCHES:]  # abandoned: epoch 1 replays, not epoch 2


def test_rng_refusals_chain_torchs_error():
    with pytest.raises(CheckpointError, match=r"a cpu generator accepts \(torch said: .*size") as info:
        _fresh().load_state_dict(HOSTILE["rng torch wrong size"][0])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_messages_name_the_remedy():
    with pytest.raises(CheckpointError, match=r"loader state `batches` is -1 \(int\); expected an int \(not a bool\) "
                       r"from 0 to 14 \(`num_batches` is 14\)\. Fix: pass the dict SafeDataLoader\.state_dict\(\) "
                       r"returned, unmodified \(check that the checkpoint holds this loader's state\), or skip "
                       r"load_state_dict\(\) to start the loader fresh\."):
        _fresh().load_state_dict(HOSTILE["negative batches"][0])
    with pytest.raises(CheckpointError, match=r"loader state `version` is 2 \(int\); expected 1 \(the version of "
                       r"SafeDataLoader\.state_dict\(\) in this robustdist\)\. Fix: pass the state saved by this "
                       r"robustdist version, or start the loader fresh \(skip load_state_dict\(\)\)\."):
        _fresh().load_state_dict(HOSTILE["version future"][0])
    with pytest.raises(CheckpointError, match=r"missing key\(s\) \['iterations'\]; unknown key\(s\) 'x' \(str\); "
                       r"expected exactly the keys \['version', 'iterations', "):
        _fresh().load_state_dict({**_without(IDLE, "iterations"), "x": 0})


def test_a_state_read_back_with_weights_only_loads(tmp_path):
    torch.save({"loader": IN_FLIGHT}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    loader = _fresh()
    loader.load_state_dict(state)
    assert len([b for b in loader]) == BATCHES - 4


_TENSORS = [torch.zeros(3, dtype=torch.uint8), torch.tensor(1.5), torch.empty(2, device="meta"), RNG["torch"],
            _GARBAGE, torch.zeros(5056, dtype=torch.int8), torch.zeros((), dtype=torch.uint8)]
JUNK = st.one_of(
    st.integers(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 4, 13, 14, 15, MAX_COUNT, MAX_COUNT + 1, 10**400]),
    st.floats(allow_nan=True), st.text(max_size=8), st.none(), st.booleans(), st.binary(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.fixed_dictionaries({"torch": st.sampled_from(_TENSORS), "generator": st.sampled_from([None, *_TENSORS])}),
    st.sampled_from(_TENSORS), st.from_type(type),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["in flight", "idle"]), st.sampled_from(FIELDS), JUNK)
def test_any_one_junk_field_loads_or_raises_checkpoint_error(which, field, junk):
    state = _with(IN_FLIGHT if which == "in flight" else IDLE)
    state[field] = junk
    loader = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a changed num_batches restarts the epoch with a warning
        try:
            loader.load_state_dict(state)
        except CheckpointError as e:
            assert f"`{field}" in str(e)
            event("refused")
            return
        epochs = _epochs(loader)
    event("loaded")
    assert len(epochs[1]) == BATCHES  # iteration works; the epoch after the resumed one is whole
