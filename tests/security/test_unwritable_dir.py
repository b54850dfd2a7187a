"""A checkpoint directory that cannot be written (a read-only mount, a path too long) is a named
:class:`CheckpointError` on every rank, with the path and the fix: never a raw ``PermissionError``/``OSError`` on
rank 0 and a wrapped one on the others. The read-only case runs in a private mount namespace (a read-only bind
mount of a test directory), which dies with the process: nothing to tear down on the host. One such process
saves with one rank, then with two; both cases read its results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from robustdist.testing.ranks import run_ranks

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def _save(rank: int, directory: str):
    import torch

    from robustdist.checkpoint import AtomicCheckpointer
    from robustdist.runtime.errors import CheckpointError

    try:
        with AtomicCheckpointer(directory) as ckpt:
            ckpt.save(1, {"w": torch.zeros(2)})
    except CheckpointError as e:
        return type(e).__name__, str(e)
    except Exception as e:
        return f"raw {type(e).__name__}", str(e)
    return "saved", ""


def _check(out: list, expected: str) -> None:
    for rank, (kind, message) in enumerate(out):
        assert kind == "CheckpointError", (rank, kind, message)
        assert message.startswith(f"[rank {rank}]") or len(out) == 1, message
        assert expected in message, message


def test_a_path_too_long_is_named_on_every_rank(tmp_path):
    out = run_ranks(_save, 2, args=(str(tmp_path / ("x" * 300)),), timeout=60)
    _check(out, "could not create the checkpoint directory (OSError: File name too long). Fix: use a shorter")


SCRIPT = textwrap.dedent("""
    import json, sys
    from robustdist.testing.ranks import run_ranks
    from tests.security.test_unwritable_dir import _save

    if __name__ == "__main__":
        print(json.dumps({world: run_ranks(_save, int(world), args=(sys.argv[1],), timeout=60)
                          for world in sys.argv[2:]}))
""")
WORLDS = ("1", "2")


@pytest.fixture(scope="module")
def read_only_runs(tmp_path_factory) -> tuple[Path, dict[str, list]]:
    """One process in a private mount namespace, the checkpoint directory bind-mounted read-only there, saves with
    one rank and then with two: the directory and each world size's results."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare (and root)")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode()[:200]}")
    tmp_path = tmp_path_factory.mktemp("read-only")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    script = tmp_path / "save.py"
    script.write_text(SCRIPT)
    d = str(directory)
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"', "sh", d,
           sys.executable, str(script), d, *WORLDS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return directory, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.xdist_group("unwritable_read_only")  # one worker makes the launch both cases read
@pytest.mark.parametrize("world", [1, 2])
def test_a_read_only_directory_is_named_on_every_rank(read_only_runs, world):
    directory, runs = read_only_runs
    out = runs[str(world)]
    _check(out, "Read-only file system")
    assert ("Fix: use a directory on a writable filesystem" if world == 1 else  # the shared-directory probe's fix
            "Fix: make checkpoint.dir writable by every rank") in out[0][1]
    assert list(directory.iterdir()) == []  # the mount was private: nothing written, nothing left mounted
