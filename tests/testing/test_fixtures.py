"""The suite's own guard rails can fail: a test that leaks a child process is reported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import _procs

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]


def test_new_descendants_sees_a_leaked_child():
    before = _procs.descendants(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in _procs.new_descendants(os.getpid(), before)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in _procs.new_descendants(os.getpid(), before)


def test_a_process_leaked_from_the_forkserver_is_seen_but_the_server_is_not():
    import multiprocessing as mp
    import time

    ctx = mp.get_context("forkserver")
    ctx.Process(target=time.sleep, args=(0,)).start()  # make sure the server runs before we look
    time.sleep(0.5)
    before = _procs.descendants(os.getpid())
    leaked = ctx.Process(target=time.sleep, args=(60,))
    leaked.start()
    try:
        found = _procs.new_descendants(os.getpid(), before)
        assert leaked.pid in found
        assert all(not _procs._is_helper(pid) or _procs._is_helper(_procs._ppid_map().get(pid)) for pid in found)
    finally:
        leaked.kill()
        leaked.join(10)
    assert leaked.pid not in _procs.new_descendants(os.getpid(), before)


def test_a_leaking_test_fails_and_its_child_is_killed(tmp_path):
    (tmp_path / "conftest.py").write_text("pytest_plugins = [\"tests.conftest\"]\n")
    (tmp_path / "test_leak.py").write_text(textwrap.dedent("""
        import subprocess, sys
        def test_leaks():
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open("leaked.pid", "w").write(str(p.pid))
    """))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the test left child processes running (now killed)" in out.stdout
    pid = int((tmp_path / "leaked.pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]
