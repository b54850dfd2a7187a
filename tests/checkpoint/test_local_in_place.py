"""The in-memory tier's restore where its files lie: each tensor copied once, straight into the live tensor it
restores, and summed as it is copied (``robustdist.checkpoint.local.mapped``, ``.sums``).

One process, one rank: the tier needs no group for that, and the protocol around it is tested with real ranks in
``test_local_tier.py``. Every restore is compared bitwise with loading the same step from the durable tier into
objects of their own.
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from robustdist.checkpoint import AtomicCheckpointer, LocalTier
from robustdist.checkpoint.local import sums
from robustdist.checkpoint.local.wire import Blob
from robustdist.checkpoint.train_state import TrainState
from robustdist.runtime.errors import CheckpointError


class Sparse:
    """A stateful object whose state holds a sparse tensor and a tensor inside a tuple."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.value = (torch.rand(3, 3, generator=g) > 0.5).float().to_sparse()
        self.pair = (torch.rand(2, generator=g), 1)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "pair": self.pair}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.pair = state["value"], state["pair"]


def _objects(seed: int, *, stepped: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if stepped:
        _train(model, opt, 2, seed)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(100 * seed + i)
        model(torch.randn(4, 64, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()]


def _saved(tmp_path: Path, *, durable_too: bool = True, extra: dict[str, Any] | None = None
           ) -> tuple[AtomicCheckpointer, LocalTier, dict[str, Any]]:
    model, opt = _objects(1)
    state = {"model": model, "optimizer": opt, **(extra or {})}
    durable = AtomicCheckpointer(tmp_path / "durable")
    if durable_too:
        durable.save(3, state)
    local = LocalTier(tmp_path / "shm", lineage="in-place")
    local.save(3, state)
    local.wait()
    return durable, local, state


def _reference(durable: AtomicCheckpointer, extra: dict[str, Any] | None = None) -> list[torch.Tensor]:
    model, opt = _objects(7)
    durable.load(state={"model": model, "optimizer": opt, **(extra or {})})
    return _tensors(model, opt)


def test_a_restore_writes_into_the_live_tensors_and_equals_the_durable_load(tmp_path):
    durable, local, _ = _saved(tmp_path)
    try:
        model, opt = _objects(5)  # other values, the same shapes: a process that trained on after the save
        before = [t.data_ptr() for t in _tensors(model, opt)]
        loaded = local.load(state={"model": model, "optimizer": opt})
        assert loaded is not None and (loaded.step, loaded.source) == (3, "memory")
        after = _tensors(model, opt)
        assert [t.data_ptr() for t in after] == before  # copied into place: no new memory, no second copy
        reference = _reference(durable)
        assert len(after) == len(reference) and all(torch.equal(a, b) for a, b in zip(after, reference))
        _train(model, opt, 1, 9)  # and it trains on as the durable load's objects do
    finally:
        local.close()
        durable.close()


def test_an_optimizer_with_no_state_yet_gets_new_tensors_of_the_same_values(tmp_path):
    durable, local, _ = _saved(tmp_path)
    try:
        model, opt = _objects(5, stepped=False)  # a replacement process: its optimizer has not stepped
        assert not opt.state
        assert local.load(state={"model": model, "optimizer": opt}) is not None
        assert all(torch.equal(a, b) for a, b in zip(_tensors(model, opt), _reference(durable)))
    finally:
        local.close()
        durable.close()


def test_tensors_this_path_does_not_copy_in_place_are_read_from_the_file(tmp_path):
    """A sparse tensor, or a tensor inside a tuple, cannot take its destination in place: that file is read and
    deserialised whole, and the restore is the same."""
    durable, local, _ = _saved(tmp_path, extra={"extra": Sparse(1)})
    try:
        model, opt = _objects(5)
        extra = Sparse(2)
        assert local.load(state={"model": model, "optimizer": opt, "extra": extra}) is not None
        want = Sparse(0)
        _reference(durable, {"extra": want})
        assert torch.equal(extra.value.to_dense(), want.value.to_dense()) and torch.equal(extra.pair[0], want.pair[0])
        assert all(torch.equal(a, b) for a, b in zip(_tensors(model, opt), _reference(durable)))
    finally:
        local.close()
        durable.close()


def _flip_in_last_tensor(copy: Path) -> None:
    """Flip a byte of the last data record of replicated.pt (the tensors before it are copied into place first)."""
    path = copy / "replicated.pt"
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        record = max((m for m in z.infolist() if "/data/" in m.filename and m.file_size > 1024),
                     key=lambda m: m.header_offset)
    name_len, extra_len = struct.unpack_from("<HH", data, record.header_offset + 26)
    data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["step_0000000003", ".old-step_0000000003-0123456789ab"])
def test_a_copy_damaged_mid_tensor_with_no_durable_checkpoint_is_a_named_error_and_is_removed(tmp_path, name):
    """The damage is found while the tensors are being copied into place: the live objects already hold part of
    the step. With no other source, starting from scratch would train from that mix: a named error instead, and the
    damaged copy is gone, so the restart starts clean (also where a crashed re-save left it set aside, which a
    later save would otherwise put back)."""
    durable, local, _ = _saved(tmp_path, durable_too=False)
    copy = Path(local.directory, "owner_00000", "own", name)
    Path(local.directory, "owner_00000", "own", "step_0000000003").rename(copy)
    _flip_in_last_tensor(copy)
    model, opt = _objects(5)
    state = TrainState(model=model, optimizer=opt)
    try:
        with pytest.warns(Warning, match="checksum differs from its meta.json"):
            with pytest.raises(CheckpointError) as raised:
                state.load(durable, local=local, missing_ok=True)
        text = str(raised.value)
        assert "restore wrote into the live objects and then failed" in text, text
        assert "checksum differs from its meta.json" in text and "Fix: restart the job" in text, text
        assert not copy.exists()
        assert state.load(durable, local=local, missing_ok=True) is None  # nothing left: from scratch, no error
    finally:
        local.close()
        durable.close()


def test_a_restore_failing_after_the_live_tensors_were_written_is_never_a_fresh_start(tmp_path, monkeypatch):
    """The optimizer's own load fails after the tensors went into place (say, memory short on its device): with no
    durable checkpoint the load is an error naming that failure, not a fresh start from half-restored objects."""
    durable, local, _ = _saved(tmp_path, durable_too=False)
    model, opt = _objects(5)

    def refuse(self: Any, state_dict: Any) -> None:
        raise RuntimeError("out of memory on the optimizer's device")

    monkeypatch.setattr(torch.optim.Adam, "load_state_dict", refuse)
    try:
        with pytest.warns(Warning, match="could not be restored"):
            with pytest.raises(CheckpointError, match="out of memory on the optimizer's device"):
                TrainState(model=model, optimizer=opt).load(durable, local=local, missing_ok=True)
        assert Path(local.directory, "owner_00000", "own", "step_0000000003").is_dir()  # not damaged: kept
    finally:
        local.close()
        durable.close()


def test_a_copy_damaged_mid_tensor_falls_back_to_the_durable_tier_bitwise(tmp_path):
    durable, local, _ = _saved(tmp_path)
    _flip_in_last_tensor(Path(local.directory, "owner_00000", "own", "step_0000000003"))
    model, opt = _objects(5)
    try:
        with pytest.warns(Warning, match="checksum differs from its meta.json"):
            loaded = TrainState(model=model, optimizer=opt).load(durable, local=local)
        assert loaded is not None and (loaded.step, loaded.source) == (3, "durable")
        assert all(torch.equal(a, b) for a, b in zip(_tensors(model, opt), _reference(durable)))
    finally:
        local.close()
        durable.close()


def test_a_live_tensor_changing_under_the_copy_removes_no_good_copy(tmp_path, monkeypatch):
    """The sum is taken on the destination: when it disagrees but the file itself agrees with its meta.json, what
    was written into did not hold still (another thread). The copy is not called damaged nor removed; the durable
    tier restores."""
    from robustdist.checkpoint.local import mapped

    durable, local, _ = _saved(tmp_path)
    copy = Path(local.directory, "owner_00000", "own", "step_0000000003")
    real, real_fill_live = sums.copy_summed, mapped.Mapped.fill_live
    into_live = []

    def disturbed(dst: torch.Tensor, src: torch.Tensor, pos: int, digest: sums.Digest) -> None:
        if not into_live:
            return real(dst, src, pos, digest)
        real(dst, src, pos, sums.Digest())  # a live tensor: copied, then changed before it is summed
        dst[0] ^= 0xFF
        digest.add(dst.numpy(), pos)

    def fill_live(self: Any, live: Any) -> None:
        into_live.append(True)
        try:
            real_fill_live(self, live)
        finally:
            into_live.clear()

    model, opt = _objects(5)
    monkeypatch.setattr(mapped.sums, "copy_summed", disturbed)
    monkeypatch.setattr(mapped.Mapped, "fill_live", fill_live)
    try:
        with pytest.warns(Warning, match="the live tensors changed while the copy was written into them"):
            loaded = TrainState(model=model, optimizer=opt).load(durable, local=local)
        assert loaded is not None and loaded.source == "durable"
        assert copy.is_dir()
    finally:
        local.close()
        durable.close()


def test_memory_short_while_copying_is_not_called_damage(tmp_path, monkeypatch):
    """New memory refused half-way through a file's tensors (an optimizer with no state yet: they all need new
    memory): the restore fails and the durable tier restores, the copy is neither called damaged nor removed."""
    from robustdist.checkpoint.local import mapped

    durable, local, _ = _saved(tmp_path)
    copy = Path(local.directory, "owner_00000", "own", "step_0000000003")
    real_empty, calls = torch.empty, []

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        return real_empty(*args, **kwargs)

    model, opt = _objects(5, stepped=False)
    monkeypatch.setattr(mapped.torch, "empty", empty)
    try:
        with pytest.warns(Warning) as seen:
            loaded = TrainState(model=model, optimizer=opt).load(durable, local=local)
        text = " ".join(str(w.message) for w in seen)
        assert "not enough memory" in text and "checksum differs" not in text, text
        assert loaded is not None and loaded.source == "durable" and copy.is_dir()
    finally:
        local.close()
        durable.close()


def test_the_records_of_a_copy_must_be_its_tensors_one_to_one(tmp_path):
    """A data record no tensor uses (added by someone who knows the format, meta.json agreeing) is not a file this
    tier wrote: the copy is refused, the durable tier used."""
    durable, local, _ = _saved(tmp_path)
    copy = Path(local.directory, "owner_00000", "own", "step_0000000003")
    path = copy / "replicated.pt"
    with zipfile.ZipFile(path, "a") as z:
        prefix = z.namelist()[0].split("/")[0]
        z.writestr(f"{prefix}/data/999", b"\0" * 4096)
    data = path.read_bytes()
    meta = json.loads((copy / "meta.json").read_text())
    meta["files"]["replicated.pt"] = {"size": len(data), "sum": f"{sums.of(data):016x}"}
    (copy / "meta.json").write_text(json.dumps(meta))
    model, opt = _objects(5)
    try:
        with pytest.warns(Warning, match="not its data records one to one"):
            loaded = TrainState(model=model, optimizer=opt).load(durable, local=local)
        assert loaded is not None and loaded.source == "durable"
    finally:
        local.close()
        durable.close()


def test_a_restored_checkpoint_keeps_no_part_of_the_file_mapped(tmp_path):
    """Every tensor of a mapped file is given memory of its own, the empty ones too (a view of no bytes would keep
    the whole mapping, so the file's memory, alive after the tier rotated it away)."""
    model, opt = _objects(1)
    model.register_buffer("nothing", torch.empty(0, 3))
    state = {"model": model, "optimizer": opt}
    local = LocalTier(tmp_path / "shm", lineage="in-place")
    local.save(3, state)
    local.wait()
    try:
        other, other_opt = _objects(5)
        other.register_buffer("nothing", torch.empty(0, 3))
        loaded = local.load(state={"model": other, "optimizer": other_opt})
        assert loaded is not None and loaded.source == "memory"
        mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if local.directory in line]
        assert not mapped, mapped
        assert loaded.state["model"]["nothing"].shape == (0, 3)
    finally:
        local.close()


# ---------------------------------------------------------------------- the checksum
def test_the_sum_of_a_file_is_the_sum_of_its_parts_wherever_they_are_cut():
    data = os.urandom(3 * sums.BLOCK + 13)
    whole = sums.of(data)
    rng = random.Random(0)
    for _ in range(30):
        cuts = [0, *sorted(rng.sample(range(1, len(data)), 6)), len(data)]
        digest = sums.Digest()
        for a, b in rng.sample(list(zip(cuts, cuts[1:])), len(cuts) - 1):  # in any order
            digest.add(data[a:b], a)
        assert digest.value() == whole
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    digest = sums.Digest().add(data[:5])
    sums.copy_summed(dst[5:], src[5:], 5, digest)
    assert digest.value() == whole and torch.equal(dst[5:], src[5:])


def _flip(data: bytearray, byte: int, bit: int) -> None:
    data[byte] ^= 1 << bit


@pytest.mark.parametrize("change", ["bit", "last_byte", "block_moved", "row_moved", "truncated", "zero_word",
                                    "two_top_bits", "opposite_flips_one_block", "two_words_one_row",
                                    "two_words_one_column", "top_bit_on_the_diagonal", "word_changed_by_the_prime"])
def test_the_sum_changes_with_the_damage_a_copy_meets(change):
    """Every change of one word, and of two words of one block whatever their bits (a float's sign bit in two
    places, the same bit flipped one way in one word and the other way in another), changes the sum."""
    rng = random.Random(change)
    data = bytearray(os.urandom(4 * sums.BLOCK))
    whole = sums.of(data)
    row = 4096
    if change == "bit":
        _flip(data, sums.BLOCK + 12345, 4)
    elif change == "last_byte":
        _flip(data, len(data) - 1, 7)
    elif change == "block_moved":
        data[:sums.BLOCK], data[sums.BLOCK:2 * sums.BLOCK] = data[sums.BLOCK:2 * sums.BLOCK], data[:sums.BLOCK]
    elif change == "row_moved":  # a 4 KiB page swapped with another of the same block
        data[:row], data[5 * row:6 * row] = data[5 * row:6 * row], data[:row]
    elif change == "truncated":
        data = data[:-8]
    elif change == "zero_word":
        data[8:16] = bytes(8)
    elif change == "two_top_bits":  # bit 63 of two words, far apart
        _flip(data, 7, 7)
        _flip(data, 2 * sums.BLOCK + 12345 * 8 + 7, 7)
    elif change == "opposite_flips_one_block":
        for _ in range(20):  # a bit set in one word and cleared in another, same position, same block
            a, b = rng.randrange(0, sums.BLOCK, 8), rng.randrange(0, sums.BLOCK, 8)
            byte, bit = rng.randrange(8), rng.randrange(8)
            if a != b and (data[a + byte] >> bit & 1) != (data[b + byte] >> bit & 1):
                break
        _flip(data, a + byte, bit)
        _flip(data, b + byte, bit)
    elif change == "two_words_one_row":
        _flip(data, 16, 3)
        _flip(data, 24, 3)
    elif change == "two_words_one_column":
        _flip(data, 8 + 3, 5)
        _flip(data, 8 + 7 * row + 3, 5)
    elif change == "top_bit_on_the_diagonal":  # row r, word r: where sums that wrap at 2**64 cancel modulo the prime
        for r in range(0, 256, 17):
            flipped = bytearray(data)
            _flip(flipped, r * row + r * 8 + 7, 7)
            assert sums.of(flipped) != whole, r
        _flip(data, 7, 7)
    elif change == "word_changed_by_the_prime":
        value = int.from_bytes(data[:8], "little")
        data[:8] = ((value + (1 << 61) - 1) % (1 << 64)).to_bytes(8, "little")
    assert sums.of(data) != whole


def test_a_blob_carries_the_sum_a_header_can_hold():
    data = bytearray(os.urandom(100_000))
    blob = Blob.of(data)
    assert blob.checksum == sums.of(data) and 0 <= blob.checksum < 1 << 63
