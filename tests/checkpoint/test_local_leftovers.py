"""``robustdist clean``: the in-memory tier's directories that no running job uses are removed, the ones a live
process holds are kept, and nothing else under the base is touched (another user's name, a link planted at a
tier's name, a directory others can write, a file that merely looks like a tier). Run for real: a tier held by
a live process (``LocalTier`` in a child that waits), one left by a process that ended without ``close()``, and
the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from robustdist.checkpoint.local import layout
from robustdist.checkpoint.local.leftovers import IN_USE, clean

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TIER = textwrap.dedent("""
    import sys, time
    from robustdist.checkpoint import LocalTier
    tier = LocalTier(sys.argv[1], lineage=sys.argv[2])
    (__import__("pathlib").Path(tier.directory) / "owner_00000").mkdir()
    (__import__("pathlib").Path(tier.directory) / "owner_00000" / "payload").write_bytes(b"x" * 4096)
    print(tier.directory, flush=True)
    if sys.argv[3] == "wait":
        sys.stdin.read()          # held until the test closes stdin
    else:
        __import__("os")._exit(0)  # ends without close(): the directory stays, held by no one
""")


def _tier(base: Path, lineage: str, wait: bool) -> tuple[subprocess.Popen, str]:
    child = subprocess.Popen([sys.executable, "-c", TIER, str(base), lineage, "wait" if wait else "exit"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline().strip()
    assert line, "the tier's child printed no directory"
    if not wait:
        child.wait(timeout=60)
    return child, line


def test_clean_removes_what_no_running_job_holds_and_nothing_else(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    live, held = _tier(base, "running-job", wait=True)
    try:
        _, left = _tier(base, "finished-job", wait=False)
        uid = os.getuid()
        old = base / f"{layout.PREFIX}{uid}-{'a' * 16}"  # an older robustdist's: no lock file
        old.mkdir(mode=0o700)
        (base / f"{layout.PREFIX}{uid + 1}-{'b' * 16}").mkdir()  # another uid's name: never looked at
        outside = tmp_path / "precious"
        outside.mkdir()
        (outside / "keep").write_text("keep")
        (base / f"{layout.PREFIX}{uid}-{'c' * 16}").symlink_to(outside)  # a link at a tier's name
        shared = base / f"{layout.PREFIX}{uid}-{'d' * 16}"
        shared.mkdir()
        shared.chmod(0o777)  # writable by others: not trusted as a tier
        (base / "unrelated").mkdir()

        preview = {Path(f.path).name: f.state for f in clean(str(base), dry_run=True)}
        assert preview[Path(left).name] == "unused" and os.path.isdir(left)  # a dry run removes nothing
        found = {Path(f.path).name: f for f in clean(str(base))}
        assert found[Path(held).name].state == "in use" and os.path.isfile(Path(held) / "owner_00000" / "payload")
        assert found[Path(left).name].state == "removed" and found[Path(left).name].bytes >= 4096
        assert not os.path.lexists(left)
        assert found[old.name].state == "unknown" and "--force" in found[old.name].why and old.is_dir()
        assert found[f"{layout.PREFIX}{uid}-{'c' * 16}"].state == "refused"
        assert "symbolic link" in found[f"{layout.PREFIX}{uid}-{'c' * 16}"].why
        assert found[shared.name].state == "refused" and "writable by others" in found[shared.name].why
        assert (outside / "keep").read_text() == "keep" and shared.is_dir() and (base / "unrelated").is_dir()
        assert f"{layout.PREFIX}{uid + 1}-{'b' * 16}" not in found
        assert {Path(f.path).name: f.state for f in clean(str(base), force=True)}[old.name] == "removed"
    finally:
        live.stdin.close()
        live.wait(timeout=60)
    assert os.path.isdir(held)  # its process ended without close(): the files stay, held by no one now
    assert {Path(f.path).name: f.state for f in clean(str(base))}[Path(held).name] == "removed"


def test_the_cli_reports_and_removes(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    _, left = _tier(base, "gone", wait=False)
    assert os.path.isfile(Path(left) / IN_USE)
    out = subprocess.run([sys.executable, "-m", "robustdist", "clean", "--dir", str(base), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [(r["path"], r["state"]) for r in json.loads(out.stdout)] == [(left, "removed")]
    out = subprocess.run([sys.executable, "-m", "robustdist", "clean", "--dir", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot list" in out.stderr and "Fix:" in out.stderr


def test_a_tier_removed_again_and_again_while_it_is_made_is_named(tmp_path, monkeypatch):
    from robustdist.checkpoint.local.leftovers import hold
    from robustdist.runtime.errors import CheckpointError

    root = layout.tier_root(str(tmp_path), "lineage")
    layout.make_root(root)
    monkeypatch.setattr(os.path, "samestat", lambda a, b: False)  # as if a clean removed it after each lock
    with pytest.raises(CheckpointError, match=r"was removed three times while this job made it; expected it to stay\. "
                                              r"Fix: do not run `robustdist clean` on a job that is starting"):
        hold(root)
