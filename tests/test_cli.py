"""The CLI: `robustdist info` and `python -m robustdist info` run for real in subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes


def _run(*args, env=None, exe=(sys.executable, "-m", "robustdist")):
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    return subprocess.run([*exe, *args], capture_output=True, text=True, timeout=120, env={**clean, **(env or {})})


def test_info_prints_versions_and_topology():
    out = _run("info")
    assert out.returncode == 0, out.stderr
    from importlib import metadata

    # the installed distribution's version (PyPI's CUDA wheels say 2.15.0 where torch.__version__ adds +cu132)
    assert f"versions.torch             {metadata.version('torch')}" in out.stdout
    assert "topology.launcher          single" in out.stdout
    assert "topology.world_size        1" in out.stdout


def test_info_json_parses():
    out = _run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["topology"]["launcher"] == "single"
    assert info["cuda"]["available"] is False
    assert "gloo" in info["distributed"]["backends"]


def test_info_reports_a_broken_topology_with_exit_1():
    out = _run("info", env={"RANK": "5", "WORLD_SIZE": "2"})
    assert out.returncode == 1
    assert "rank 5 is outside world size 2; expected 0 <= rank < 2. Fix:" in out.stdout


def test_console_script_and_help():
    exe = shutil.which("robustdist", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail("the `robustdist` console script is not installed next to this interpreter")
    out = _run("--version", exe=(exe,))
    assert out.returncode == 0 and out.stdout.strip() == "robustdist 0.1.0"
    bare = _run()
    assert bare.returncode == 2 and "info" in bare.stderr
