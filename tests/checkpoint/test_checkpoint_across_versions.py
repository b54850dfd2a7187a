"""A checkpoint written under one lane's torch resumes bitwise under every other lane's, both ways (issue #31:
a base image upgraded, or rolled back, between a save and a resume). ``make test-matrix`` passes every other
lane's interpreter in ``ROBUSTDIST_OTHER_LANES`` (``name=python;...``); a plain ``make test`` has one torch only,
so these skip there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
