"""A Lightning ``Trainer`` + ``LightningModule`` script with robustdist's ``CheckpointIO`` plugin and ``Callback``
(tests/clients/lightning_trainer.py), under real torchrun on 2 CPU ranks: straight through, and with rank 1
SIGKILLed mid-epoch and the job restarted by torchrun, which resumes from ``last.ckpt`` (written and verified by
the plugin) and ends bitwise where the straight run ends. Lightning restarts an epoch's data from its start, so
the client checkpoints at epoch ends."""

from __future__ import annotations

import pytest

from tests import _training as tr
from tests._torchrun import ROOT, straight_and_killed

pytestmark = [pytest.mark.processes,
              pytest.mark.xdist_group("porting_lightning_runs")]  # one worker makes the runs both tests read

pytest.importorskip("lightning")

CLIENT = ROOT / "tests" / "clients" / "lightning_trainer.py"
RUN_TIMEOUT = 300
STEPS, KILL_AT, RESUMED_AT = 24, 20, 16  # 3 epochs of 8 steps per rank; checkpoints at 8, 16, 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return straight_and_killed(CLIENT, tmp_path_factory.mktemp("lightning"), KILL_AT, RUN_TIMEOUT)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_the_plugin_records_every_checkpoint_of_a_straight_run(runs):
    result, _ = runs
    for info, _ in result["straight"]:
        assert info["world"] == 2 and info["attempt"] == 0 and info["steps"] == STEPS and not info["resumed"]
        assert info["group_before_trainer"]  # the plugin made the group, robustdist's way, before the Trainer
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
        assert info["group_before_trainer"]
        assert info["losses"] == straight["losses"][RESUMED_AT:]  # the same batches after the resume
        assert tr.bitwise_equal(final, reference)
