"""A lost node under elastic sizing (``--nnodes=1:2``): the job continues on the node that is left.

The world-size-change rule (docs/multinode.md): each surviving rank restores its own RNG state, the
state of ranks that no longer exist is not used, and the loader's interrupted epoch restarts from its
beginning with a warning (its batches per epoch changed with the world size); a rank that did not exist at
the save is reseeded from (step, rank).
"""

from __future__ import annotations

import pytest

from tests.multinode._lab import FAST_RDZV, JOB, events, finish, job_args, logs, of, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


def test_a_node_lost_for_good_shrinks_the_job_and_it_resumes(node_lab, tmp_path):
    lab = node_lab(2)
    ev, ckpt = tmp_path / "events", tmp_path / "ckpt"
    args = job_args(ev, ckpt=ckpt, steps=60, every=5, step_sleep=0.15)
    agents = [lab.torchrun(i, JOB, args, nnodes="1:2", max_restarts=2, rdzv_conf=FAST_RDZV) for i in range(2)]
    saved = wait_for(lambda: [e["step"] for e in of(events(ev), "step") if e["saved"] and e["step"] >= 10], 120,
                     "a committed checkpoint at step 10", lab=lab, procs=agents)
    lab.kill_node(1)  # node 1 is gone for good: its agent dies too and nothing restarts it
    assert finish([agents[0]], 150, lab) == [0], logs(lab)
    evs = events(ev)
    starts = of(evs, "start")
    first, later = [s for s in starts if s["world"] == 2], [s for s in starts if s["world"] == 1]
    assert {s["rank"] for s in first} == {0, 1} and all(s["resumed"] is None for s in first)
    assert len(later) == 1, f"expected one restarted rank at world size 1: {starts}"
    again = later[0]
    assert again["rank"] == 0 and again["group_rank"] == "0"
    assert again["attempt"] >= 1, "the restart must not look like a fresh run"
    assert again["resumed"] is not None and again["resumed"] >= min(saved) and again["resumed"] % 5 == 0, again
    done = of(evs, "done")
    assert [d["step"] for d in done] == [60] and done[0]["pid"] == again["pid"]
    node0 = lab.log("agent-n0")
    # The rule, as it happened: the loader's epoch restarts (world size changed), rank 0's own RNG is
    # restored (no reseed warning for it).
    assert "(a different dataset, batch size or world size); the interrupted epoch restarts" in node0
    assert "rank 0 has no saved RNG state" not in node0
