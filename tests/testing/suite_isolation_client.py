"""Tests that ``tests/testing/test_suite_isolation.py`` runs in a pytest session of their own, under the project's
``tests/conftest.py``: not collected by the suite itself (the file name does not start with ``test_``)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest


def test_waits_while_a_job_runs_beside():
    """Holds the session open until the test outside says its torchrun job (beside this session) has made its
    log directory."""
    flag = Path(os.environ["ISOLATION_FLAG"])
    deadline = time.monotonic() + 120
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert flag.exists(), "the job beside never started"


def test_its_own_ray_cluster(ray_cluster):
    assert ray_cluster.cluster_resources().get("CPU") == 2  # the suite's cluster, not the one beside (1 CPU)
    assert os.environ["RAY_TMPDIR"].startswith(os.environ["ROBUSTDIST_TEST_RUN_TMP"])


def test_leaves_a_logger_level_changed():
    logging.getLogger("robustdist.isolation_client").setLevel(logging.DEBUG)


def test_starts_a_process_unmarked():
    subprocess.run(["true"], check=True)


def test_starts_a_process_and_swallows_the_error():
    try:
        subprocess.run(["true"], check=True)
    except Exception:
        pass


@pytest.mark.processes
def test_starts_a_process_marked():
    subprocess.run(["true"], check=True)
