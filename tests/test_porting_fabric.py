"""Lightning Fabric's image-classifier example shape, ported (tests/clients/fabric_image_classifier.py), under real
torchrun on 2 CPU ranks: harden composes with what ``fabric.setup`` returned, shards the plain train loader
itself, and ``h.resume`` continues mid-epoch after rank 1 is SIGKILLed, ending bitwise where the straight run
ends."""

from __future__ import annotations

import pytest

from tests import _training as tr
from tests._torchrun import ROOT, straight_and_killed

pytestmark = [pytest.mark.processes,
              pytest.mark.xdist_group("porting_fabric_runs")]  # one worker makes the runs both tests read

pytest.importorskip("lightning")

CLIENT = ROOT / "tests" / "clients" / "fabric_image_classifier.py"
RUN_TIMEOUT = 300
STEPS, PER_EPOCH, KILL_AT, RESUMED_AT = 18, 6, 11, 8  # 3 epochs of 6 steps per rank; checkpoints every 4 steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return straight_and_killed(CLIENT, tmp_path_factory.mktemp("fabric"), KILL_AT, RUN_TIMEOUT)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_straight_run_keeps_fabrics_ddp_and_trains(runs):
    result, _ = runs
    for info, _ in result["straight"]:
        assert info["world"] == 2 and info["attempt"] == 0 and info["resumed_from"] is None
        assert info["inner"] == "DistributedDataParallel" and info["per_epoch"] == PER_EPOCH
        assert info["steps"] == STEPS and set(info["decisions"]) == {"ok"}
        assert info["test_losses"][-1] < info["test_losses"][0]  # it learns
    assert tr.bitwise_equal(result["straight"][0][1], result["straight"][1][1])


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_rank_killed_mid_epoch_resumes_mid_epoch_bitwise(runs):
    result, logs = runs
    for rank in range(2):
        info, final = result["killed"][rank]
        straight, reference = result["straight"][rank]
        assert info["attempt"] == 1 and info["resumed_from"] == RESUMED_AT, logs["killed"][-3000:]
        assert info["losses"] == straight["losses"][RESUMED_AT:]  # the same batches and dropout, mid-epoch
        assert info["test_losses"] == straight["test_losses"][RESUMED_AT // PER_EPOCH:]
        assert info["lr"] == straight["lr"]
        assert tr.bitwise_equal(final, reference)
