"""unwrap_model / model_state_dict / load_model_state_dict across every wrapper nesting."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from robustdist.parallel.state_dict import canonical_key, load_model_state_dict, model_state_dict, unwrap_model
from robustdist.runtime.errors import StateDictMismatchError

FORMS = ["none", "ddp", "compile", "ddp(compile)", "compile(ddp)"]


def _wrap(model, form):
    ddp = nn.parallel.DistributedDataParallel
    return {
        "none": lambda m: m,
        "ddp": lambda m: ddp(m),
        "compile": lambda m: torch.compile(m),
        "ddp(compile)": lambda m: ddp(torch.compile(m)),
        "compile(ddp)": lambda m: torch.compile(ddp(m)),
    }[form](model)


def _one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


layer = st.sampled_from(["linear", "bn", "conv", "seq"])
trees = st.lists(st.tuples(layer, st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=4)


def _build(spec, seed):
    torch.manual_seed(seed)
    mods = []
    for kind, a, b in spec:
        if kind == "linear":
            mods.append(nn.Linear(a, b))
        elif kind == "bn":
            mods.append(nn.BatchNorm1d(a))
        elif kind == "conv":
            mods.append(nn.Conv1d(a, b, 1))
        else:
            mods.append(nn.Sequential(nn.Linear(a, b), nn.ModuleDict({"inner": nn.Linear(b, a)})))
    return nn.Sequential(*mods)


def test_prefix_round_trips_between_every_pair_of_forms():
    _one_rank_group()
    try:
        @settings(max_examples=40, deadline=None)
        @given(trees, st.sampled_from(FORMS), st.sampled_from(FORMS))
        def round_trip(spec, saved_form, loaded_form):
            source = _build(spec, seed=1)
            for m in source.modules():  # make buffers differ from a fresh model's too
                if isinstance(m, nn.BatchNorm1d):
                    m.running_mean.add_(3.0)
            expected = {k: v.clone() for k, v in source.state_dict().items()}
            saved = _wrap(source, saved_form).state_dict()  # keys carry that form's prefixes
            target = _build(spec, seed=2)
            wrapped_target = _wrap(target, loaded_form)
            report = load_model_state_dict(wrapped_target, saved)
            assert report.ok and sorted(report.loaded) == sorted(expected)
            got = model_state_dict(wrapped_target)
            assert set(got) == set(expected)  # never a module./_orig_mod. prefix
            assert all(torch.equal(got[k], expected[k]) for k in expected)

        round_trip()
    finally:
        dist.destroy_process_group()


def test_unwrap_strips_every_nesting():
    _one_rank_group()
    try:
        base = nn.Linear(2, 2)
        ddp = nn.parallel.DistributedDataParallel
        for wrapped in (ddp(torch.compile(base)), torch.compile(ddp(base)), nn.DataParallel(torch.compile(base)),
                        ddp(nn.DataParallel(torch.compile(base)))):
            assert unwrap_model(wrapped) is base
    finally:
        dist.destroy_process_group()


def test_canonical_key():
    assert canonical_key("module.module.0.weight") == "0.weight"
    assert canonical_key("_orig_mod.module.fc.bias") == "fc.bias"
    assert canonical_key("module._orig_mod.block._orig_mod.w") == "block.w"
    assert canonical_key("encoder.module.w") == "encoder.module.w"  # an inner attribute called module stays


def test_a_submodule_named_module_still_loads():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    a, b = Holder(), Holder()
    load_model_state_dict(torch.compile(b), {"module." + k: v for k, v in a.state_dict().items()})  # as if DDP(a)
    assert torch.equal(a.module.weight, b.module.weight)


def _mismatched():
    saved = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).state_dict()
    saved["extra.weight"] = torch.zeros(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(4, 2), nn.Linear(2, 2))
    model[1].weight.data = model[1].weight.data.double()
    return saved, model


def test_strict_mismatch_gives_a_readable_diff():
    saved, model = _mismatched()
    try:
        load_model_state_dict(model, {"module." + k: v for k, v in saved.items()})
    except StateDictMismatchError as e:
        message = str(e)
    else:
        raise AssertionError("expected StateDictMismatchError")
    assert message.startswith("the state dict does not fit Sequential (strict=True):\n")
    assert "  2 missing from the saved state:\n    2.weight\n    2.bias\n" in message
    assert "  1 unexpected (not in the model):\n    module.extra.weight\n" in message
    assert "  2 shape mismatches:\n    0.weight: saved (4, 3) vs model (3, 4)\n    0.bias: saved (4,) vs model (3,)" in message
    assert "  1 dtype mismatches:\n    1.weight: saved float32 vs model float64" in message
    assert "Fix: load the checkpoint of this architecture, or pass strict=False" in message


def test_non_strict_loads_what_matches_but_never_skips_shapes_silently():
    saved, model = _mismatched()
    try:
        load_model_state_dict(model, saved, strict=False)
    except StateDictMismatchError as e:
        assert "shape mismatches loading into Sequential (never skipped silently)" in str(e)
        assert "allow_shape_mismatch=True" in str(e)
    else:
        raise AssertionError("a shape mismatch must raise even with strict=False")
    report = load_model_state_dict(model, saved, strict=False, allow_shape_mismatch=True)
    assert report.missing == ["2.weight", "2.bias"] and report.unexpected == ["extra.weight"]
    assert [n for n, _, _ in report.shape_mismatches] == ["0.weight", "0.bias"]
    assert report.loaded == ["1.bias", "1.weight"]
    assert torch.equal(model[1].bias, saved["1.bias"]) and model[1].weight.dtype == torch.float64


def test_big_diffs_are_truncated_with_counts():
    saved = {f"layer{i}.weight": torch.zeros(1) for i in range(50)}
    try:
        load_model_state_dict(nn.Linear(1, 1), saved)
    except StateDictMismatchError as e:
        assert "  50 unexpected (not in the model):" in str(e) and "    ... and 30 more" in str(e)
    else:
        raise AssertionError("expected StateDictMismatchError")
