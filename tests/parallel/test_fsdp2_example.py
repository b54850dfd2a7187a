"""The pytorch/examples FSDP2 script, ported to harden() (tests/clients/fsdp2_example.py), under real torchrun.

Four runs of 2 CPU ranks, two at a time: straight through (A), stopped after a checkpoint (B1) and resumed by
a second invocation (B2), and with --mixed-precision (C). Every run has a hard timeout; on expiry its whole
process group (torchrun and its workers) is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.processes,
              pytest.mark.xdist_group("fsdp2_example_runs")]  # one worker makes the runs every test reads

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "clients" / "fsdp2_example.py"
RUN_TIMEOUT = 150
STEPS, STOP = 6, 3


def _launch(workdir: Path, tag: str, *args: str) -> subprocess.Popen:
    own_tmp = workdir.parent / f"tmp-{tag}"  # torchrun's log directory (torchelastic_*), which it leaves behind: here,
    own_tmp.mkdir(parents=True, exist_ok=True)  # not in /tmp (a module fixture runs before the tests' own TMPDIR)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(own_tmp)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(CLIENT),
           "--workdir", str(workdir), "--steps", str(STEPS), "--every", str(STOP), "--tag", tag, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, deadline: float) -> str:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {RUN_TIMEOUT} s (killed):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def _pair(*runs: tuple[Path, str, tuple[str, ...]]) -> dict[str, dict]:
    deadline = time.monotonic() + RUN_TIMEOUT
    procs = [_launch(workdir, tag, *args) for workdir, tag, args in runs]
    try:
        for proc in procs:
            _finish(proc, deadline)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return {tag: json.loads((workdir / f"result-{tag}.json").read_text()) for workdir, tag, _ in runs}


@pytest.fixture(scope="module")
def results(tmp_path_factory, _gloo_averages):
    if not _gloo_averages:
        pytest.skip("this torch's gloo reduce-scatter sums for ReduceOp.AVG (pytorch#162338): FSDP2 cannot train on "
                    "the CPU here, and wrap_fsdp refuses it")
    base = tmp_path_factory.mktemp("fsdp2")
    out = _pair((base / "a", "a", ()), (base / "b", "b1", ("--stop-at", str(STOP))))
    out.update(_pair((base / "b", "b2", ()), (base / "c", "c", ("--mixed-precision",))))
    return out


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_it_trains_sharded_per_layer(results):
    a = results["a"]
    assert (a["start"], a["end"], a["world"]) == (0, STEPS, 2)
    assert a["finite"] and len(a["losses"]) == STEPS
    assert a["initial"] != a["final"]  # the parameters changed
    assert a["fsdp_modules"] == ["<root>", "layers.0", "layers.1"]  # each block has its own fully_shard
    assert a["forward_dtype"] == ["torch.float32"]


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_a_second_invocation_resumes_bitwise(results):
    a, b1, b2 = results["a"], results["b1"], results["b2"]
    assert (b1["start"], b1["end"], b2["start"], b2["end"]) == (0, STOP, STOP, STEPS)
    assert b1["initial"] == a["initial"] and b2["initial"] is None
    assert b1["losses"] + b2["losses"] == a["losses"]
    assert b2["final"] == a["final"]


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_mixed_precision_runs_bf16_in_forward_and_trains(results):
    c = results["c"]
    assert c["forward_dtype"] == ["torch.bfloat16"] and c["param_dtype"] == "torch.float32"
    assert c["finite"] and c["initial"] != c["final"] and c["initial"] == results["a"]["initial"]
    assert c["fsdp_modules"] == ["<root>", "layers.0", "layers.1"]
