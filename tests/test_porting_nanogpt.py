"""nanoGPT's ``train.py`` shape, ported (tests/clients/nanogpt_train.py), under real torchrun on 2 CPU ranks in
fp16 with a GradScaler: gradient accumulation, a prefetched batch across the save point, evaluation and the
best-loss checkpoint made collective. Run straight through, and with rank 1 SIGKILLed mid-run and the job
restarted by torchrun: the resumed run ends bitwise where the straight one does (issue #32)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import _training as tr

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "tests" / "clients" / "nanogpt_train.py"
RUN_TIMEOUT = 240
ITERS, KILL_AT = 12, 10  # checkpoints at 4 and 8: the restart resumes from 8


def _launch(workdir: Path, tag: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(CLIENT), "--workdir", str(workdir), "--tag", tag, "--max-iters", str(ITERS),
           "--init-scale", str(2.0 ** 26), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("nanogpt")
    (base / "k").mkdir()
    deadline = time.monotonic() + RUN_TIMEOUT
    procs = {"straight": _launch(base, "straight"), "killed": _launch(base / "k", "killed", "--kill-at", str(KILL_AT))}
    outs = {}
    try:
        for tag, proc in procs.items():
            try:
                outs[tag], _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                pytest.fail(f"torchrun ({tag}) did not finish within {RUN_TIMEOUT} s (killed):\n{out[-4000:]}")
            assert proc.returncode == 0, f"{tag}:\n{outs[tag][-4000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    result = {}
    for tag, where in (("straight", base), ("killed", base / "k")):
        result[tag] = [(json.loads((where / f"result-{tag}-rank{r}.json").read_text()),
                        torch.load(where / f"final-{tag}-rank{r}.pt", weights_only=True)) for r in range(2)]
    return result, outs


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_straight_run_trains_in_fp16_and_leaves_overflows_to_the_scaler(runs):
    result, _ = runs
    for info, _ in result["straight"]:
        assert info["world"] == 2 and info["attempt"] == 0 and info["resumed_from"] is None
        assert len(info["losses"]) == ITERS
        assert info["overflows"] >= 1 and info["decisions"].count("overflow") == info["overflows"]
        assert set(info["decisions"]) <= {"ok", "overflow"}
        assert info["scale"] < 2.0 ** 26  # the scaler backed off: it, not the guard, handled the overflows
    assert result["straight"][0][0]["decisions"] == result["straight"][1][0]["decisions"]
    assert tr.bitwise_equal(result["straight"][0][1], result["straight"][1][1])


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_rank_killed_mid_run_resumes_and_ends_bitwise_where_the_straight_run_ends(runs):
    result, outs = runs
    for rank in range(2):
        info, final = result["killed"][rank]
        straight, reference = result["straight"][rank]
        assert info["attempt"] == 1 and info["resumed_from"] == 8, outs["killed"][-3000:]
        assert info["losses"] == straight["losses"][8:]  # the same batches, dropout and scale after the resume
        assert info["scale"] == straight["scale"]
        assert tr.bitwise_equal(final, reference)
