"""Accelerate's ``nlp_example.py`` shape, ported (tests/clients/accelerate_nlp.py), under real torchrun on 2 CPU
ranks: harden composes with what ``accelerator.prepare`` returned, and ``robustdist.frameworks.accelerate``'s
``save_state``/``load_state`` resume the job bitwise after rank 1 is SIGKILLed mid-run, and after rank 0 is
SIGKILLed inside a save (the half-written checkpoint is never loaded). Harden before prepare is refused
(issue #32)."""

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

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "tests" / "clients" / "accelerate_nlp.py"
RUN_TIMEOUT = 300
STEPS = 9  # 3 epochs of 3 optimizer steps; checkpoints at 4 and 8


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


def _finish(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, tuple[int, str]]:
    outs = {}
    try:
        for tag, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                pytest.fail(f"torchrun ({tag}) did not finish within {RUN_TIMEOUT} s (killed):\n{out[-4000:]}")
            outs[tag] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return outs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("accelerate")
    where = {"straight": base / "s", "killed": base / "k", "in_save": base / "save"}
    deadline = time.monotonic() + RUN_TIMEOUT
    outs = _finish({"straight": _launch(where["straight"], "straight"),
                    "killed": _launch(where["killed"], "killed", "--kill-at", "7")}, deadline)
    deadline = time.monotonic() + RUN_TIMEOUT
    outs.update(_finish({"in_save": _launch(where["in_save"], "in_save", "--kill-in-save", "8")}, deadline))
    for tag, (code, out) in outs.items():
        assert code == 0, f"{tag}:\n{out[-4000:]}"
    result = {tag: [(json.loads((w / f"result-{tag}-rank{r}.json").read_text()),
                     torch.load(w / f"final-{tag}-rank{r}.pt", weights_only=True)) for r in range(2)]
              for tag, w in where.items()}
    return result, {tag: out for tag, (_, out) in outs.items()}


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_straight_run_composes_with_accelerate(runs):
    result, _ = runs
    for info, _ in result["straight"]:
        assert info["world"] == 2 and info["attempt"] == 0 and info["resumed_from"] is None
        assert info["steps"] == STEPS and len(info["losses"]) == STEPS and set(info["decisions"]) == {"ok"}
        assert info["wrapper"] == "DistributedDataParallel" and info["committed"] == [4, 8]
    assert tr.bitwise_equal(result["straight"][0][1], result["straight"][1][1])


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("tag", ["killed", "in_save"])
def test_a_kill_mid_run_or_inside_a_save_resumes_bitwise(runs, tag):
    result, outs = runs
    for rank in range(2):
        info, final = result[tag][rank]
        straight, reference = result["straight"][rank]
        assert info["attempt"] == 1 and info["resumed_from"] == 4, outs[tag][-3000:]
        assert info["losses"] == straight["losses"][4:]  # the same batches and dropout after the resume
        assert info["committed"] == [4, 8]
        assert tr.bitwise_equal(final, reference)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_harden_before_prepare_fails_at_once_naming_the_order(tmp_path):
    (code, out), = _finish({"order": _launch(tmp_path, "order", "--order", "harden-first")},
                           time.monotonic() + RUN_TIMEOUT).values()
    assert code != 0
    assert "harden() was given a bare Classifier while an Accelerator of 2 processes is in charge" in out
