"""nanoGPT's ``train.py`` shape, ported (tests/clients/nanogpt_train.py), under real torchrun on 2 CPU ranks in
fp16 with a GradScaler: gradient accumulation, a prefetched batch across the save point, evaluation and the
best-loss checkpoint made collective. Run straight through, and with rank 1 SIGKILLed mid-run and the job
restarted by torchrun: the resumed run ends bitwise where the straight one does."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import _training as tr
from tests._torchrun import ROOT, finish, launch, results, succeeded

pytestmark = [pytest.mark.processes,
              pytest.mark.xdist_group("porting_nanogpt_runs")]  # one worker makes the runs both tests read

CLIENT = ROOT / "tests" / "clients" / "nanogpt_train.py"
RUN_TIMEOUT = 240
ITERS, KILL_AT = 12, 10  # checkpoints at 4 and 8: the restart resumes from 8


def _launch(workdir: Path, tag: str, *args: str) -> subprocess.Popen:
    return launch(CLIENT, workdir, tag, "--max-iters", str(ITERS), "--init-scale", str(2.0 ** 26), *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("nanogpt")
    logs = succeeded(finish({"straight": _launch(base, "straight"),
                             "killed": _launch(base / "k", "killed", "--kill-at", str(KILL_AT))}, RUN_TIMEOUT))
    return {"straight": results(base, "straight"), "killed": results(base / "k", "killed")}, logs


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
