"""In-process recovery under real ``torchrun``, with a client in the shape of the pytorch/examples DDP tutorial
(``tests/clients/ddp_tutorial_inprocess.py``): a fault recovers in the same worker processes, bitwise, without a
restart by torchrun; a deterministic fault escalates to torchrun's restarts, and the restart-loop guard then stops
the job, naming the fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._torchrun import ROOT, finish, launch, results, shared_straight, succeeded

pytestmark = [pytest.mark.processes, pytest.mark.timeout(420)]
CLIENT = ROOT / "tests" / "clients" / "ddp_tutorial_inprocess.py"


def _events(workdir: Path, tag: str, rank: int) -> list[dict]:
    path = workdir / f"events-{tag}-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(660)
def test_a_fault_under_torchrun_recovers_in_the_same_processes_bitwise(tmp_path, tmp_path_factory):
    """rank 1 raises at step 11: both ranks recover in process and end bitwise as the session's shared straight run."""
    straight = shared_straight(tmp_path_factory, CLIENT, timeout=300)  # made here or awaited; its own run follows
    logs = succeeded(finish({"fault": launch(CLIENT, tmp_path / "f", "fault", "--fault", "1:11")}, 300))
    got = {"straight": results(straight, "straight"), "fault": results(tmp_path / "f", "fault")}
    for rank in range(2):
        (ref, ref_params), (res, params) = got["straight"][rank], got["fault"][rank]
        assert res["end"] == ref["end"] == 24, logs["fault"][-3000:]
        assert res["attempt"] == 0  # torchrun restarted nothing
        assert params.keys() == ref_params.keys() and all(torch.equal(params[k], ref_params[k]) for k in params)
        starts = [e for e in _events(tmp_path / "f", "fault", rank) if e["event"] == "start"]
        # generation 0 from the start; generation 1 from step 10, the in-memory copy before the fault at step 11
        # (the durable tier's newest is step 8), in the process that started the run
        assert [(e["attempt"], e["generation"], e["step"]) for e in starts] == [(0, 0, 0), (0, 1, 10)], starts
        assert {e["pid"] for e in starts} == {res["pid"]}
    assert "recovering in process as generation 1" in logs["fault"]


def test_a_deterministic_fault_escalates_and_the_restart_loop_guard_then_stops_the_job(tmp_path):
    """rank 1 raises at step 3 in every generation; health.max_restarts_without_progress=2, torchrun
    --max-restarts=3. Attempt 0 makes progress (steps 1, 2), then recovers in process once and escalates on the
    second fault after resuming step 2; attempts 1 and 2 fault twice each from step 2 and escalate; attempt 3, one
    torchrun still allows, is stopped by the restart-loop guard at its resume (it trains no step), on every rank,
    naming the fault. Without the guard attempt 3 would start generations (3, 0, 2) and (3, 1, 2) instead."""
    work = tmp_path / "d"
    outs = finish({"loop": launch(CLIENT, work, "loop", "--fault", "1:3", "--always", "--max-no-progress", "2",
                                  max_restarts=3)}, 360)
    code, out = outs["loop"]
    assert code != 0, out[-3000:]
    for rank in range(2):
        events = _events(work, "loop", rank)
        starts = [(e["attempt"], e["generation"], e["step"]) for e in events if e["event"] == "start"]
        assert starts == [(0, 0, 0), (0, 1, 2), (0, 2, 2), (1, 0, 2), (1, 1, 2), (2, 0, 2), (2, 1, 2)], out[-3000:]
        for attempt in range(3):  # each attempt's generations ran in one process
            assert len({e["pid"] for e in events if e["attempt"] == attempt}) == 1
        stopped = [e for e in events if e["event"] == "guard"]
        assert stopped and min(e["attempt"] for e in stopped) == 3, events
        first = next(e for e in stopped if e["attempt"] == 3)
        assert "2 restart attempts in a row (1, 2) resumed from step 2" in first["message"], first["message"]
        assert "ValueError: boom at step 3" in first["message"], first["message"]
        assert not [e for e in events if e["event"] == "done"]
