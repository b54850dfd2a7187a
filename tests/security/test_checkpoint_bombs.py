"""Small inputs that would cost unbounded memory or time, and saved states that pass their shape checks but
break the live objects they are restored into. Found by an adversarial review; each is refused (with the
older step loaded instead) within a time bound."""

from __future__ import annotations

import io
import os
import pickle
import time
import zipfile

import pytest
import torch

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.checkpoint._sharded import check_metadata
from robustdist.runtime.errors import CheckpointError, RobustDistWarning
from tests._memory import peak_growth
from tests.security._forge import (
    STEP2,
    adam_two_steps,
    forge,
    one_rank_group,
    sharded_pair,
    sharded_two_steps,
    state_for,
    two_steps,
)


def _torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _falls_back(directory, reason, **state):
    state = state or {"weights": torch.zeros(16)}
    start = time.monotonic()
    with pytest.warns(RobustDistWarning, match=r"checkpoint step 2 failed verification") as record:
        with AtomicCheckpointer(directory) as ckpt:
            loaded = ckpt.load(state=state)
    assert loaded.step == 1 and time.monotonic() - start < 10
    message = next(str(w.message) for w in record if w.category is RobustDistWarning)
    assert reason in message, message


def _rank_payload(step_dir):
    return torch.load(step_dir / "rank_00000.pt", weights_only=True)


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda rng: rng["python"].__setitem__(0, 1), "python: the generator refused it (ValueError"),
    (lambda rng: rng["python"][1].__setitem__(624, 100000), "python: the generator refused it"),
    (lambda rng: rng["torch"].fill_(255), "torch: the generator refused it (RuntimeError"),
    (lambda rng: rng["numpy"].__setitem__("pos", 625), "numpy: expected 624 uint32 keys"),
])
def test_a_well_shaped_rng_state_that_a_generator_refuses_falls_back(tmp_path, edit, reason):
    step2 = two_steps(tmp_path)
    payload = _rank_payload(step2)
    edit(payload["rng"])
    forge(step2, "rank_00000.pt", _torch_bytes(payload))
    _falls_back(tmp_path, reason)


def test_a_compressed_payload_is_refused_before_it_inflates(tmp_path):
    step2 = two_steps(tmp_path)
    real = zipfile.ZipFile(io.BytesIO((step2 / "replicated.pt").read_bytes()))
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for info in real.infolist():
            out.writestr(info.filename, real.read(info.filename))
        out.writestr("archive/data/9", b"\0" * (64 << 20))  # 64 MiB that deflates to ~64 KiB
    assert len(bomb.getvalue()) < 1 << 20
    forge(step2, "replicated.pt", bomb.getvalue())
    grew = peak_growth(lambda: _falls_back(tmp_path, "replicated.pt: holds compressed members"))
    assert grew < 48 << 20, f"peak memory grew by {grew >> 20} MiB: the member was inflated"


def test_an_expanded_optimizer_state_is_refused_before_casting_materialises_it(tmp_path):
    adam_two_steps(tmp_path)
    payload = torch.load(tmp_path / STEP2 / "replicated.pt", weights_only=True)
    payload["optimizer"]["state"][0]["exp_avg"] = torch.zeros(1, dtype=torch.float64).expand(2**29)
    forge(tmp_path / STEP2, "replicated.pt", _torch_bytes(payload))
    fresh = torch.nn.Linear(4, 2)
    _falls_back(tmp_path, "holds an expanded tensor view", model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))


def test_a_shared_reference_tree_is_refused_before_anything_walks_it(tmp_path):
    step2 = two_steps(tmp_path)
    node: list = []
    for _ in range(40):  # 2**40 leaves as a tree, a few hundred bytes as a pickle
        node = [node, node]
    forge(step2, "replicated.pt", _torch_bytes({"weights": torch.ones(16), "meta": node}))
    _falls_back(tmp_path, "refused before unpickling: a value stands for a tree of more than")


def test_a_scheduler_state_cannot_replace_its_methods(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"sched": sched})
        ckpt.save(2, {"sched": sched})
    payload = torch.load(tmp_path / STEP2 / "replicated.pt", weights_only=True)
    payload["sched"]["step"] = 0  # load_state_dict does __dict__.update: sched.step() would be an int
    forge(tmp_path / STEP2, "replicated.pt", _torch_bytes(payload))
    live = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    _falls_back(tmp_path, "does not have the keys of a StepLR state dict (unexpected: step)", sched=live)
    live.step()  # still a method


def test_dcp_chunks_that_do_not_tile_their_tensor_are_refused(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with one_rank_group():
        step2 = sharded_two_steps(tmp_path / "ckpt")
        metadata = FileSystemReader(str(step2 / "sharded")).read_metadata()  # our own valid file
        fqn, entry = next((k, v) for k, v in metadata.state_dict_metadata.items()
                          if isinstance(v, TensorStorageMetadata) and v.size.numel() > 1)
        entry.chunks.extend([entry.chunks[0]] * 1000)  # the same bytes read 1001 times
        forge(step2, "sharded/.metadata", pickle.dumps(metadata))
        model, opt = sharded_pair(9)
        start = time.monotonic()
        with pytest.warns(RobustDistWarning, match=rf"the chunks of '{fqn}' cover"):
            with AtomicCheckpointer(tmp_path / "ckpt") as ckpt:
                assert ckpt.load(state={"model": model, "optimizer": opt}).step == 1
        assert time.monotonic() - start < 10


def test_oversized_dcp_metadata_is_refused_before_unpickling(tmp_path):
    with one_rank_group():
        step2 = sharded_two_steps(tmp_path / "ckpt")
        forge(step2, "sharded/.metadata", b"\x80\x04" + b"}" * (4 << 20) + b".")  # 4 Mi dicts from 4 MiB
        model, opt = sharded_pair(9)
        with pytest.warns(RobustDistWarning, match=r"sharded/\.metadata: \d+ bytes, more than the \d+ allowed"):
            with AtomicCheckpointer(tmp_path / "ckpt") as ckpt:
                assert ckpt.load(state={"model": model, "optimizer": opt}).step == 1


def test_a_path_bomb_in_dcp_metadata_is_refused_at_once(tmp_path):
    import pathlib

    class Bomb:
        def __reduce__(self):
            return (pathlib.PosixPath, ("x/" * 50_000,) * 160)  # pathlib would split 8 million parts

    meta = tmp_path / ".metadata"
    meta.write_bytes(pickle.dumps(Bomb(), protocol=4))
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="a path in DCP metadata is not a short list of strings"):
        check_metadata(str(meta))
    assert time.monotonic() - start < 2


def test_save_refuses_what_could_never_load(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"entry name 0 is a int; expected a str of 1 to 256 characters"):
            ckpt.save(1, {0: torch.ones(1)})
        with pytest.raises(CheckpointError, match=r"is an integer of 2041 bits; .* Fix: store it as a str"):
            ckpt.save(1, {"big": 2**2040})
        shared: list = []
        for _ in range(60):
            shared = [shared, shared]
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=r"more than 1000000 values counted as a tree"):
            ckpt.save(1, {"dag": shared})
        assert time.monotonic() - start < 30 and ckpt.steps() == []
        ckpt.save(1, {"big": 2**1999, **state_for(1)})
        assert ckpt.load().state["big"] == 2**1999


def test_a_hard_linked_lock_file_is_refused_and_its_other_name_untouched(tmp_path):
    directory, victim = tmp_path / "ckpt", tmp_path / "victim.txt"
    directory.mkdir()
    victim.write_text("precious")
    os.link(victim, directory / ".lock")
    with pytest.raises(CheckpointError, match=r"the lock file is a hard link \(2 names share it"):
        with AtomicCheckpointer(directory) as ckpt:
            ckpt.save(1, state_for(1))
    assert victim.read_text() == "precious"


# ------------------------------------------------------------------ found by the second review
def test_a_shared_tuple_used_as_a_key_is_refused_before_it_is_hashed(tmp_path):
    step2 = two_steps(tmp_path)
    key: tuple = ()
    for _ in range(26):  # hashing it walks 2**26 nodes; 40 levels would take hours inside the unpickler
        key = (key, key)
    payload = _rank_payload(step2)
    payload["per_rank"]["extra"] = {key: 1}
    forge(step2, "rank_00000.pt", _torch_bytes(payload))
    _falls_back(tmp_path, "refused before unpickling: a value stands for a tree of more than")


def test_colliding_integer_keys_are_refused_before_the_dict_is_built(tmp_path):
    step2 = two_steps(tmp_path)
    forge(step2, "replicated.pt", _torch_bytes({**state_for(2), "meta": {i * (2**61 - 1): 0 for i in range(2000)}}))
    _falls_back(tmp_path, "a dict key stands for 1 values or holds a float, an int of magnitude")


def test_a_quantized_expanded_optimizer_state_is_refused(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"optimizer": opt})
        ckpt.save(2, {"optimizer": opt})
    payload = torch.load(tmp_path / STEP2 / "replicated.pt", weights_only=True)
    quant = torch.quantize_per_tensor(torch.zeros(1), 0.1, 0, torch.quint8).expand(2**31)
    payload["optimizer"]["state"] = {0: {"exp_avg": quant}}
    forge(tmp_path / STEP2, "replicated.pt", _torch_bytes(payload))
    _falls_back(tmp_path, "holds an expanded tensor view",
                optimizer=torch.optim.Adam(torch.nn.Linear(4, 2).parameters()))


@pytest.mark.parametrize("make", [lambda: torch.empty(624, dtype=torch.int64, device="meta"),
                                  lambda: torch.zeros(624, dtype=torch.int64).to_sparse()], ids=["meta", "sparse"])
def test_numpy_rng_keys_that_are_not_a_plain_tensor_fall_back(tmp_path, make):
    step2 = two_steps(tmp_path)
    payload = _rank_payload(step2)
    payload["rng"]["numpy"]["keys"] = make()
    forge(step2, "rank_00000.pt", _torch_bytes(payload))
    _falls_back(tmp_path, "numpy: expected 624 uint32 keys")


def test_inner_schedulers_and_lr_lambdas_cannot_gain_attributes(tmp_path):
    class Warmup:
        def __init__(self):
            self.steps = 10

        def __call__(self, epoch):
            return min(1.0, (epoch + 1) / self.steps)

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    def scheds():
        return {"seq": torch.optim.lr_scheduler.SequentialLR(opt, [torch.optim.lr_scheduler.StepLR(opt, 2),
                                                                   torch.optim.lr_scheduler.StepLR(opt, 3)], [2]),
                "lam": torch.optim.lr_scheduler.LambdaLR(opt, Warmup())}

    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, scheds())
        ckpt.save(2, scheds())
    pristine = (tmp_path / STEP2 / "replicated.pt").read_bytes()
    for edit, reason in ((lambda p: p["seq"]["_schedulers"][1].__setitem__("step", 0), "inner scheduler 1"),
                         (lambda p: p["lam"]["lr_lambdas"][0].__setitem__("__call__", 0), "lr_lambdas does not match")):
        payload = torch.load(io.BytesIO(pristine), weights_only=True)
        edit(payload)
        forge(tmp_path / STEP2, "replicated.pt", _torch_bytes(payload))
        _falls_back(tmp_path, reason, **scheds())


def test_a_loader_without_a_length_never_skips_without_bound():
    from torch.utils.data import DataLoader, IterableDataset  # noqa: F401

    from robustdist.data import state as _loader_state
    from robustdist.runtime.errors import CheckpointError as Refused

    state = {"version": 1, "iterations": 1, "epoch": None, "num_batches": None, "batches": 2**62,
             "in_flight": True, "rng": {"torch": torch.get_rng_state(), "generator": None}}
    with pytest.raises(Refused, match=r"`batches` is .*; expected an int \(not a bool\) from 0 to 10000000 \(the "
                                      r"loader's length is unknown"):
        _loader_state.validate_state(state, None)


def test_save_refuses_more_that_load_would_refuse(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"checkpoint key state\['m'\]\[.*\] is a int; expected str keys"):
            ckpt.save(1, {"m": {2**3000: 1}})
        with pytest.raises(CheckpointError, match=r"more than 1000000 values counted as a tree"):
            ckpt.save(1, {"a": list(range(600_000)), "b": list(range(600_000))})  # one budget per file
        with pytest.raises(CheckpointError, match=r"entry name 'x+ is a str; expected a str of 1 to 256"):
            ckpt.save(1, {"x" * 300: 1})
        with pytest.raises(CheckpointError, match=r"metadata is not plain JSON data \(\d+ characters of JSON"):
            ckpt.save(1, {"x": 1}, metadata={"big": "y" * (2 << 20)})
        assert ckpt.steps() == []


def test_a_module_with_extra_state_round_trips(tmp_path):
    class WithExtra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calls": 3}

        def set_extra_state(self, state):
            self.restored = state

    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": WithExtra(2, 2)})
        fresh = WithExtra(2, 2)
        assert ckpt.load(state={"model": fresh}).step == 1 and fresh.restored == {"calls": 3}


def test_sets_in_dcp_metadata_are_refused_before_unpickling(tmp_path):
    meta = tmp_path / ".metadata"
    meta.write_bytes(pickle.dumps([set() for _ in range(1000)], protocol=4))
    with pytest.raises(CheckpointError, match=r"refused before unpickling: opcode EMPTY_SET"):
        check_metadata(str(meta))


def test_an_old_copy_beyond_the_largest_step_is_not_a_step(tmp_path):
    two_steps(tmp_path)
    (tmp_path / ".old-step_99999999999999999999-ab").mkdir()
    (tmp_path / ".old-step_99999999999999999999-ab" / "manifest.json").write_text("{}")
    with AtomicCheckpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [1, 2]
        ckpt.save(3, state_for(3))  # the writer's clean-up removes it; it is never put back as a step
    assert not (tmp_path / "step_99999999999999999999").exists()


def _sparse_forge(step_dir, name: str, pieces: list[tuple[int, bytes]], size: int) -> None:
    """Write ``name`` as a sparse file of ``size`` bytes holding ``pieces`` (offset, bytes), its manifest entry
    re-checksummed (a CRC-32 over the holes too), as an attacker who can write the directory would."""
    import json
    import zlib

    path = step_dir / name
    with open(path, "wb") as fh:
        fh.truncate(size)
        for offset, data in pieces:
            fh.seek(offset)
            fh.write(data)
    crc, pos, zeros = 0, 0, bytes(16 << 20)
    for offset, data in sorted(pieces) + [(size, b"")]:
        while pos < offset:
            chunk = min(len(zeros), offset - pos)
            crc, pos = zlib.crc32(zeros[:chunk], crc), pos + chunk
        crc, pos = zlib.crc32(data, crc), pos + len(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = {"size": size, "crc32": f"{crc:08x}"}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


HOLE = 512 << 20


def test_a_sparse_file_declaring_a_huge_central_directory_costs_no_memory(tmp_path):
    """zipfile reads as many bytes as the end record declares: 512 MiB of a file that takes 8 KiB of disk."""
    import struct

    step2 = two_steps(tmp_path)
    size = 4 + HOLE + 22
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, size - 4 - 22, 4, 0)
    _sparse_forge(step2, "replicated.pt", [(0, b"PK\x03\x04"), (size - 22, end)], size)
    grew = peak_growth(lambda: _falls_back(tmp_path, "its central directory of"))
    assert grew < 128 << 20, f"peak memory grew by {grew >> 20} MiB for a sparse file of {size >> 20} MiB"


def test_a_real_torch_zip_with_a_hole_before_its_directory_is_refused(tmp_path):
    """A valid torch zip with 512 MiB of nothing inserted before its central directory (end records moved to
    match): every member and the CRC are right, but no member accounts for the hole."""
    import struct

    step2 = two_steps(tmp_path)
    raw = (step2 / "replicated.pt").read_bytes()
    start = zipfile.ZipFile(io.BytesIO(raw)).start_dir
    tail = bytearray(raw[start:])
    z64, loc, eocd = tail.rfind(b"PK\x06\x06"), tail.rfind(b"PK\x06\x07"), tail.rfind(b"PK\x05\x06")
    struct.pack_into("<Q", tail, z64 + 48, struct.unpack_from("<Q", tail, z64 + 48)[0] + HOLE)  # directory offset
    struct.pack_into("<Q", tail, loc + 8, struct.unpack_from("<Q", tail, loc + 8)[0] + HOLE)  # zip64 end record
    struct.pack_into("<I", tail, eocd + 16, struct.unpack_from("<I", tail, eocd + 16)[0] + HOLE)
    _sparse_forge(step2, "replicated.pt", [(0, raw[:start]), (start + HOLE, bytes(tail))], len(raw) + HOLE)
    zipfile.ZipFile(step2 / "replicated.pt").testzip()  # the control: a zip every member of which is intact
    grew = peak_growth(lambda: _falls_back(tmp_path, "bytes before its central directory belong to no member"))
    assert grew < 128 << 20


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


_DICTS = pickle.dumps({}, protocol=2)[:-1] + b"0" + b"}0" * 400_000 + b"}."  # 400k dicts, popped as they come


@pytest.mark.parametrize(("members", "reason"), [
    # torch reads data.pkl under the archive name without regard to case: the scan must check that record
    ({"archive/DATA.PKL": _DICTS, "archive/x/data.pkl": pickle.dumps({}, protocol=2)},
     "holds 1 data.pkl records under its archive name 'archive' and 1 elsewhere"),
    ({"archive/data.pkl": pickle.dumps({}, protocol=2), "archive/DATA.pkl": _DICTS},
     "names equal but for case"),
], ids=["other-case-and-decoy", "case-collision"])
def test_the_record_torch_unpickles_is_the_one_scanned(tmp_path, members, reason):
    step2 = two_steps(tmp_path)
    forge(step2, "replicated.pt", _zip(members))
    _falls_back(tmp_path, reason)


def test_a_memo_index_that_skips_ahead_is_refused_before_the_unpickler_sizes_its_table(tmp_path):
    """The C unpickler (DCP metadata) grows its memo table to twice any index: 9 bytes cost 300 MB at 2**24."""
    meta = tmp_path / ".metadata"
    meta.write_bytes(b"\x80\x04}r\x00\x00\x00\x01.")
    def refused() -> None:
        with pytest.raises(CheckpointError, match=r"memo index 16777216 is not the next of the 0 entries written"):
            check_metadata(str(meta))

    grew = peak_growth(refused)
    assert grew < 64 << 20, f"peak memory grew by {grew >> 20} MiB"


@pytest.mark.parametrize("setting", [("storage_alignment", 4096), ("compute_crc32", False)])
def test_torch_save_settings_a_user_may_choose_still_load(tmp_path, setting):
    """torch.utils.serialization.config.save: an alignment up to 64 KiB pads between members; without CRC-32s a
    record's checksum field is 0 (the manifest's checksum covers the file)."""
    from torch.utils.serialization import config

    name, value = setting
    old = getattr(config.save, name)
    setattr(config.save, name, value)
    try:
        two_steps(tmp_path)
    finally:
        setattr(config.save, name, old)
    with AtomicCheckpointer(tmp_path) as ckpt:
        loaded = ckpt.load(state={"weights": torch.zeros(16)})
    assert loaded.step == 2 and torch.equal(loaded.state["weights"], state_for(2)["weights"])
