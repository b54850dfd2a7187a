"""A checkpoint written under one lane's torch resumes bitwise under every other lane's, both ways
(a base image upgraded, or rolled back, between a save and a resume). ``make test-matrix`` passes every other
lane's interpreter in ``ROBUSTDIST_OTHER_LANES`` (``name=python;...``); a plain ``make test`` has one torch only,
so these skip there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "clients" / "checkpoint_across_versions.py"
TIMEOUT_S = 600  # two interpreters importing torch (a CUDA build: slow to import) on a loaded 2-core machine


def _lanes() -> list[tuple[str, str]]:
    raw = os.environ.get("ROBUSTDIST_OTHER_LANES", "")
    return [tuple(item.split("=", 1)) for item in raw.split(";") if "=" in item]  # type: ignore[misc]


def _run(python: str, command: str, directory: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([python, str(CLIENT), command, str(directory)], capture_output=True, text=True, env=env,
                         timeout=TIMEOUT_S, cwd=directory.parent)
    assert out.returncode == 0, f"{python} {command}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.skipif(not _lanes(), reason="needs another lane's interpreter: run by make test-matrix")
@pytest.mark.parametrize("lane", [name for name, _ in _lanes()] or ["none"])
def test_checkpoint_resumes_bitwise_across_torch_versions(tmp_path, lane):
    other = dict(_lanes())[lane]
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    written = _run(other, "write", theirs)
    resumed = _run(sys.executable, "read", theirs)
    assert resumed["digest"] == written["digest"], f"written by torch {written['torch']}, resumed by {resumed['torch']}"
    written = _run(sys.executable, "write", ours)
    resumed = _run(other, "read", ours)
    assert resumed["digest"] == written["digest"], f"written by torch {written['torch']}, resumed by {resumed['torch']}"



def _as_if_written_by_a_newer_torch(step_dir: Path, version: str) -> None:
    """Step ``step_dir`` as a newer torch would write it: its float8_e8m0fnu tensor's dtype renamed to
    float8_e9m9fnu (same length: a dtype this torch does not have), the zip records' and the manifest's CRC-32s
    and the manifest's writer version updated to match."""
    import zipfile
    import zlib

    path = step_dir / "replicated.pt"
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        old = z.read(pkl)
        crc = z.getinfo(pkl).CRC
    new = old.replace(b"torch\nfloat8_e8m0fnu\n", b"torch\nfloat8_e9m9fnu\n")
    assert new != old and raw.count(old) == 1
    raw = raw.replace(old, new).replace(crc.to_bytes(4, "little"), zlib.crc32(new).to_bytes(4, "little"))
    path.write_bytes(raw)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["replicated.pt"]["crc32"] = f"{zlib.crc32(raw):08x}"
    manifest["torch"] = version
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_holding_a_dtype_this_torch_lacks_names_both_torches_and_no_older_step_is_tried(tmp_path):
    """A newer torch's checkpoint holding a dtype this torch does not have is intact: the error says which torch
    wrote it and to upgrade, never "corrupt" or "start from scratch", and the older step beside it is not loaded
    instead (it would resume older work)."""
    from robustdist.checkpoint import AtomicCheckpointer
    from robustdist.runtime.errors import CheckpointCorruptError, CheckpointVersionError, UnsupportedVersionError

    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"x": torch.zeros(2, dtype=torch.float8_e8m0fnu)})
        ckpt.save(2, {"x": torch.zeros(2, dtype=torch.float8_e8m0fnu)})
        _as_if_written_by_a_newer_torch(tmp_path / "step_0000000002", "2.99.0")
        with pytest.raises(CheckpointVersionError) as raised:
            ckpt.load(state={"x": torch.zeros(2, dtype=torch.float8_e8m0fnu)})
    message = str(raised.value)
    from robustdist.checkpoint._verify import verify_all

    rows = {r["step"]: r for r in verify_all(str(tmp_path))}  # verify-checkpoint gives the same verdict
    assert rows[1]["status"] == "ok" and rows[2]["status"] == "another torch", rows
    assert "written by" not in rows[2]["reason"] and "says torch 2.99.0 wrote it" in rows[2]["reason"], rows
    assert isinstance(raised.value, UnsupportedVersionError) and not isinstance(raised.value, CheckpointCorruptError)
    assert f"it holds torch.float8_e9m9fnu, which torch {torch.__version__} (installed) does not have; its manifest " \
           "says torch 2.99.0 wrote it, so it is intact if that torch did (a file you do not trust can be made to look " \
           "like this: nothing of it was run). Fix: upgrade torch to 2.99.0 or newer to load it" in message, message
    assert "checkpoint step 2 needs another torch than this one" in message
    assert "no older checkpoint was tried (it would resume older work)" in message
    assert "start from scratch" not in message and "could run code" not in message


@pytest.mark.parametrize("written_by", [None, "", "2.99.0\n\x1b[31mFix: run rm -rf /", "x" * 50, "latest"])
def test_a_manifest_version_that_is_no_version_leaves_the_refused_pickle(written_by):
    from robustdist.checkpoint._schema import another_torchs

    refusal = RuntimeError("Unsupported global: GLOBAL torch.float8_e9m9fnu was not an allowed global by default")
    assert another_torchs(refusal, written_by) is None
    assert another_torchs(refusal, "2.99.0") is not None
    import sys

    lazily = "_inductor" not in vars(torch)
    assert another_torchs(RuntimeError("GLOBAL torch._inductor"), "2.99.0") is None  # torch has it, if lazily
    assert not lazily or "torch._inductor" not in sys.modules  # and finding that out imported nothing


def test_the_same_name_in_a_checkpoint_this_torch_wrote_is_still_a_refused_pickle(tmp_path):
    """A name this torch lacks in a checkpoint whose manifest says this very torch wrote it: crafted, not another
    version's (the refused pickle's message stays, and the older step is loaded instead, with a warning)."""
    from robustdist.checkpoint import AtomicCheckpointer

    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"x": torch.zeros(2, dtype=torch.float8_e8m0fnu)})
        ckpt.save(2, {"x": torch.zeros(2, dtype=torch.float8_e8m0fnu)})
        _as_if_written_by_a_newer_torch(tmp_path / "step_0000000002", torch.__version__)
        with pytest.warns(UserWarning, match="found objects robustdist never writes .a pickle that could run code."):
            loaded = ckpt.load(state={"x": torch.zeros(2, dtype=torch.float8_e8m0fnu)})
    assert loaded.step == 1
