"""Accelerate's ``nlp_example.py`` shape, ported (tests/clients/accelerate_nlp.py), under real torchrun on 2 CPU
ranks: harden composes with what ``accelerator.prepare`` returned, and ``robustdist.frameworks.accelerate``'s
``save_state``/``load_state`` resume the job bitwise after rank 1 is SIGKILLed mid-run, and after rank 0 is
SIGKILLed inside a save (the half-written checkpoint is never loaded). Harden before prepare is refused."""

from __future__ import annotations

import pytest

from tests import _training as tr
from tests._torchrun import ROOT, finish, launch, results, succeeded

pytestmark = pytest.mark.processes

pytest.importorskip("accelerate")

CLIENT = ROOT / "tests" / "clients" / "accelerate_nlp.py"
RUN_TIMEOUT = 300
BATCH_TIMEOUT = 2 * RUN_TIMEOUT  # the three runs at once share the machine's cores: a hang guard for all three
STEPS = 9  # 3 epochs of 3 optimizer steps; checkpoints at 4 and 8
SHARED = pytest.mark.xdist_group("porting_accelerate_runs")  # one worker makes the runs the tests of `runs` read


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight run, the run killed mid-run and the run killed inside a save, side by side: each kill is
    triggered by the run's own step, so running them at once changes nothing about when a rank dies."""
    base = tmp_path_factory.mktemp("accelerate")
    where = {"straight": base / "s", "killed": base / "k", "in_save": base / "save"}
    outs = finish({"straight": launch(CLIENT, where["straight"], "straight"),
                   "killed": launch(CLIENT, where["killed"], "killed", "--kill-at", "7"),
                   "in_save": launch(CLIENT, where["in_save"], "in_save", "--kill-in-save", "8")}, BATCH_TIMEOUT)
    logs = succeeded(outs)
    return {tag: results(w, tag) for tag, w in where.items()}, logs


@SHARED
@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_straight_run_composes_with_accelerate(runs):
    result, _ = runs
    for info, _ in result["straight"]:
        assert info["world"] == 2 and info["attempt"] == 0 and info["resumed_from"] is None
        assert info["steps"] == STEPS and len(info["losses"]) == STEPS and set(info["decisions"]) == {"ok"}
        assert info["wrapper"] == "DistributedDataParallel" and info["committed"] == [4, 8]
    assert tr.bitwise_equal(result["straight"][0][1], result["straight"][1][1])


@SHARED
@pytest.mark.timeout(BATCH_TIMEOUT + 60)
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
    # one attempt (no restart): a restarted attempt would only meet the same refusal again
    (code, out), = finish({"order": launch(CLIENT, tmp_path, "order", "--order", "harden-first", max_restarts=0)},
                          RUN_TIMEOUT).values()
    assert code != 0
    assert "harden() was given a bare Classifier while an Accelerator of 2 processes is in charge" in out
