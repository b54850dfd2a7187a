"""In-process recovery across two lab nodes (network namespaces, one torchrun agent and one rank each, a private
in-memory directory per node), with the DDP-tutorial-shaped client (``tests/clients/ddp_tutorial_inprocess.py``):

* an exception on node 1's rank recovers in the same worker processes, bitwise equal to a straight run;
* node 1's link goes down mid-training and comes back once rank 0 has declared rank 1 faulty, 5 s after the cut at
  the earliest (a partition that heals: packets vanish, nothing is reset): rank 0 sees rank 1's heartbeats stop
  (stale after 3 s, before its own hang verdict at 4 s) and declares the fault, rank 0 gets out of its collective
  at once, rank 1 learns of it when its link is back, and both recover in process, bitwise, with torchrun
  restarting nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests._torchrun import ROOT, results
from tests.multinode._lab import STRAIGHT_EPOCHS as EPOCHS, TUTORIAL as CLIENT, finish, logs, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.timeout(420)]


def _events(work: Path, tag: str, rank: int) -> list[dict]:
    path = work / f"events-{tag}-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _in_lab(node_lab, tmp_path: Path, tag: str, *args: str):
    lab = node_lab(2, local_disk=tmp_path / "node-local")
    work = tmp_path / tag
    work.mkdir()
    argv = ["--workdir", str(work), "--tag", tag, "--epochs", str(EPOCHS), "--local-dir",
            str(tmp_path / "node-local" / "tier"), *args]
    agents = [lab.torchrun(i, CLIENT, argv, env={"PYTHONPATH": str(ROOT)}) for i in range(2)]
    return lab, work, agents


def _same_as_straight(work: Path, tag: str, straight: list, lab) -> None:
    for rank in range(2):
        (ref, ref_params), (res, params) = straight[rank], results(work, tag)[rank]
        assert res["end"] == ref["end"] == EPOCHS * 8 and res["attempt"] == 0  # torchrun restarted nothing
        assert all(torch.equal(params[k], ref_params[k]) for k in ref_params), rank
        starts = [e for e in _events(work, tag, rank) if e["event"] == "start"]
        assert [e["generation"] for e in starts] == [0, 1], (starts, logs(lab))
        assert {e["pid"] for e in starts} == {res["pid"]}  # the same worker process throughout


def test_an_exception_on_node_1_recovers_in_process_across_nodes_bitwise(node_lab, tmp_path, straight_2_ranks):
    lab, work, agents = _in_lab(node_lab, tmp_path, "fault", "--fault", "1:11")
    assert finish(agents, 240, lab) == [0, 0], logs(lab)
    _same_as_straight(work, "fault", straight_2_ranks, lab)
    starts = [e for e in _events(work, "fault", 1) if e["event"] == "start"]
    assert starts[1]["step"] == 10  # the in-memory copy of the step before the fault


def test_a_partition_that_heals_recovers_in_process_bitwise(node_lab, tmp_path, straight_2_ranks):
    shape = ("--step-sleep", "0.2", "--local-every", "4")  # the cut lands in a step, not in a save's arrival check
    lab, work, agents = _in_lab(node_lab, tmp_path, "cut", "--hang-timeout", "4", "--log-steps", *shape)
    # step 13 is done (no save after it): the cut lands in step 14's forward, so its all-reduce is what waits
    wait_for(lambda: [e for e in _events(work, "cut", 0) if e["event"] == "step" and e["step"] >= 13], 120,
             "step 13", lab=lab, procs=agents)
    lab.link_down(1)
    cut = time.time()
    # The link stays down until rank 0 has declared rank 1 faulty (its heartbeats stale after 3 s) and past both
    # ranks' hang verdicts (4 s), well inside the decision bound (60 s).
    wait_for(lambda: "rank 0 found rank(s) [1] faulty in generation 0" in lab.log("agent-n0"), 60,
             "rank 0 to declare rank 1 faulty", lab=lab, procs=agents)
    time.sleep(max(0.0, cut + 5 - time.time()))
    healed = time.time()  # generation 1 can start only after this: rank 1 answers once its link is back
    lab.link_up(1)
    assert finish(agents, 240, lab) == [0, 0], logs(lab)
    _same_as_straight(work, "cut", straight_2_ranks, lab)
    log = lab.log("agent-n0")
    assert "recovering in process as generation 1" in log, logs(lab)
    for rank in range(2):  # generation 1 resumed a step from before the cut, once the link was back
        events = _events(work, "cut", rank)
        before = max(e["step"] for e in events if e["event"] == "step" and e["time"] < cut)
        start = [e for e in events if e["event"] == "start"][1]
        assert before - 4 <= start["step"] <= before and start["time"] > healed, (start, before)
