"""A hostile or broken in-memory tier directory never runs code, reads outside itself, hangs or crashes a load.

``/dev/shm`` is shared by every process on a node, and a stale tier survives a job: the tier's directory is
input like a durable checkpoint directory. Each case below damages the newest in-memory copy (step 8) in one
way; the load must skip it, with a warning naming the copy, and fall back to the durable tier (step 4), with
the live objects restored exactly as a plain durable load restores them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from robustdist.checkpoint import AtomicCheckpointer, LocalTier
from robustdist.checkpoint.local import sums
from robustdist.checkpoint.local.layout import tier_root
from robustdist.checkpoint.train_state import TrainState
from tests._memory import peak_growth

pytestmark = pytest.mark.timeout(60)
MARKER = "robustdist-local-tier-pwned"


class _RunsCode:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    return TrainState(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _step(state: TrainState) -> None:
    state.model(torch.randn(4, 8)).sum().backward()
    assert state.optimizer is not None
    state.optimizer.step()
    state.optimizer.zero_grad()


def _saved(durable_dir: Path, local_dir: Path, lineage: str) -> tuple[AtomicCheckpointer, LocalTier]:
    """8 steps of one run: a durable save of step 4, an in-memory save of step 8 (committed)."""
    state = _state(0)
    durable = AtomicCheckpointer(durable_dir)
    local = LocalTier(local_dir, lineage=lineage)
    for step in range(1, 9):
        _step(state)
        if step == 4:
            state.save(durable, step)
        if step == 8:
            state.save_local(local, step)
            local.wait()
    return durable, local


@pytest.fixture
def tiers(tmp_path):
    """A durable step 4 and an in-memory step 8 of the same run; the durable load's result for reference."""
    durable, local = _saved(tmp_path / "durable", tmp_path / "shm", "hostile")
    reference = _state(1)
    reference.load(durable)
    copy = Path(local.directory, "owner_00000", "own", "step_0000000008")
    assert copy.is_dir()
    yield durable, local, copy, reference, tmp_path
    local.close()
    durable.close()


def _rewrite(copy: Path, name: str, data: bytes) -> None:
    """Replace one file and make meta.json agree with it (a forger who knows the format)."""
    (copy / name).write_bytes(data)
    meta = json.loads((copy / "meta.json").read_text())
    meta["files"][name] = {"size": len(data), "sum": f"{sums.of(data):016x}"}
    (copy / "meta.json").write_text(json.dumps(meta))


def _torch_file(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _zip_bomb() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("archive/data/0", b"\0" * (64 << 20))
    return buf.getvalue()


def _sparse_torch_file(path: Path, tmp: Path) -> None:
    """``path`` becomes a valid torch file holding 256 MiB of zeros, each zero 1 MiB a hole, and its copy's
    ``meta.json`` records its size and checksum: everything checks out but the memory its size asks for."""
    dense = tmp / "dense.pt"
    torch.save({"copy": {}, "value": {"model": torch.zeros(64 << 20)}}, dense)
    digest, size = sums.Digest(), dense.stat().st_size
    with open(dense, "rb") as src, open(path, "wb") as out:
        at = 0
        while chunk := src.read(1 << 20):
            digest.add(chunk, at)
            if chunk.count(0) == len(chunk):
                out.seek(len(chunk), os.SEEK_CUR)
            else:
                out.write(chunk)
            at += len(chunk)
        out.truncate(size)
    dense.unlink()
    meta = json.loads((path.parent / "meta.json").read_text())
    meta["files"][path.name] = {"size": size, "sum": f"{digest.value():016x}"}
    (path.parent / "meta.json").write_text(json.dumps(meta))


def _damage(kind: str, copy: Path, tmp: Path) -> None:
    payload = copy / "payload.pt"
    if kind == "code":
        _rewrite(copy, "payload.pt", _torch_file({"mine": _RunsCode(str(tmp / MARKER)), "shards": {}}))
    elif kind == "code_replicated":
        _rewrite(copy, "replicated.pt", _torch_file({"model": _RunsCode(str(tmp / MARKER))}))
    elif kind == "flipped":
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
    elif kind == "flipped_tensor":  # inside a tensor's record, which has no zip CRC-32 of its own (not written)
        replicated = copy / "replicated.pt"
        data = bytearray(replicated.read_bytes())
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
            record = next(m for m in z.infolist() if "/data/" in m.filename and m.file_size)
            assert record.CRC == 0  # robustdist writes none: the blob's own checksum must catch this
        name_len, extra_len = struct.unpack_from("<HH", data, record.header_offset + 26)
        data[record.header_offset + 30 + name_len + extra_len] ^= 0x01
        replicated.write_bytes(bytes(data))
    elif kind == "truncated":
        payload.write_bytes(payload.read_bytes()[:100])
    elif kind == "symlink_file":
        payload.unlink()
        payload.symlink_to("/etc/passwd")
    elif kind == "fifo":
        payload.unlink()
        os.mkfifo(payload)
    elif kind == "symlink_step":
        outside = tmp / "outside"
        shutil.copytree(copy, outside)
        shutil.rmtree(copy)
        copy.symlink_to(outside)
    elif kind == "symlink_owner":
        owner = copy.parent.parent
        outside = tmp / "outside-owner"
        shutil.move(str(owner), outside)
        owner.symlink_to(outside)
    elif kind == "meta_huge":
        (copy / "meta.json").write_text(" " * (2 << 20) + "{}")
    elif kind == "meta_escape":
        meta = json.loads((copy / "meta.json").read_text())
        meta["files"]["../../../etc/passwd"] = {"size": 10, "sum": "0" * 16}
        (copy / "meta.json").write_text(json.dumps(meta))
    elif kind == "meta_types":
        meta = json.loads((copy / "meta.json").read_text())
        meta["world_size"], meta["kinds"] = "1", {"model": "exec"}
        (copy / "meta.json").write_text(json.dumps(meta))
    elif kind == "meta_other_step":
        meta = json.loads((copy / "meta.json").read_text())
        meta["step"] = 9
        (copy / "meta.json").write_text(json.dumps(meta))
    elif kind == "zip_bomb":
        _rewrite(copy, "payload.pt", _zip_bomb())
    elif kind == "wrong_shape":
        _rewrite(copy, "payload.pt", _torch_file([1, 2, 3]))
    elif kind == "optimizer_mismatch":  # well-formed, CRC-valid, bound to this copy, but not this optimizer's state
        saved = torch.load(copy / "replicated.pt", weights_only=True)
        saved["value"]["optimizer"]["param_groups"][0]["params"] = [0]
        _rewrite(copy, "replicated.pt", _torch_file(saved))
    elif kind in ("sparse", "sparse_sum"):  # 2 GiB that take no disk, meta.json agreeing on the size (and sum)
        size = 2 << 30
        with open(payload, "r+b") as fh:
            fh.truncate(0)
            fh.truncate(size)
        meta = json.loads((copy / "meta.json").read_text())
        meta["files"]["payload.pt"] = {"size": size, "sum": "0" * 16 if kind == "sparse_sum" else "1" * 16}
        (copy / "meta.json").write_text(json.dumps(meta))
    elif kind == "sparse_zip":  # a real torch file of 256 MiB of zeros, written with holes, meta.json agreeing
        _sparse_torch_file(copy / "replicated.pt", tmp)
    elif kind == "sparse_beyond_ram":
        size = 1 << 42  # 4 TiB, more than any node's RAM: refused before a byte is read
        with open(payload, "r+b") as fh:
            fh.truncate(size)
        meta = json.loads((copy / "meta.json").read_text())
        meta["files"]["payload.pt"] = {"size": size, "sum": "0" * 16}
        (copy / "meta.json").write_text(json.dumps(meta))
    elif kind == "other_model":  # bound to this copy (a forger who knows the format)
        saved = torch.load(copy / "replicated.pt", weights_only=True)
        saved["value"] = {"model": {"0.weight": torch.zeros(3, 3)}, "optimizer": {}}
        _rewrite(copy, "replicated.pt", _torch_file(saved))
    elif kind == "older_format":  # a copy an older robustdist wrote (its files bound to nothing)
        meta = json.loads((copy / "meta.json").read_text())
        meta["format"] = 1
        (copy / "meta.json").write_text(json.dumps(meta))
    elif kind == "unbound":  # what the copy's files held, without the binding to their copy
        for name in ("payload.pt", "replicated.pt"):
            _rewrite(copy, name, _torch_file(torch.load(copy / name, weights_only=True)["value"]))
    else:
        raise AssertionError(kind)


KINDS = ["code", "code_replicated", "flipped", "flipped_tensor", "truncated", "symlink_file", "fifo", "symlink_step",
         "symlink_owner",
         "meta_huge", "meta_escape", "meta_types", "meta_other_step", "zip_bomb", "wrong_shape", "other_model",
         "optimizer_mismatch", "sparse", "sparse_sum", "sparse_zip", "sparse_beyond_ram", "unbound", "older_format"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_copy_falls_back_to_the_durable_tier(tiers, kind):
    durable, local, copy, reference, tmp = tiers
    _damage(kind, copy, tmp)
    state = _state(2)
    with pytest.warns(Warning) as seen:
        loaded = state.load(durable, local=local)
    assert loaded is not None and (loaded.step, loaded.source) == (4, "durable")
    assert not (tmp / MARKER).exists(), "a crafted copy ran code"
    for a, b in zip(state.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)
    assert state.optimizer is not None and reference.optimizer is not None
    assert str(state.optimizer.state_dict()) == str(reference.optimizer.state_dict())
    text = " ".join(str(w.message) for w in seen)
    assert "in-memory checkpoint" in text, text
    if kind == "sparse_beyond_ram":
        assert "more than the RAM available" in text and "refused without reading it" in text
    if kind == "older_format":
        assert "a copy in format 1 (an older robustdist's), not 3: ignored" in text, text


@pytest.mark.parametrize("kind", ["sparse", "sparse_sum", "sparse_zip"])
def test_a_sparse_copy_claiming_gigabytes_costs_no_gigabytes(tiers, kind):
    """The copy is checked from its file before the memory for it is taken (the peak resident size measured from
    a reset high-water mark, so a 2 GiB buffer would show whatever the worker did before)."""
    durable, local, copy, _, tmp = tiers
    _damage(kind, copy, tmp)
    found = {}

    def load() -> None:
        with pytest.warns(Warning) as seen:
            found["loaded"] = _state(2).load(durable, local=local)
        found["seen"] = seen

    grew = peak_growth(load)
    loaded, seen = found["loaded"], found["seen"]
    assert loaded is not None and loaded.source == "durable"
    assert grew < 128 << 20, f"peak memory grew by {grew >> 20} MiB for a sparse file"
    text = " ".join(str(w.message) for w in seen)
    assert ("a sparse file" if kind == "sparse_zip" else "not a torch zip file") in text, text


def test_an_older_step_copied_over_the_newest_is_not_restored_as_the_newest(tmp_path):
    """Step 6's copy put where step 8's was, its meta.json edited to say step 8 (every CRC still right: the files
    are step 6's own): the files are bound to step 6, so the copy is refused, naming what it is bound to, and the
    load takes the next source, step 6's own copy, as step 6."""
    state, durable = _state(0), AtomicCheckpointer(tmp_path / "durable")
    local = LocalTier(tmp_path / "shm", lineage="mixed", keep_last=2)
    weights = {}
    try:
        for step in range(1, 9):
            _step(state)
            if step in (6, 8):
                state.save_local(local, step)
                local.wait()
                weights[step] = [p.detach().clone() for p in state.model.parameters()]
        own = Path(local.directory, "owner_00000", "own")
        shutil.rmtree(own / "step_0000000008")
        shutil.copytree(own / "step_0000000006", own / "step_0000000008")
        meta = json.loads((own / "step_0000000008" / "meta.json").read_text())
        meta["step"] = 8
        (own / "step_0000000008" / "meta.json").write_text(json.dumps(meta))
        fresh = _state(1)
        with pytest.warns(Warning) as seen:
            loaded = fresh.load(durable, local=local)
        assert loaded is not None and (loaded.step, loaded.source) == (6, "memory")
        assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), weights[6]))
        text = " ".join(str(w.message) for w in seen)
        assert "its data is bound to {'file': 'replicated.pt', 'step': '6'," in text, text
        assert "expected replicated.pt of rank 0's step 8" in text and "not a source" in text, text
    finally:
        local.close()
        durable.close()


def test_the_undamaged_copy_is_used(tiers):
    durable, local, _, _, _ = tiers
    loaded = _state(2).load(durable, local=local)
    assert loaded is not None and (loaded.step, loaded.source) == (8, "memory")


def test_a_hostile_lineage_file_is_replaced_not_trusted(tmp_path):
    from robustdist.checkpoint.local.tier import LINEAGE, lineage_of
    from robustdist.runtime.dist import Collectives

    single = Collectives(None, 0, 1, timeout=10, arrival_timeout=10)
    (tmp_path / LINEAGE).symlink_to("/etc/passwd")
    token = lineage_of(str(tmp_path), 0, single)  # the read refuses the link; nothing is read through it
    assert len(token) == 32 and not (tmp_path / LINEAGE).is_symlink()
    assert lineage_of(str(tmp_path), 0, single) == token  # kept from then on
    (tmp_path / LINEAGE).unlink()
    os.mkfifo(tmp_path / LINEAGE)
    assert lineage_of(str(tmp_path), 0, single) != token


@pytest.mark.parametrize("planted", ["symlink", "other_owner", "world_writable"])
def test_a_directory_planted_at_the_tier_path_is_refused(tmp_path, planted):
    """``/dev/shm`` is shared: another user could make the tier's directory first, or plant a link there."""
    from robustdist.runtime.errors import CheckpointError

    path = Path(tier_root(str(tmp_path / "shm"), "x"))
    path.parent.mkdir()
    if planted == "symlink":
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir()
        if planted == "other_owner":
            os.chown(path, 12345, 12345)
        else:
            path.chmod(0o777)
    with pytest.raises(CheckpointError, match="expected a directory of this user's"):
        LocalTier(tmp_path / "shm", lineage="x")
    assert not list(tmp_path.rglob("step_*"))


@pytest.mark.parametrize("level", ["owner_00000", "owner_00000/own"])
def test_a_link_planted_inside_the_tier_is_never_written_through(tmp_path, level):
    local = LocalTier(tmp_path / "shm", lineage="x")
    outside = tmp_path / "outside"
    (outside / "own").mkdir(parents=True)
    Path(local.directory, level).parent.mkdir(parents=True, exist_ok=True)
    Path(local.directory, level).symlink_to(outside if level == "owner_00000" else outside / "own")
    state = _state(0)
    from robustdist.runtime.errors import CheckpointError

    state.save_local(local, 1)
    with pytest.raises(CheckpointError, match=f"{level}: is a symbolic link; expected a directory"):
        local.wait()
    assert [p.name for p in outside.rglob("*")] == ["own"]
    local.close(clean=True)
    assert not Path(local.directory).exists()
    assert (outside / "own").is_dir()  # close removed the tier: the link, never what it points at


def _outside_files(tmp_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (tmp_path / "outside").rglob("*") if p.is_file()}


def _link_planted_at(tmp_path: Path, name: str) -> tuple[LocalTier, Path, Path]:
    """A tier whose rank 0 own copies hold, at ``name``, a link to a directory outside with a precious file."""
    local = LocalTier(tmp_path / "shm", lineage="x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "payload.pt").write_bytes(b"precious")
    own = Path(local.directory, "owner_00000", "own")
    own.mkdir(parents=True)
    (own / name).symlink_to(outside)
    return local, own, outside


def test_a_link_planted_at_a_step_is_replaced_and_deleted_as_a_link(tmp_path):
    """A re-save of a step sets the existing copy aside and deletes it: a link planted there is renamed and
    deleted as a link; nothing it points at is written or deleted."""
    local, own, outside = _link_planted_at(tmp_path, "step_0000000001")
    state = _state(0)
    state.save_local(local, 1)
    local.wait()
    assert (own / "step_0000000001").is_dir() and not (own / "step_0000000001").is_symlink()
    assert _outside_files(tmp_path) == {"payload.pt": b"precious"}
    local.close(clean=True)
    assert not Path(local.directory).exists()
    assert _outside_files(tmp_path) == {"payload.pt": b"precious"}


def test_a_link_planted_under_a_set_aside_name_is_never_followed(tmp_path):
    """A link under the name a crashed re-save leaves (``.old-step_N-<token>``, with no ``step_N``) is not put back
    by the next save (only a real directory is) but deleted as a link, and is no source at load."""
    local, own, outside = _link_planted_at(tmp_path, ".old-step_0000000001-0123456789ab")
    state = _state(0)
    state.save_local(local, 2)
    local.wait()
    assert sorted(p.name for p in own.iterdir()) == ["step_0000000002"]
    assert _outside_files(tmp_path) == {"payload.pt": b"precious"}
    (own / "step_0000000002").rename(own / ".old-step_0000000002-0123456789ab")  # a crash inside its re-save
    (own / ".old-step_0000000003-0123456789ab").symlink_to(outside)
    with pytest.warns(Warning, match="step_0000000003-0123456789ab: not a real directory"):
        loaded = local.load(state=_state(1).entries(loading=True))
    assert loaded is not None and loaded.step == 2  # the set-aside real copy is a source; the link is not
    local.close(clean=True)
    assert not Path(local.directory).exists()
    assert _outside_files(tmp_path) == {"payload.pt": b"precious"}


@pytest.mark.parametrize("planted", ["another_spelling", "two_set_aside"])
def test_a_set_aside_copy_that_is_not_unambiguously_its_step_is_not_put_back(tmp_path, planted):
    """Only the one copy set aside for a step, under the step's own spelling, is put back: a copy under another
    spelling of the step (which would become a second directory of it) or one of two set aside for the same step
    (which one is newer?) is deleted as a leftover by the next save."""
    local = LocalTier(tmp_path / "shm", lineage="x", keep_last=2)
    own = Path(local.directory, "owner_00000", "own")
    state = _state(0)
    state.save_local(local, 1)
    local.wait()
    if planted == "another_spelling":
        shutil.copytree(own / "step_0000000001", own / ".old-step_00000000001-0123456789ab")
    else:
        shutil.copytree(own / "step_0000000001", own / ".old-step_0000000001-0123456789ab")
        (own / "step_0000000001").rename(own / ".old-step_0000000001-abcdef012345")
    _step(state)
    state.save_local(local, 2)
    local.wait()
    kept = ["step_0000000001"] if planted == "another_spelling" else []  # the copy under its own name stays
    assert sorted(p.name for p in own.iterdir()) == [*kept, "step_0000000002"]
    local.close(clean=True)


@pytest.mark.parametrize("where", ["inside_a_rotated_step", "leftover_staging", "inside_the_tier"])
def test_rotation_cleanup_and_close_delete_links_never_their_targets(tmp_path, where):
    local = LocalTier(tmp_path / "shm", lineage="x")
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "keep.bin").write_bytes(b"precious")
    own = Path(local.directory, "owner_00000", "own")
    state = _state(0)
    state.save_local(local, 1)
    local.wait()
    planted = {"inside_a_rotated_step": own / "step_0000000001" / "extra",
               "leftover_staging": own / ".tmp-step_0000000002-0123456789ab" / "x" / "extra",
               "inside_the_tier": Path(local.directory, "extra")}[where]
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(outside / "deep")
    state.save_local(local, 2)  # removes the leftover staging, then rotates step 1 out
    local.wait()
    assert sorted(p.name for p in own.iterdir()) == ["step_0000000002"]
    assert _outside_files(tmp_path) == {"keep.bin": b"precious"}
    local.close(clean=True)
    assert not Path(local.directory).exists()
    assert _outside_files(tmp_path) == {"keep.bin": b"precious"}


def test_a_staging_directory_swapped_for_a_link_mid_write_is_not_written_through(tmp_path, monkeypatch):
    """Someone who can write the tier's directory swaps the staging directory for a link to elsewhere between the
    copy's files and its meta: the meta still goes into the directory robustdist made (reached by descriptor,
    not by path), nothing is written outside, and the link that took the step's name is refused at load."""
    from robustdist.checkpoint import _faults

    local = LocalTier(tmp_path / "shm", lineage="x")
    outside = tmp_path / "outside"
    outside.mkdir()
    own = Path(local.directory, "owner_00000", "own")

    def swap(phase: str) -> None:
        if phase == "local_writing":
            (staging,) = own.glob(".tmp-step_*")
            staging.rename(tmp_path / "moved")
            staging.symlink_to(outside)

    monkeypatch.setattr(_faults, "HOOK", swap)
    state = _state(0)
    state.save_local(local, 1)
    local.wait()
    monkeypatch.setattr(_faults, "HOOK", None)
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == ["meta.json", "payload.pt", "replicated.pt"]
    assert (own / "step_0000000001").is_symlink()
    with pytest.warns(Warning, match="step_0000000001: not a real directory"):
        assert local.load(state=_state(1).entries(loading=True)) is None  # the link at the step's name is no copy
    local.close(clean=True)
    assert list(outside.iterdir()) == [] and not Path(local.directory).exists()


@pytest.mark.parametrize("level", ["owner", "role"])
def test_a_directory_swapped_for_a_link_after_the_scan_is_not_read_through(tiers, monkeypatch, level):
    """The copies are found by a scan, checked, then read: an owner or role directory moved out of the tier and
    replaced by a link just before the read is refused at the read (each level is opened from the tier's root without
    following links), and the load falls back to the durable tier, the moved copy unread."""
    from robustdist.checkpoint.local import layout, restore

    durable, local, copy, reference, tmp = tiers
    moved = copy.parent.parent if level == "owner" else copy.parent
    outside = tmp / "outside"
    real_read, real_map = layout.read_verified, restore._mapped.load

    def swap() -> None:  # after every check by path, just before the read
        if moved.is_dir() and not moved.is_symlink():
            moved.rename(outside)
            moved.symlink_to(outside, target_is_directory=True)

    monkeypatch.setattr(restore.layout, "read_verified", lambda *a: (swap(), real_read(*a))[1])
    monkeypatch.setattr(restore._mapped, "load", lambda *a: (swap(), real_map(*a))[1])
    state = _state(2)
    with pytest.warns(Warning) as seen:
        loaded = state.load(durable, local=local)
    assert loaded is not None and (loaded.step, loaded.source) == (4, "durable")
    text = " ".join(str(w.message) for w in seen)
    assert "is a symbolic link; refused" in text, text


@pytest.mark.parametrize("kind", ["code", "flipped", "symlink_step"])
def test_a_copy_held_in_process_memory_never_lets_a_damaged_directory_through(tiers, kind):
    """An in-process recovery's next tier restores this rank's own copy from memory: a crafted payload file is then
    never read (no code runs), but the copy must still be listed as a valid one (a step swapped for a link is not,
    and the durable tier decides); the memory copy is used once, so the next tier meets the damaged file itself."""
    durable, local, copy, reference, tmp = tiers
    local.carry = True
    local.close()
    _damage(kind, copy, tmp)
    again = LocalTier(tmp / "shm", lineage="hostile")
    try:
        state = _state(2)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loaded = state.load(durable, local=again)
        assert not (tmp / MARKER).exists(), "a crafted copy ran code"
        if kind == "symlink_step":  # not listed as a copy: the memory copy is not used either
            assert loaded is not None and (loaded.step, loaded.source, loaded.from_process) == (4, "durable", False)
            assert "in-memory checkpoint" in " ".join(str(w.message) for w in seen)
            return
        assert loaded is not None and (loaded.step, loaded.source, loaded.from_process) == (8, "memory", True)
        assert not [w for w in seen if "unusable" in str(w.message)], [str(w.message) for w in seen]
    finally:
        again.carry = True
        again.close()
    third = LocalTier(tmp / "shm", lineage="hostile")
    try:
        with pytest.warns(Warning):
            later = _state(3).load(durable, local=third)
        assert later is not None and (later.step, later.source) == (4, "durable")
        assert not (tmp / MARKER).exists(), "a crafted copy ran code"
    finally:
        third.close()


def test_a_save_refused_by_a_planted_link_during_a_recovery_keeps_nothing_alive(tmp_path):
    """A link planted at the tier's own directory fails the background part; while an in-process recovery has
    interrupted the waits, the error that names it is raised and the tier, with its snapshot buffers, goes with
    its last reference: no reference cycle (the error's frames) keeps it for a garbage collection, and nothing
    was written through the link."""
    import gc
    import weakref

    from robustdist.runtime import dist as _dist
    from robustdist.runtime.errors import CheckpointError

    local = LocalTier(tmp_path / "shm", lineage="x")
    outside = tmp_path / "outside"
    outside.mkdir()
    Path(local.directory, "owner_00000").parent.mkdir(parents=True, exist_ok=True)
    Path(local.directory, "owner_00000").symlink_to(outside)
    info = _state(0).save_local(local, 1)
    assert info is not None and info.done.wait(30)
    gc.collect()
    gc.disable()
    _dist.interrupt_waits("a fault in a test's recovery generation")
    try:
        try:
            local.close()
            raised = ""
        except CheckpointError as e:
            raised = str(e)
        ref = weakref.ref(local)
        del local
        assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
    finally:
        _dist.resume_waits()
        gc.enable()
    assert "owner_00000: is a symbolic link; expected a directory" in raised, raised
    assert list(outside.iterdir()) == []


def _replica_flipped(rank: int, root: str) -> tuple[dict[str, bool], int, str, bool, str]:
    """2 ranks on 2 nodes: every copy's meta.json records the checksum of the bytes it holds (the replica's is the
    one checked on arrival, not recomputed); then rank 1's own copy is gone and a byte of its replica on node 0 is
    flipped: the load must refuse that replica and fall back to the durable tier."""
    import torch.distributed as dist

    durable, local = _saved(Path(root) / "durable", Path(root) / f"node{rank}", "replica-sum")
    honest = {}
    for meta in Path(local.directory).glob("owner_*/*/step_*/meta.json"):
        files = json.loads(meta.read_text())["files"]
        honest[str(meta.relative_to(local.directory))] = all(
            f"{sums.of((meta.parent / name).read_bytes()):016x}" == entry["sum"] for name, entry in files.items())
    dist.barrier()
    if rank == 1:
        shutil.rmtree(Path(local.directory, "owner_00001", "own"))
    else:
        payload = Path(local.directory, "owner_00001", "replica", "step_0000000008", "payload.pt")
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
    dist.barrier()
    fresh = _state(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = fresh.load(durable, local=local)
    reference = _state(2)
    reference.load(durable)
    same = all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                  reference.model.state_dict().values()))
    local.close()
    durable.close()
    assert loaded is not None
    return honest, loaded.step, loaded.source, same, " ".join(str(w.message) for w in seen)


@pytest.mark.processes
def test_a_replica_whose_bytes_changed_is_refused_and_every_recorded_sum_is_the_bytes_own(tmp_path):
    from robustdist.testing.ranks import run_ranks

    results = run_ranks(_replica_flipped, 2, args=(str(tmp_path),), env=[{"GROUP_RANK": "0"}, {"GROUP_RANK": "1"}],
                        timeout=120)
    for rank, (honest, step, source, same, text) in enumerate(results):
        assert sorted(honest) == sorted(f"owner_{o:05d}/{role}/step_0000000008/meta.json"
                                        for o, role in ((rank, "own"), (1 - rank, "replica"))), honest
        assert all(honest.values()), f"rank {rank}: a meta.json records a checksum other than its file's: {honest}"
        assert (step, source, same) == (4, "durable", True), (rank, step, source, same, text)
    assert any("checksum differs from its meta.json" in text for *_, text in results), results
