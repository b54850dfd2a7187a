"""What save accepts, load loads; and no save is silently lost: step order, step sizes, a crash inside a
re-save, a reader racing a writer's rotation, snapshot copies of unusual tensors, and bad load() steps."""

from __future__ import annotations

import collections
import enum
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.runtime.errors import CheckpointBusyError, CheckpointError
from tests.security._forge import state_for

ROOT = Path(__file__).resolve().parents[2]


class Color(str, enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 2


class Name(str):
    pass


class Tagged(torch.Tensor):
    pass


Point = collections.namedtuple("Point", "x y")

_refused = st.sampled_from([Color.RED, Level.HIGH, Name("n"), collections.defaultdict(int, a=1), Point(1, 2),
                            torch.ones(2).as_subclass(Tagged), {1.5: 1}, {(1, 2): 3}, {1, 2}, slice(3),
                            np.datetime64("2020-01-01"), object()])
_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(max_size=5)
            | st.sampled_from([np.float64(0.25), np.int64(-3), np.bool_(True), np.float32(1.5), torch.float16,
                               torch.Size([2, 3]), torch.device("cpu")]))
_tensors = st.sampled_from([torch.arange(6.0).reshape(2, 3), torch.ones(1).expand(5), torch.arange(10.0)[2:8:2],
                            torch.ones(2, dtype=torch.bfloat16), torch.nn.Parameter(torch.ones(2)),
                            torch.eye(3).to_sparse(), torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
                            torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), torch.empty(0)])
_values = st.recursive(_scalars | _tensors | _refused,
                       lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                       | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3),
                       max_leaves=6)


def _same(saved, loaded) -> bool:
    """Equality after normalisation (numpy scalars become python scalars; NaN equals NaN)."""
    if isinstance(saved, np.generic):
        saved = saved.item()
    if isinstance(saved, torch.Size):
        saved = tuple(saved)
    if isinstance(saved, torch.Tensor):
        if saved.is_nested or saved.is_quantized or saved.layout != torch.strided:
            saved, loaded = (saved.dequantize() if saved.is_quantized else saved), \
                (loaded.dequantize() if loaded.is_quantized else loaded)
            if saved.is_nested:
                return all(torch.equal(a, b) for a, b in zip(saved.unbind(), loaded.unbind()))
            return torch.equal(saved.to_dense(), loaded.to_dense())
        return type(loaded) is torch.Tensor and torch.equal(saved, loaded)  # saved detached: a Parameter too
    if isinstance(saved, float) and math.isnan(saved):
        return isinstance(loaded, float) and math.isnan(loaded)
    if isinstance(saved, dict):
        return type(loaded) is type(saved) and list(saved) == list(loaded) and all(
            _same(saved[k], loaded[k]) for k in saved)
    if isinstance(saved, (list, tuple)):
        return type(loaded) is type(saved) and len(saved) == len(loaded) and all(map(_same, saved, loaded))
    return type(loaded) is type(saved) and saved == loaded


@settings(max_examples=80)
@given(value=_values, blocking=st.booleans())
def test_whatever_save_accepts_loads_back_equal(tmp_path_factory, value, blocking):
    directory = tmp_path_factory.mktemp("rt")
    with AtomicCheckpointer(directory) as ckpt:
        try:
            ckpt.save(1, {"value": value}, blocking=blocking)
            ckpt.wait()
        except CheckpointError as e:
            assert any(reason in str(e) for reason in ("expected exactly tensors or plain data",
                                                       "expected str keys or int keys", "an empty bytes value",
                                                       "refuses to load with weights_only=True",
                                                       "is an expanded tensor view"))
            assert ckpt.steps() == []
            return
        loaded = ckpt.load()
    assert loaded.step == 1 and _same(value, loaded.state["value"])


@pytest.mark.parametrize("value", [Color.RED, Level.HIGH, Name("n"), torch.ones(2).as_subclass(Tagged)])
def test_subclasses_are_refused_at_save_with_the_reason(tmp_path, value):
    with AtomicCheckpointer(tmp_path) as ckpt, pytest.raises(CheckpointError) as exc:
        ckpt.save(1, {"extra": {"v": value}})
    message = str(exc.value)
    assert f"checkpoint value state['extra']['v'] is a {type(value).__module__}.{type(value).__qualname__}" in message
    assert "torch.save would pickle the subclass, and weights_only=True refuses it at load" in message
    assert "Fix: store its state_dict() or convert it to plain data (e.g. an Enum's .value" in message


def test_numpy_scalars_are_saved_as_python_scalars(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"metrics": {"loss": np.float64(0.5), "n": np.int64(3), "ok": np.bool_(True)}})
        assert ckpt.load().state["metrics"] == {"loss": 0.5, "n": 3, "ok": True}


def test_a_lower_step_is_refused_and_nothing_is_lost(tmp_path):
    with AtomicCheckpointer(tmp_path, keep_last=2) as ckpt:
        ckpt.save(1100, state_for(1100))
        with pytest.raises(CheckpointError) as exc:
            ckpt.save(10, state_for(10))
        assert str(exc.value).startswith("checkpoint step 10 is lower than the newest committed step 1100 in ")
        assert "Fix: pass the current training step" in str(exc.value)
        ckpt.save(1100, state_for(1100))  # re-saving the newest step is allowed
        ckpt.save(1200, state_for(1200))
        assert ckpt.steps() == [1100, 1200]


def test_step_numbers_of_any_size_are_visible(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(10**10, state_for(1))
        ckpt.save(2**63 - 1, state_for(2))
        assert ckpt.steps() == [10**10, 2**63 - 1] and ckpt.load().step == 2**63 - 1
        assert ckpt.load(10**10).step == 10**10
        with pytest.raises(CheckpointError, match=r"step=9223372036854775808; expected a non-negative integer"):
            ckpt.save(2**63, state_for(3))


@pytest.mark.parametrize("step", [1.9, True, "1", -1, 2**63])
def test_load_refuses_a_step_that_is_not_a_step(tmp_path, step):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state_for(1))
        with pytest.raises(CheckpointError, match=r"expected None \(the newest\), a committed step"):
            ckpt.load(step)


RESAVE = """
import os, signal, sys, torch
from robustdist.checkpoint import AtomicCheckpointer, _faults
ckpt = AtomicCheckpointer(sys.argv[1], keep_last=1)
ckpt.save(1, {"weights": torch.full((16,), 1.0)})
_faults.HOOK = lambda phase: os.kill(os.getpid(), signal.SIGKILL) if phase == "moved_aside" else None
ckpt.save(1, {"weights": torch.full((16,), 2.0)})
"""


@pytest.mark.processes
def test_a_crash_inside_a_resave_never_leaves_zero_copies(tmp_path):
    out = subprocess.run([sys.executable, "-c", RESAVE, str(tmp_path)], cwd=ROOT, capture_output=True, timeout=60)
    assert out.returncode == -9, out.stderr
    assert not (tmp_path / "step_0000000001").exists()  # the crash landed between the two renames
    with AtomicCheckpointer(tmp_path, keep_last=1) as reader:
        assert reader.steps() == [1]
        assert torch.equal(reader.load().state["weights"], torch.full((16,), 1.0))  # the committed copy
    with AtomicCheckpointer(tmp_path, keep_last=1) as writer:
        writer.save(2, {"weights": torch.full((16,), 3.0)})  # puts step 1 back first, then rotates it
        assert writer.steps() == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step_0000000002"]


WRITER = """
import sys, torch
from robustdist.checkpoint import AtomicCheckpointer
with AtomicCheckpointer(sys.argv[1], keep_last=1) as ckpt:
    for step in range(1, 400):
        ckpt.save(step, {"weights": torch.full((4096,), float(step))})
"""


@pytest.mark.processes
def test_a_reader_racing_a_rotating_writer_loads_a_committed_step_or_gets_a_retryable_error(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(0, {"weights": torch.full((4096,), 0.0)})
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE)
    outcomes = collections.Counter()
    try:
        deadline = time.monotonic() + 20
        while writer.poll() is None and time.monotonic() < deadline:
            reader = AtomicCheckpointer(tmp_path)
            try:
                loaded = reader.load()
                assert torch.equal(loaded.state["weights"], torch.full((4096,), float(loaded.step)))
                outcomes["loaded"] += 1
            except CheckpointBusyError as e:
                assert "Fix: retry the load" in str(e)
                outcomes["busy"] += 1
            finally:
                reader.close()
    finally:
        writer.kill()
        writer.wait()
        writer.stderr.close()
    assert outcomes["loaded"] > 10, outcomes  # any other exception fails the test where it happens
    print("reader outcomes:", dict(outcomes))


@pytest.mark.parametrize("make", [lambda: torch.ones(1).expand(1000), lambda: torch.arange(20.0)[::3],
                                  lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
                                  lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                                  lambda: torch.eye(3).to_sparse()],
                         ids=["expanded", "strided-view", "quantized", "nested", "sparse"])
def test_async_save_of_unusual_tensors_matches_a_blocking_save(tmp_path, make):
    with AtomicCheckpointer(tmp_path / "a", async_save=True) as a, AtomicCheckpointer(tmp_path / "b") as b:
        try:
            b.save(1, {"t": make()})
        except CheckpointError as e:  # a kind this torch cannot load back (nested on torch >= 2.15), or an
            # expanded view, which load refuses in plain data (its first use could materialise gigabytes)
            refusal = r"refuses to load with weights_only=True|is an expanded tensor view"
            assert re.search(refusal, str(e)), str(e)
            with pytest.raises(CheckpointError, match=refusal):
                a.save(1, {"t": make()})
            assert a.steps() == [] and b.steps() == []
            return
        a.save(1, {"t": make()})
        a.wait()
        left, right = a.load().state["t"], b.load().state["t"]
    assert _same(left, right)
    if left.layout == torch.strided and not left.is_nested and not left.is_quantized:
        assert left.stride() == right.stride() and left.untyped_storage().nbytes() == right.untyped_storage().nbytes()


def test_metadata_that_is_not_json_is_refused_and_nothing_committed(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"metadata is not plain JSON data"):
            ckpt.save(1, {"x": torch.zeros(1)}, metadata={"when": object()})
        assert ckpt.steps() == []
