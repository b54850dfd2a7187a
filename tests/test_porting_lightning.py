"""A Lightning ``Trainer`` + ``LightningModule`` script with robustdist's ``CheckpointIO`` plugin and ``Callback``
(tests/clients/lightning_trainer.py), under real torchrun on 2 CPU ranks: straight through, and with rank 1
SIGKILLed mid-epoch and the job restarted by torchrun, which resumes from ``last.ckpt`` (written and verified by
the plugin) and ends bitwise where the straight run ends. Lightning restarts an epoch's data from its start, so
the client checkpoints at epoch ends (issue #32)."""

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

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "tests" / "clients" / "lightning_trainer.py"
RUN_TIMEOUT = 300
STEPS, KILL_AT, RESUMED_AT = 24, 20, 16  # 3 epochs of 8 steps per rank; checkpoints at 8, 16, 24


def _launch(workdir: Path, tag: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(CLIENT), "--workdir", str(workdir), "--tag", tag, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lightning")
    where = {"straight": base / "s", "killed": base / "k"}
    procs = {"straight": _launch(where["straight"], "straight"),
             "killed": _launch(where["killed"], "killed", "--kill-at", str(KILL_AT))}
    deadline = time.monotonic() + RUN_TIMEOUT
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
    return {tag: [(json.loads((w / f"result-{tag}-rank{r}.json").read_text()),
                   torch.load(w / f"final-{tag}-rank{r}.pt", weights_only=True)) for r in range(2)]
            for tag, w in where.items()}, outs


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_the_plugin_records_every_checkpoint_of_a_straight_run(runs):
    result, _ = runs
    for info, _ in result["straight"]:
        assert info["world"] == 2 and info["attempt"] == 0 and info["steps"] == STEPS and not info["resumed"]
        assert info["records"] == ["epoch=0-step=8.ckpt.robustdist.json", "epoch=1-step=16.ckpt.robustdist.json",
                                   "epoch=2-step=24.ckpt.robustdist.json", "last.ckpt.robustdist.json"]
    assert tr.bitwise_equal(result["straight"][0][1], result["straight"][1][1])


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_rank_killed_mid_epoch_resumes_from_the_last_verified_checkpoint_bitwise(runs):
    result, outs = runs
    for rank in range(2):
        info, final = result["killed"][rank]
        straight, reference = result["straight"][rank]
        assert info["attempt"] == 1 and info["resumed"] and info["steps"] == STEPS, outs["killed"][-3000:]
        assert info["losses"] == straight["losses"][RESUMED_AT:]  # the same batches after the resume
        assert tr.bitwise_equal(final, reference)
