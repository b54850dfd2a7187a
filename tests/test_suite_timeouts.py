"""The suite's own reporting: under pytest-xdist, a test past a ``method="thread"`` timeout fails naming the
timeout, with the stack it was stuck in (``tests/_timeouts.py``), instead of only a crashed worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import _timeouts

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.processes
def test_a_thread_timeout_in_an_xdist_worker_is_reported_with_the_stuck_stack(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    # The suite's real hooks, nothing else of its conftest.
    (suite / "conftest.py").write_text("from tests.conftest import pytest_handlecrashitem, pytest_timeout_set_timer\n")
    (suite / "test_stuck.py").write_text(textwrap.dedent("""
        import threading
        import pytest

        @pytest.mark.timeout(2, method="thread")
        def test_stuck_waiting_for_a_peer():
            threading.Event().wait(60)

        def test_fine():
            pass
    """))
    run_tmp = tmp_path / "run"
    run_tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "ROBUSTDIST_TEST_RUN_TMP": str(run_tmp)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", str(suite)],
                         cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed" in out.stdout, out.stdout
    assert "crashed while running 'test_stuck.py::test_stuck_waiting_for_a_peer'" in out.stdout, out.stdout
    assert 'the test ran past its 2 s timeout (pytest-timeout, method "thread")' in out.stdout, out.stdout
    assert "in test_stuck_waiting_for_a_peer" in out.stdout, out.stdout  # the main thread's frame, from the dump
    assert Path(_timeouts.report_path(str(run_tmp), "test_stuck.py::test_stuck_waiting_for_a_peer")).is_file()


def test_a_crash_without_a_timeout_report_keeps_xdist_s_message(tmp_path):
    report = pytest.TestReport("t.py::test_x", ("t.py", None, "t.py"), {}, "failed", "worker 'gw0' crashed", "call")
    _timeouts.describe_crash(str(tmp_path), "t.py::test_x", report)
    assert report.longrepr == "worker 'gw0' crashed"
