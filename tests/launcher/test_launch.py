"""``robustdist run`` under an open-file limit its agent does not fit in (``ulimit -n 40``): it says so and runs
exactly as torchrun, where its agent (the attempt's store, the warm spare) would fail to serve or die."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from robustdist.launcher.launch import descriptors_needed

_WORKER = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"worker-{os.environ['RANK']}.json"), "w") as f:
    json.dump({"run": os.environ.get("ROBUSTDIST_RUN"), "store": os.environ.get("ROBUSTDIST_ATTEMPT_STORE")}, f)
"""


def test_the_limit_grows_with_the_local_workers_and_the_job():
    assert descriptors_needed("2") == (74, 2, 1) and descriptors_needed("8") == (104, 8, 1)
    assert descriptors_needed("8", "64") == (64 + 32 + 512, 8, 64)  # node 0's agent: a connection per worker
    assert descriptors_needed("4", "1:3") == (64 + 16 + 12, 4, 3)  # the most nodes the job may have
    cores = os.cpu_count() or 1
    assert descriptors_needed("cpu") == (64 + 5 * cores, cores, 1)  # as torchrun counts them
    assert descriptors_needed("²") == descriptors_needed("gpu") == (64 + 40, 8, 1)  # torchrun cannot: taken as 8


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_under_a_low_open_file_limit_it_says_so_and_runs_as_torchrun(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    done = subprocess.run(
        [sys.executable, "-m", "robustdist", "run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         str(script), str(tmp_path)], capture_output=True, text=True, timeout=90, cwd=tmp_path,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("ROBUSTDIST_")}, "ROBUSTDIST_RUN": "1"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("robustdist run: the open-file limit is 40 (ulimit -n); expected at least 74 for its agent (the attempt's "
            "store, the warm spare) with 2 local worker(s) on up to 1 node(s). Running exactly as torchrun: a killed worker "
            "restarts every worker. Fix: raise the limit (ulimit -n 1024 or more) before robustdist run.") in done.stderr
    assert "serves no store" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    for rank in range(2):  # torchrun's agent started both: none is told it runs under robustdist run (not even
        # by a ROBUSTDIST_RUN the launcher inherited)
        assert json.loads((tmp_path / f"worker-{rank}.json").read_text()) == {"run": None, "store": None}
