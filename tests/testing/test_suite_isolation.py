"""The suite judges only what it made: a torchrun job and a Ray cluster started beside a pytest session of this
suite (outside its tree and its ``TMPDIR``, the shell pointing ``RAY_ADDRESS`` at that cluster) neither fail it
nor lose anything to it; a test that leaves a logger changed fails, naming it; under ``make test-fast`` a test
that starts a process without the ``processes`` marker fails, even if it swallowed the error. Each case runs the
tests of ``suite_isolation_client.py`` in a pytest session of its own, under ``tests/conftest.py``."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("suite_isolation_client.py")
PEERS = ROOT / "benchmarks" / "peers"


def _session(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=-ra --strict-markers",
           str(CLIENT.relative_to(ROOT)), *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ROBUSTDIST_TEST_", "PYTEST_"))}
    return subprocess.Popen(cmd, cwd=ROOT, env={**clean, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the inner session did not finish in {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def _torchrun_beside(script: Path) -> subprocess.Popen[bytes]:
    """A torchrun job of someone else's: TMPDIR=/tmp, so its log directory (torchelastic_*) goes to /tmp."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBUSTDIST_")}
    env.update(TMPDIR="/tmp", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                             str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_torchrun_job_and_a_ray_cluster_beside_the_suite_neither_fail_it_nor_lose_anything(tmp_path):
    sys.path.insert(0, str(PEERS))
    try:
        import _launch
    finally:
        sys.path.remove(str(PEERS))
    script, stop, flag = tmp_path / "job.py", tmp_path / "stop", tmp_path / "flag"
    run_id = tmp_path / "run-id"  # the job's, which names its log directory's entry: only that one is removed
    script.write_text(f"import os, time\nopen({str(run_id)!r}, 'w').write(os.environ['TORCHELASTIC_RUN_ID'])\n"
                      f"while not os.path.exists({str(stop)!r}):\n    time.sleep(0.2)\n")
    machine_tmp = tmp_path / "machine-tmp"  # the session's TMPDIR, as a shell's would be
    machine_tmp.mkdir()
    before = set(glob.glob("/tmp/torchelastic_*"))
    job = None
    made: list[str] = []
    try:
        with _launch.ray_cluster(cpus=1) as beside:
            address = beside.env["RAY_ADDRESS"]
            (machine_tmp / "ray").mkdir()
            (machine_tmp / "ray" / "ray_current_cluster").write_text(address)  # where `ray start` records it
            inner = _session(["-k", "beside or own_ray"], {"ISOLATION_FLAG": str(flag), "TMPDIR": str(machine_tmp),
                                                            "RAY_ADDRESS": address})
            job = _torchrun_beside(script)
            deadline = time.monotonic() + 120
            while not made and time.monotonic() < deadline and job.poll() is None:
                if run_id.exists() and run_id.read_text():
                    made = sorted({os.path.dirname(p) for p in glob.glob(f"/tmp/torchelastic_*/{run_id.read_text()}_*")}
                                  - before)
                time.sleep(0.2)
            assert made, "the torchrun job beside made no log directory in /tmp"
            flag.touch()
            code, out = _finish(inner)
            assert code == 0 and "2 passed" in out, out[-4000:]
            assert all(os.path.isdir(path) for path in made), "the session removed the job's log directory"
            assert job.poll() is None, "the job beside did not outlive the session"
            assert beside.env["RAY_ADDRESS"] == address and _launch.marked(beside.marker), "the cluster beside is gone"
            assert (machine_tmp / "ray" / "ray_current_cluster").read_text() == address
    finally:
        stop.touch()
        if job is not None:
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        for path in made:  # this test's own job's log directory, named by its run id
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_changed_logger_and_an_unmarked_process_in_the_fast_tier_fail_naming_the_fix():
    inner = _session(["-m", "not processes", "-k", "logger or starts_a_process"],
                     {"ROBUSTDIST_TEST_NO_PROCESSES": "1"})
    code, out = _finish(inner)
    # the two that fail after their call (in the check at their tear-down) count as errors, as pytest counts them
    assert code == 1 and "1 failed, 2 passed, 3 deselected, 2 errors" in out, out[-4000:]
    assert "logger 'robustdist.isolation_client': level NOTSET -> DEBUG" in out, out[-4000:]
    assert "test_starts_a_process_unmarked started a process" in out, out[-4000:]
    assert "Fix: mark the test @pytest.mark.processes" in out, out[-4000:]
    assert "test_starts_a_process_and_swallows_the_error started a process" in out, out[-4000:]
    assert "though it caught the error" in out, out[-4000:]


def test_the_torchrun_directory_check_looks_only_in_the_runs_own_directory(tmp_path):
    (tmp_path / "torchelastic_abc").mkdir()
    (tmp_path / "other").mkdir()
    assert conftest.escaped_torchrun_dirs(str(tmp_path)) == [str(tmp_path / "torchelastic_abc")]
    assert conftest.escaped_torchrun_dirs(str(tmp_path / "other")) == []
