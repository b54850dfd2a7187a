"""``scripts/matrix.py --render`` on made-up lane results, in a copy of the files it rewrites: only whole, passing
runs widen the ranges; a subset, a failed lane and an interrupted one do not; a pre-release lane version does not
crash it; each lane's commit is shown."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    for rel in ("scripts/matrix.py", "pyproject.toml", "docs/status.md", "robustdist/runtime/tested_versions.json"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tree / rel)
    return tree


def _result(lane: str, python: str, torch: str, ray: str, *, ok: bool = True, subset: bool = False,
            passed: int = 100, commit: str | None = "abcdef0123456789") -> dict:
    return {"lane": lane, "why": "test", "versions": {"python": python, "torch": torch, "ray": ray, "numpy": "2.4.6"},
            "date": "2026-12-02", "duration_s": 1, "subset": subset, "pytest_args": [], "returncode": 0 if ok else 1,
            "ok": ok, "passed": passed, "failed": 0 if ok else 2, "errors": 0, "skipped": 1, "failures": [],
            "freeze": [], "commit": commit, "dirty": False}


def _render(tree: Path, results: dict[str, dict | None]) -> subprocess.CompletedProcess:
    matrix = tree / ".matrix"
    for lane, res in results.items():
        (matrix / lane).mkdir(parents=True, exist_ok=True)
        if res is not None:
            (matrix / lane / "result.json").write_text(json.dumps(res))
    env = {"ROBUSTDIST_MATRIX_DIR": str(matrix), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(tree / "scripts" / "matrix.py"), "--render"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_only_whole_passing_lanes_widen_the_ranges(tmp_path):
    tree = _tree(tmp_path)
    done = _render(tree, {
        "pinned": _result("pinned", "3.11.7", "2.13.0+cpu", "2.60.0"),
        "newest": _result("newest", "3.12.1", "2.15.0rc1", "2.60.0", ok=False),  # failed: widens nothing
        "py313": _result("py313", "3.13.0", "2.14.1", "2.55.1", subset=True),  # a subset: not rendered
        "oldest": _result("oldest", "3.10.13", "2.8.0", "2.52.1", commit=None),
    })
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tree / "robustdist/runtime/tested_versions.json").read_text())
    assert data["supported"] == {"python": {"min": "3.10", "max_minor": "3.11"},
                                 "torch": {"min": "2.8.0", "max_minor": "2.13"},
                                 "ray": {"min": "2.52.1", "max_minor": "2.60"}}
    assert [lane["lane"] for lane in data["not_run"]] == ["py313"]
    pyproject = (tree / "pyproject.toml").read_text()
    assert '"torch>=2.8,<2.14"' in pyproject and '"ray[train,tune]>=2.52.1,<2.61"' in pyproject
    assert 'requires-python = ">=3.10"' in pyproject
    table = (tree / "docs/status.md").read_text()
    assert "| pinned | 3.11 | 2.13.0+cpu | 2.60.0 | 2.4.6 | 100 passed, 1 skipped | 2026-12-02 | abcdef0123 |" in table
    assert "| oldest | 3.10 | 2.8.0 | 2.52.1 | 2.4.6 | 100 passed, 1 skipped | 2026-12-02 | unrecorded |" in table
    assert "| newest | 3.12 | 2.15.0rc1 | 2.60.0 | 2.4.6 | **2 failed, 0 errors**, 100 passed |" in table
    assert "| py313 | 3.13 | 2.14.1 | 2.55.1 | | not run yet | | |" in table
    assert "lane pinned ran commit abcdef0123456789, not HEAD" in done.stdout  # the copy is no git checkout


def test_an_interrupted_run_counts_as_not_run_and_no_passing_lane_renders_nothing(tmp_path):
    tree = _tree(tmp_path)
    before = (tree / "pyproject.toml").read_text()
    done = _render(tree, {"pinned": _result("pinned", "3.11.7", "2.13.0", "2.60.0", ok=False),
                          "oldest": {**_result("oldest", "3.10.13", "2.8.0", "2.52.1"), "passed": 0},
                          "newest": None, "py313": None})
    assert done.returncode != 0 and "no lane passed; nothing to render" in done.stderr
    assert (tree / "pyproject.toml").read_text() == before
