"""Hostile probe files cannot fool or hang the shared-directory check (``robustdist.checkpoint._shared``).

The check decides whether every rank sees one checkpoint directory by reading, on each rank, a probe file
another rank just wrote with a random token. Whatever sits at a probe's name instead (a stale probe of an
earlier run, a file with other content, a symbolic link, a FIFO, a directory, a huge file) must count as "not
seen", at once; and a file planted at the name a rank is about to write must stop the check, never be
written through. Ranks run as two "nodes" with private tmpfs mounts (see ``tests/test_checkpoint_shared_dir``);
the test replaces the random probe names with fixed ones so that the hostile files can sit at them. The two
shared-directory scenarios run in one launch (stale probes first, at the directory's top, with the random names;
then the planted files, each in a directory of its own), which both tests read.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from robustdist.checkpoint import AtomicCheckpointer, _shared
from tests.checkpoint.test_checkpoint_shared_dir import (
    attempt,
    init_group,
    listing,
    needs_isolation,
    run_nodes,
)

MODULE = "tests.security.test_checkpoint_node_local"
pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]
KINDS = {"stale": "a file with other content (stale or forged), not the probe",
         "symlink": "a symbolic link, not the probe",
         "fifo": "a FIFO, not the probe",
         "directory": "a directory, not the probe",
         "huge": "a 1073741824-byte file, not the probe"}


def _fixed_names(kind: str) -> None:
    _shared.probe_name = lambda rank: f"{_shared.PROBE_PREFIX}{rank:05d}-{kind}"


def _plant(path: str, kind: str) -> None:
    if kind == "stale":
        Path(path).write_text("0" * 32)  # a token of an earlier run
    elif kind == "symlink":
        os.symlink("/dev/zero", path)  # followed, it would never end
    elif kind == "fifo":
        os.mkfifo(path)  # opened for reading without O_NONBLOCK, it would wait forever for a writer
    elif kind == "directory":
        os.mkdir(path)
    else:
        with open(path, "wb") as fh:
            fh.truncate(1 << 30)  # sparse


def forged_probes_on_private_dirs(rank: int, ckpt: str) -> dict[str, Any]:
    init_group()
    out = {}
    for kind in KINDS:
        directory = os.path.join(ckpt, kind)
        os.makedirs(directory)
        _fixed_names(kind)
        other = _shared.probe_name(1 - rank)
        _plant(os.path.join(directory, other), kind)  # where this node looks for the other node's probe
        with AtomicCheckpointer(directory, timeout=30, arrival_timeout=15) as checkpointer:
            out[kind] = {**attempt(lambda: checkpointer.save(1, {"w": torch.ones(2)})), "other": other,
                         "seen": listing(directory)}
    return out


def planted_at_the_name_to_write(rank: int, ckpt: str) -> dict[str, Any]:
    init_group()
    out = {}
    for kind in ("fifo", "symlink"):
        directory = os.path.join(ckpt, kind)
        _fixed_names(kind)
        mine = _shared.probe_name(rank)
        if rank == 0:  # one shared directory: rank 0 plants at rank 1's name
            os.makedirs(directory)
            if kind == "fifo":
                os.mkfifo(os.path.join(directory, _shared.probe_name(1)))
            else:
                os.symlink(os.path.join(ckpt, "escaped"), os.path.join(directory, _shared.probe_name(1)))
        dist.barrier()
        with AtomicCheckpointer(directory, timeout=30, arrival_timeout=15) as checkpointer:
            loaded = attempt(lambda: checkpointer.load(missing_ok=True))
            saved = attempt(lambda: checkpointer.save(1, {"w": torch.ones(2)}))
            dist.barrier()  # every rank has removed its probe
            out[kind] = {"load": loaded, "save": saved, "mine": mine, "seen": listing(directory),
                         "escaped": os.path.lexists(os.path.join(ckpt, "escaped"))}
        dist.barrier()
    return out


def shared_dir_scenarios(rank: int, ckpt: str) -> dict[str, Any]:
    """Stale probes first (random probe names, the directory's top listed before anything else is made there),
    then the planted files (fixed names)."""
    stale = stale_probes_on_a_shared_dir(rank, ckpt)
    return {"stale": stale, "planted": planted_at_the_name_to_write(rank, ckpt)}


def stale_probes_on_a_shared_dir(rank: int, ckpt: str) -> dict[str, Any]:
    init_group()
    stale = [f"{_shared.PROBE_PREFIX}{r:05d}-{uuid.UUID(int=r).hex}" for r in range(2)]
    if rank == 0:  # an earlier run was killed mid-check
        for name in stale:
            Path(ckpt, name).write_text("0" * 32)
    dist.barrier()
    with AtomicCheckpointer(ckpt, timeout=30, arrival_timeout=15) as checkpointer:
        start = time.monotonic()
        checkpointer.save(1, {"w": torch.ones(2)})
        elapsed = time.monotonic() - start
        loaded = checkpointer.load(state={})
        steps = checkpointer.steps()
    return {"steps": steps, "loaded": loaded.step, "seconds": elapsed, "stale": stale,
            "top": sorted(os.listdir(ckpt))}


@needs_isolation
def test_a_forged_stale_linked_fifo_directory_or_huge_probe_is_not_seen_and_does_not_hang(tmp_path):
    for rank, out in enumerate(run_nodes(MODULE, "forged_probes_on_private_dirs", tmp_path, private=True)):
        for kind, reason in KINDS.items():
            got = out[kind]
            directory = tmp_path / "ckpt" / kind
            assert got["error"].startswith(f"[rank {rank}] the checkpoint directory {directory} (checkpoint.dir) is "
                                           "not the same directory on every node: rank 1 on node 1 ("), got["error"]
            for reader, writer in ((0, 1), (1, 0)):
                assert (f"rank {reader} found {reason} where rank {writer} wrote its probe "
                        f"{_shared.PROBE_PREFIX}{writer:05d}-{kind}") in got["error"], (kind, got["error"])
            assert "Fix: put checkpoint.dir on shared storage" in got["error"]
            assert got["ranks"] == [0, 1] and got["seconds"] < 5  # no grace wait: nothing was missing
            assert got["seen"] == [got["other"]]  # only the planted file: no probe, lock, step or staging dir


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """The one launch on a shared directory both tests below read: its directory and each rank's results."""
    tmp_path = tmp_path_factory.mktemp("shared")
    return tmp_path, run_nodes(MODULE, "shared_dir_scenarios", tmp_path, private=False, timeout=90)


@pytest.mark.xdist_group("node_local_shared")  # one worker makes the launch both tests read
def test_a_file_planted_at_a_rank_s_probe_name_stops_the_check_and_is_not_written_through(shared_runs):
    tmp_path, results = shared_runs
    for rank, out in enumerate(r["planted"] for r in results):
        for kind in ("fifo", "symlink"):
            got = out[kind]
            for what, done in (("load", "loaded"), ("save", "saved")):
                message = got[what]["error"]
                assert message.startswith(f"[rank {rank}] rank 1 could not create a probe file in the checkpoint "
                                          f"directory {tmp_path / 'ckpt' / kind} (rank 1 on node 1 ("), message
                assert "FileExistsError: File exists). Expected a directory every rank can write" not in message
                assert ("FileExistsError: File exists); expected a directory every rank can write, since every rank "
                        f"writes its own files there. Nothing was {done}. Fix: make checkpoint.dir writable by every "
                        "rank, on storage every node shares.") in message
                assert got[what]["ranks"] == [1] and got[what]["seconds"] < 5
            assert got["seen"] == [f"{_shared.PROBE_PREFIX}00001-{kind}"] and not got["escaped"]


@pytest.mark.xdist_group("node_local_shared")
def test_stale_probes_of_an_earlier_run_neither_fool_nor_block_a_shared_directory(shared_runs):
    for out in (r["stale"] for r in shared_runs[1]):
        assert (out["steps"], out["loaded"]) == ([1], 1) and out["seconds"] < 5
        assert out["top"] == sorted([".lock", "step_0000000001", *out["stale"]])  # left alone, never a step


def test_a_probe_whose_write_fails_after_it_was_created_is_not_left_behind(tmp_path):
    """Found by review: a full disk or quota (EFBIG/ENOSPC after the create) left an empty probe file per save."""
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
            "from robustdist.checkpoint._shared import _write_probe\n"
            "print(_write_probe(sys.argv[1], '.robustdist-probe-00001-x', 'ab' * 16))\n")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "File too large" in out.stdout  # the write failed after the create...
    assert list(tmp_path.iterdir()) == []  # ...and nothing is left
