"""Nothing outside the step directory is read, and nothing hangs: names that escape, symbolic links at every
level, FIFOs and devices where files should be, a lock file that points elsewhere. Each case asserts the
call returned within a bound, that no absolute path outside the checkpoint was opened, and, where an older
good step exists, that load() fell back to it. The CLI gives a named reason, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from robustdist.checkpoint import AtomicCheckpointer, verify_all
from robustdist.runtime.errors import CheckpointError, RobustDistWarning
from tests.security._forge import (
    STEP1,
    STEP2,
    bounded,
    crc_entry,
    forge,
    manifest_of,
    one_rank_group,
    opened_paths,
    outside,
    sharded_pair,
    sharded_two_steps,
    state_for,
    two_steps,
    write_manifest,
)

BOUND_S = 10.0


def _fallback(directory: Path, reason: str, unblock=()):
    """load() returns step 1 within the bound, warning about step 2 with ``reason``; nothing outside opened."""
    def load():
        with pytest.warns(RobustDistWarning, match=r"checkpoint step 2 failed verification") as record:
            with AtomicCheckpointer(directory) as ckpt:
                loaded = ckpt.load(state={"weights": torch.zeros(16)})
        return loaded, str(record[0].message)

    with opened_paths() as opened:
        (loaded, message), error, elapsed = bounded(load, BOUND_S, unblock)
    assert error is None, error
    assert loaded.step == 1 and torch.equal(loaded.state["weights"], state_for(1)["weights"])
    assert reason in message, message
    assert outside(opened, directory) == [] and elapsed < BOUND_S
    return message


def _outside_weights(tmp_path: Path) -> Path:
    """A valid torch file outside the checkpoint, holding weights an attacker wants loaded."""
    path = tmp_path / "elsewhere.pt"
    torch.save({"weights": torch.full((16,), 666.0), "meta": {"step": 2}}, path)
    return path


@pytest.mark.parametrize("name", ["../elsewhere.pt", "/ABS/elsewhere.pt", "sharded/../../elsewhere.pt",
                                  "./replicated.pt", "replicated.pt/", "", "rank_00001.pt"])
def test_manifest_names_outside_the_step_directory_are_refused(tmp_path, name):
    step2 = two_steps(tmp_path / "ckpt")
    target = _outside_weights(tmp_path)
    manifest = manifest_of(step2)
    name = name.replace("/ABS/", str(tmp_path) + "/")
    manifest["files"][name] = crc_entry(target.read_bytes())
    write_manifest(step2, manifest)
    _fallback(tmp_path / "ckpt", "which robustdist never writes")


def test_a_symlinked_payload_is_refused_even_with_a_matching_checksum(tmp_path):
    step2 = two_steps(tmp_path / "ckpt")
    target = _outside_weights(tmp_path)
    (step2 / "replicated.pt").unlink()
    (step2 / "replicated.pt").symlink_to(target)
    manifest = manifest_of(step2)
    manifest["files"]["replicated.pt"] = crc_entry(target.read_bytes())
    write_manifest(step2, manifest)
    _fallback(tmp_path / "ckpt", "replicated.pt: is a symbolic link; refused")


def test_a_symlinked_step_directory_is_refused(tmp_path):
    two_steps(tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    os.rename(tmp_path / "ckpt" / STEP2, elsewhere)
    (tmp_path / "ckpt" / STEP2).symlink_to(elsewhere, target_is_directory=True)
    _fallback(tmp_path / "ckpt", f"{STEP2}: is a symbolic link; refused")
    with AtomicCheckpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.steps() == [1]  # never committed, so never rotated (or deleted through the link)
    assert (elsewhere / "manifest.json").is_file()


def test_a_symlinked_sharded_directory_and_a_dcp_path_that_escapes(tmp_path):
    with one_rank_group():
        step2 = sharded_two_steps(tmp_path / "ckpt")
        real = tmp_path / "elsewhere"
        os.rename(step2 / "sharded", real)
        (step2 / "sharded").symlink_to(real, target_is_directory=True)
        model, opt = sharded_pair(9)
        with pytest.warns(RobustDistWarning, match=r"sharded: is a symbolic link; refused"):
            with AtomicCheckpointer(tmp_path / "ckpt") as ckpt:
                assert ckpt.load(state={"model": model, "optimizer": opt}).step == 1


def test_dcp_storage_paths_outside_the_listed_files_are_refused(tmp_path):
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    with one_rank_group():
        step2 = sharded_two_steps(tmp_path / "ckpt")
        metadata = FileSystemReader(str(step2 / "sharded")).read_metadata()  # our own valid file
        for info in metadata.storage_data.values():
            info.relative_path = "../../../elsewhere.distcp"
        forge(step2, "sharded/.metadata", pickle.dumps(metadata))
        model, opt = sharded_pair(9)
        with opened_paths() as opened, pytest.warns(RobustDistWarning, match=r"which is not a data file the manifest"):
            with AtomicCheckpointer(tmp_path / "ckpt") as ckpt:
                assert ckpt.load(state={"model": model, "optimizer": opt}).step == 1
        assert outside(opened, tmp_path / "ckpt") == []


@pytest.mark.processes
@pytest.mark.parametrize("target", ["replicated.pt", "manifest.json", "rank_00000.pt"])
def test_a_fifo_where_a_file_should_be_never_blocks(tmp_path, target):
    step2 = two_steps(tmp_path / "ckpt")
    (step2 / target).unlink()
    os.mkfifo(step2 / target)
    reason = f"{target}: is a FIFO; expected a regular file"
    _fallback(tmp_path / "ckpt", reason, unblock=[step2 / target])
    cli = subprocess.run([sys.executable, "-m", "robustdist", "verify-checkpoint", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and reason in cli.stdout and "Traceback" not in cli.stderr


@pytest.mark.parametrize("how", ["symlink", "manifest-name"])
def test_dev_zero_is_never_read(tmp_path, how):
    step2 = two_steps(tmp_path / "ckpt")
    manifest = manifest_of(step2)
    if how == "symlink":
        (step2 / "replicated.pt").unlink()
        (step2 / "replicated.pt").symlink_to("/dev/zero")
        # under the size cap a 16-float model allows (1 GiB and more): the link, not the size, is what refuses it
        manifest["files"]["replicated.pt"] = {"size": 1 << 29, "crc32": "00000000"}
        reason = "is a symbolic link; refused"
    else:
        manifest["files"]["/dev/zero"] = {"size": 1 << 40, "crc32": "00000000"}
        reason = "which robustdist never writes"
    write_manifest(step2, manifest)
    _fallback(tmp_path / "ckpt", reason)
    rows, error, elapsed = bounded(lambda: verify_all(str(tmp_path / "ckpt")), BOUND_S)
    assert error is None and [r["status"] for r in rows] == ["ok", "corrupt"] and reason in rows[1]["reason"]


def test_a_huge_manifest_is_refused_before_it_is_read(tmp_path):
    step2 = two_steps(tmp_path / "ckpt")
    with open(step2 / "manifest.json", "r+b") as fh:
        fh.truncate(1 << 30)  # sparse: 1 GiB that costs no disk
    _fallback(tmp_path / "ckpt", "manifest.json: 1073741824 bytes, more than the 16777216 allowed")


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_lock_file_that_is_not_a_file_is_refused_and_its_target_untouched(tmp_path, kind):
    directory, victim = tmp_path / "ckpt", tmp_path / "victim.txt"
    directory.mkdir()
    victim.write_text("precious")
    if kind == "symlink":
        (directory / ".lock").symlink_to(victim)
    else:
        os.mkfifo(directory / ".lock")

    def save():
        with AtomicCheckpointer(directory) as ckpt:
            ckpt.save(1, state_for(1))

    _, error, elapsed = bounded(save, BOUND_S, unblock=[directory / ".lock"] if kind == "fifo" else [])
    assert isinstance(error, CheckpointError) and ".lock" in str(error) and "Fix: remove it" in str(error)
    assert victim.read_text() == "precious" and elapsed < BOUND_S


@pytest.mark.parametrize("prefix", [".tmp-step_0000000003-abc", ".trash-step_0000000001-abc",
                                    ".old-step_0000000002-abc"])
def test_stale_entries_that_are_links_are_unlinked_not_followed(tmp_path, prefix):
    directory = tmp_path / "ckpt"
    two_steps(directory)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("precious")
    (directory / prefix).symlink_to(victim, target_is_directory=True)
    with AtomicCheckpointer(directory) as ckpt:
        ckpt.save(3, state_for(3))
        assert ckpt.steps() == [1, 2, 3]
    assert not os.path.lexists(directory / prefix) and (victim / "data").read_text() == "precious"


@pytest.mark.processes
def test_verify_checkpoint_names_every_problem_without_a_traceback(tmp_path):
    step2 = two_steps(tmp_path / "ckpt")
    manifest = manifest_of(step2)
    manifest["files"] = ["replicated.pt"]
    write_manifest(step2, manifest)
    out = subprocess.run([sys.executable, "-m", "robustdist", "verify-checkpoint", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "files is list; expected an object of file entries" in out.stdout
    assert out.stdout.splitlines()[1].split()[3] == "ok"  # step 1


def test_resume_with_only_a_broken_step_raises_a_named_error(tmp_path):
    directory = tmp_path / "ckpt"
    with AtomicCheckpointer(directory) as ckpt:
        ckpt.save(1, state_for(1))
    forge(directory / STEP1, "replicated.pt", b"")
    with pytest.warns(RobustDistWarning), pytest.raises(CheckpointError) as exc:
        AtomicCheckpointer(directory).load()
    assert "no valid checkpoint in" in str(exc.value) and "replicated.pt: not a torch zip file" in str(exc.value)
    assert not isinstance(exc.value, TypeError)


@pytest.mark.parametrize(("phase", "reason"), [
    ("files_written", r"\.tmp-step_0000000003-[0-9a-f]+: is a symbolic link"),
    ("manifest_written", r"step_0000000003: is a symbolic link"),
    ("manifest_written:directory", r"was replaced by another directory while the step was committed")])
def test_a_staging_directory_swapped_for_a_link_mid_save_is_not_written_through(tmp_path, monkeypatch, phase, reason):
    """Someone who can write the checkpoint directory swaps the save's staging directory for a link to elsewhere
    mid-save: nothing is written outside (the manifest is written, and the staging directory renamed, by
    descriptor from the checkpoint directory, never through a link), the step is not committed, the older
    steps stay, and the next save removes the link, never what it points at."""
    from robustdist.checkpoint import _faults

    directory = tmp_path / "ckpt"
    two_steps(directory)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("precious")

    def swap(name: str) -> None:
        if name == phase.split(":")[0]:
            (staging,) = directory.glob(".tmp-step_*")
            staging.rename(tmp_path / "moved")
            if phase.endswith(":directory"):  # a directory of someone else's, with a manifest of its own
                staging.mkdir()
                shutil.copy(tmp_path / "moved" / "manifest.json", staging / "manifest.json")
            else:
                staging.symlink_to(victim, target_is_directory=True)

    with AtomicCheckpointer(directory) as ckpt:
        monkeypatch.setattr(_faults, "HOOK", swap)
        with pytest.raises(CheckpointError, match=reason):
            ckpt.save(3, state_for(3))
        monkeypatch.setattr(_faults, "HOOK", None)
        assert sorted(p.name for p in victim.iterdir()) == ["data"] and (victim / "data").read_text() == "precious"
        assert ckpt.steps() == [1, 2]
        ckpt.save(4, state_for(4))
        assert ckpt.steps() == [1, 2, 4]
    assert not list(directory.glob(".tmp-step_*")) and not (directory / "step_0000000003").exists()
    assert sorted(p.name for p in victim.iterdir()) == ["data"] and (victim / "data").read_text() == "precious"


def test_a_whole_step_left_under_a_staging_name_is_never_loaded_and_a_new_save_commits_past_it(tmp_path):
    """What a save left behind by an in-process recovery can leave (hostile or not): a complete-looking step under
    a staging name, newer than every committed one. It is never a candidate, and a save of that step commits."""
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"x": torch.ones(1)})
        ckpt.save(2, {"x": torch.full((1,), 2.0)})
    shutil.copytree(tmp_path / "step_0000000002", tmp_path / ".tmp-step_0000000009-0123456789ab")
    with AtomicCheckpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert ckpt.load().step == 2
        ckpt.save(9, {"x": torch.full((1,), 9.0)})
        loaded = ckpt.load()
        assert loaded.step == 9 and torch.equal(loaded.state["x"], torch.full((1,), 9.0))
