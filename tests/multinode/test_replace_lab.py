"""``robustdist run`` across two lab nodes (network namespaces, one agent each, a private in-memory directory per
node), with the DDP-tutorial-shaped client (``tests/clients/ddp_tutorial_inprocess.py``):

* two ranks on two nodes SIGKILLed at once (2 nodes x 2 ranks), rank 0 one of them: each node's agent starts its dead
  worker again alone (node 0's agent serves the attempt's store, which outlives rank 0's process), both replacements
  join the survivors' next generation, the survivors' processes stay, and the result is bitwise that of an
  uninterrupted torchrun run;
* a whole node lost (its agent and its worker killed, its in-memory directory emptied) and a fresh agent started
  there: the agent's death takes torchrun's whole-node path (every worker restarted, as a membership change: torch
  counts no restart for it, so ``TORCHELASTIC_RESTART_COUNT`` stays 0; the dead node's rank restored from the replica
  its peer holds), bitwise too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests._torchrun import ROOT, finish as finish_host, launch, results, succeeded
from tests.multinode._lab import FAST_RDZV, STRAIGHT_EPOCHS, TUTORIAL as CLIENT, finish, logs, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.timeout(480)]
RUN = ("robustdist", "run")
SHARED = {"PYTHONPATH": str(ROOT)}  # the agent's store shared with the workers (torchrun's default)
ENV = {**SHARED, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # torch 2.13: a new agent can rejoin


def _events(work: Path, tag: str, rank: int) -> list[dict]:
    path = work / f"events-{tag}-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@contextlib.contextmanager
def _straight_beside(tmp_path: Path, nproc: int, *args: str) -> Iterator[Callable[[], list]]:
    """The same job without a fault on this host (``torchrun --standalone``), running beside the lab run (it shares
    no port or directory with it); yields a function that waits for it and returns its ``results()``. Its pacing
    (``--step-sleep``) is left out: it changes no parameter, only how long the run takes."""
    work = tmp_path / "straight"
    proc = launch(Path(CLIENT), work, "straight", *args, nproc=nproc)

    def wait() -> list:
        succeeded(finish_host({"straight": proc}, 240))
        return results(work, "straight", ranks=nproc)

    try:
        yield wait
    finally:
        if proc.poll() is None:  # the test failed before it waited: no process outlives it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _same(straight: list, work: Path, tag: str, ranks: int) -> list:
    ends = results(work, tag, ranks=ranks)
    for rank in range(ranks):
        (ref, ref_params), (res, params) = straight[rank], ends[rank]
        assert res["end"] == ref["end"], rank
        assert all(torch.equal(params[k], ref_params[k]) for k in ref_params), rank
    return ends


def _at_step_12(node_lab, tmp_path: Path, tag: str, shape: tuple[str, ...], *, nproc: int, launcher: tuple[str, ...],
                rdzv_conf: dict | None = None, env: dict | None = None):
    """Two lab nodes running the client under ``launcher`` (nproc ranks each), once rank 0 has done step 12."""
    lab = node_lab(2, local_disk=tmp_path / "node-local")
    work = tmp_path / "lab"
    work.mkdir()
    argv = ["--workdir", str(work), "--tag", tag, "--local-dir", str(tmp_path / "node-local" / "tier"), "--log-steps",
            *shape]
    agents = [lab.torchrun(i, CLIENT, argv, nproc=nproc, max_restarts=2, env=env or ENV, rdzv_conf=rdzv_conf,
                           launcher=launcher) for i in range(2)]
    wait_for(lambda: [e for e in _events(work, tag, 0) if e["event"] == "step" and e["step"] >= 12], 180,
             "step 12", lab=lab, procs=agents)
    return lab, work, argv, agents


def test_two_ranks_on_two_nodes_killed_at_once_are_each_replaced_alone(node_lab, tmp_path):
    epochs = ("--epochs", "8")  # 4 ranks: 4 steps an epoch, 32 steps
    with _straight_beside(tmp_path, 4, *epochs) as straight:
        lab, work, argv, agents = _at_step_12(node_lab, tmp_path, "two", (*epochs, "--step-sleep", "0.15"), nproc=2,
                                              launcher=(*RUN, "--spares", "0"), env=SHARED)
        doomed = {r: [e for e in _events(work, "two", r) if e["event"] == "start"][-1]["pid"] for r in (0, 3)}
        for pid in doomed.values():  # the same moment on both nodes (pids are the host's: the lab shares them)
            os.kill(pid, signal.SIGKILL)
        assert finish(agents, 300, lab) == [0, 0], logs(lab)
        ends = _same(straight(), work, "two", 4)
    for rank in (1, 2):  # the survivors: one process throughout, generations 0 and 1
        starts = [e for e in _events(work, "two", rank) if e["event"] == "start"]
        assert {e["pid"] for e in starts} == {ends[rank][0]["pid"]} and [e["generation"] for e in starts] == [0, 1]
    for rank in (0, 3):
        assert ends[rank][0]["pid"] != doomed[rank] and ends[rank][0]["attempt"] == 0
        starts = [e for e in _events(work, "two", rank) if e["event"] == "start"]
        assert starts[-1]["generation"] == 1 and starts[-1]["pid"] == ends[rank][0]["pid"], starts
    assert "this attempt's store is served by this agent" in lab.log("agent-n0"), logs(lab)
    for node, rank in ((0, 0), (1, 3)):
        log = lab.log(f"agent-n{node}")
        said = f"rank {rank} (local rank {rank % 2}, pid {doomed[rank]}) died (signal 9 (SIGKILL)); started it again"
        assert said + " alone" in log, logs(lab)
        assert "will restart worker group" not in log, logs(lab)


def test_a_lost_node_and_its_agent_take_the_whole_node_path(node_lab, tmp_path, straight_2_ranks):
    shape = ("--epochs", str(STRAIGHT_EPOCHS), "--step-sleep", "0.15")  # 2 ranks: 8 steps an epoch, 48 steps
    lab, work, argv, agents = _at_step_12(node_lab, tmp_path, "node", shape, nproc=1, launcher=RUN,
                                          rdzv_conf=FAST_RDZV)
    tier = tmp_path / "node-local" / "tier"
    lab.kill_node(1)
    assert agents[1].wait(timeout=15) == -9
    lab.exec(1, ["rm", "-rf", str(tier)])  # a replacement node: nothing in memory
    again = lab.torchrun(1, CLIENT, argv, max_restarts=2, env=ENV, rdzv_conf=FAST_RDZV, launcher=RUN,
                         name="agent-n1-again")
    assert finish([agents[0], again], 300, lab) == [0, 0], logs(lab)
    ends = _same(straight_2_ranks, work, "node", 2)
    starts = [e for e in _events(work, "node", 0) if e["event"] == "start"]  # node 0's worker restarted by its agent
    assert len({e["pid"] for e in starts}) == 2 and starts[-1]["pid"] == ends[0][0]["pid"], starts
    assert starts[-1]["generation"] == 0 and starts[-1]["step"] > 0, starts  # a fresh process, resumed
    assert "started it again alone" not in lab.log("agent-n0") + lab.log("agent-n1-again"), logs(lab)
