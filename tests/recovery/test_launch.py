"""``robustdist run`` under an open-file limit its agent does not fit in (``ulimit -n 40``): it says so and runs
exactly as torchrun, where its agent (the attempt's store, the warm spare) would fail to serve or die."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from robustdist.recovery.launch import descriptors_needed

_WORKER = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"worker-{os.environ['RANK']}.json"), "w") as f:
    json.dump({"run": os.environ.get("ROBUSTDIST_RUN"), "store": os.environ.get("ROBUSTDIST_ATTEMPT_STORE")}, f)
"""


def test_the_limit_grows_with_the_local_workers():
    assert descriptors_needed("2") == 72 and descriptors_needed("8") == 96
    assert descriptors_needed("gpu") == descriptors_needed("auto") == 96  # unknown here: taken as 8


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_under_a_low_open_file_limit_it_says_so_and_runs_as_torchrun(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    done = subprocess.run(
        [sys.executable, "-m", "robustdist", "run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         str(script), str(tmp_path)], capture_output=True, text=True, timeout=90, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("ROBUSTDIST_")},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("robustdist run: the open-file limit is 40 (ulimit -n); expected at least 72 for its agent (the attempt's "
            "store, the warm spare) with 2 local worker(s). Running exactly as torchrun: a killed worker restarts "
            "every worker. Fix: raise the limit (ulimit -n 1024) before robustdist run.") in done.stderr
    assert "serves no store" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    for rank in range(2):  # torchrun's agent started both: none is told it runs under robustdist run
        assert json.loads((tmp_path / f"worker-{rank}.json").read_text()) == {"run": None, "store": None}
