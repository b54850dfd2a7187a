"""In-process recovery inside Ray Train V2 workers, for real on the session's local Ray cluster (2 CPUs):
with ``recovery.in_process: true`` the first ``harden`` gives up Ray's process group for robustdist's own
(``robustdist.ray.group``), so a worker's exception is recovered in the same worker processes: Ray's controller
never sees it (``FailureConfig(max_failures=0)``: any exception reaching it fails the run), and the result is
bitwise equal to the same job run without a fault (``reference``, tests/ray/conftest.py: Ray's own group, no
in-process recovery). The training code is ``tests/clients/ray_train_v2.py``'s
``train_fn_inprocess``, in the shape of Ray's regression example."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.clients import ray_train_v2 as client
from tests.ray.conftest import REFERENCE

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1200, method="thread")]


@pytest.fixture(scope="module")
def ray_v2(ray_cluster):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(client)
    return ray_cluster


def _config(tmp_path, name, **extra):
    out = tmp_path / name
    out.mkdir()
    return {"out": str(out), "ckpt": str(tmp_path / name / "ckpt"), "local_dir": str(tmp_path / name / "shm"),
            **REFERENCE, **extra}


def _fit(tmp_path, config, name, **kwargs):
    return client.trainer(config, storage=str(tmp_path / "ray"), name=name, max_failures=0,
                          train_fn=client.train_fn_inprocess, **kwargs).fit()


def _fit_restarted(tmp_path, config, name, restarts=1):
    """A fit that Ray may restart ``restarts`` times (``max_failures``); returns what its controller saw the
    workers raise."""
    errors = tmp_path / "controller-errors.jsonl"
    result = client.trainer(config, storage=str(tmp_path / "ray"), name=name, max_failures=restarts,
                            train_fn=client.train_fn_inprocess, callbacks=[client.ErrorLog(str(errors))]).fit()
    assert result.error is None, result.error
    return [json.loads(line) for line in errors.read_text().splitlines()]


def _assert_bitwise(config, reference):
    final = torch.load(os.path.join(config["out"], "final.pt"), weights_only=True)
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), f"{key} differs from the run without a fault"


def _generations(config):
    with open(os.path.join(config["out"], "generations.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def in_place(ray_v2, tmp_path_factory):
    """One fit with two faults, each recovered in the same workers (``max_failures=0``): rank 1 raises before the
    backward of step 5 (generation 1 resumes step 4), then cannot stage its files for the report of step 6
    (generation 2 resumes step 6). Its config, result, and what Ray's controller saw (nothing: no file)."""
    tmp_path = tmp_path_factory.mktemp("in-place")
    faulted = _config(tmp_path, "faulted", raise_at=5, stage_raise_at=6)
    errors = tmp_path / "controller-errors.jsonl"
    result = _fit(tmp_path, faulted, "faulted", callbacks=[client.ErrorLog(str(errors))])
    return faulted, result, errors


def _assert_in_place(faulted, result, errors, reference):
    """What both of the fit's faults must leave: a run Ray never saw fail, in the same workers, bitwise."""
    assert result.error is None, result.error
    assert not errors.exists(), errors.read_text()  # Ray's controller never saw either exception
    assert result.metrics["step"] == 9
    rows = _generations(faulted)
    for rank in range(2):
        mine = [r for r in rows if r["rank"] == rank]
        assert [(r["generation"], r["resumed"]) for r in mine] == [(0, 0), (1, 4), (2, 6)], mine
        assert len({r["pid"] for r in mine}) == 1, mine  # the same worker process: Ray restarted nothing
        assert all(r["created"] and str(r["port"]) != r["ray_port"] for r in mine), mine  # robustdist's own group
        assert all((r["source"], r["from_process"]) == ("memory", True) for r in mine[1:]), mine
        assert open(os.path.join(faulted["out"], f"recoveries-{rank}")).read() == "2"
    _assert_bitwise(faulted, reference)


@pytest.mark.processes
def test_a_worker_exception_recovers_in_the_same_ray_workers_bitwise(in_place, reference):
    """Rank 1 raises before the backward of step 5 (rank 0 is then in DDP's all-reduce): generation 1 of the
    same workers resumes step 4 from the in-memory tier (``in_place``'s first fault)."""
    _assert_in_place(*in_place, reference)


@pytest.fixture(scope="module")
def restarted(ray_v2, tmp_path_factory):
    """One fit with two faults that each go to Ray's restart (``max_failures=2``): in Ray's first worker group rank
    1 raises ``MemoryError`` before the backward of step 5; in the group Ray restarted, Ray's report of step 6
    raises on rank 1. Its config, and what Ray's controller saw the workers raise."""
    tmp_path = tmp_path_factory.mktemp("restarted")
    faulted = _config(tmp_path, "restarted", fatal_at=5, report_raise_at=6)
    return faulted, _fit_restarted(tmp_path, faulted, "restarted", restarts=2)


def _groups(config, rank):
    """``rank``'s rows, one per worker group Ray started: each gave up Ray's group, generation 0 of its own."""
    mine = [r for r in _generations(config) if r["rank"] == rank]
    assert [r["generation"] for r in mine] == [0, 0, 0] and len({r["pid"] for r in mine}) == 3, mine  # Ray's restarts
    assert all(r["created"] for r in mine), mine
    return mine


@pytest.mark.processes
def test_a_fault_that_must_not_be_recovered_in_place_goes_to_ray_s_restart_which_takes_over_again(reference,
                                                                                                   restarted):
    """``restarted``'s first fault: the ``MemoryError`` reaches Ray's controller (once: the second entry is the
    second fault's), and the group Ray restarts resumes from the in-memory tier's copy on this node. The
    controller shows the first error it polls: rank 1's own, or rank 0's, which names rank 1's."""
    faulted, seen = restarted
    memory_error = "MemoryError: out of memory before the backward of step 5 (simulated)"
    assert len(seen) == 2 and "MemoryError" not in json.dumps(seen[1]), seen
    named = seen[0].get("0", "")  # rank 0's: "... a declared fault (generation 0: rank 1 (node 0 ...): <its error>)"
    assert seen[0].get("1") == memory_error or ("rank 1 (node 0" in named and memory_error in named), seen
    for rank in range(2):
        mine = _groups(faulted, rank)
        # generation 0 in Ray's first worker group, then generation 0 again in the group Ray restarted (new
        # processes), which gave up Ray's new group too and resumed from the in-memory tier's copy on this node
        assert [r["resumed"] for r in mine[:2]] == [0, 4], mine
        assert mine[1]["source"] == "memory", mine
    _assert_bitwise(faulted, reference)


def test_prepare_leaves_the_topology_alone_outside_ray_or_without_in_process():
    from robustdist.config.schema import resolve_config
    from robustdist.ray import group
    from robustdist.runtime.topology import detect_topology

    topo = detect_topology(environ={})
    assert group.prepare(resolve_config({"recovery": {"in_process": True}, "checkpoint": {"dir": "/x"}}), topo) is topo
    ray_topo = __import__("dataclasses").replace(topo, launcher="ray_train")
    assert group.prepare(resolve_config({}), ray_topo) is ray_topo  # in-process recovery off: Ray's group stays
    on = resolve_config({"recovery": {"in_process": True}, "checkpoint": {"dir": "/x"}})
    assert group.prepare(on, ray_topo) is ray_topo  # no group of Ray's to give up (none is up in this process)
    assert group.taken() is None


def _reasons(rank):
    """What keeps a gloo group of Ray's: each case's reason (a one-rank gloo group stands in for Ray's)."""
    from torch import nn

    from robustdist.config.schema import resolve_config
    from robustdist.ray import group
    from robustdist.runtime.topology import detect_topology

    topo = detect_topology()
    on = {"recovery": {"in_process": True}, "checkpoint": {"dir": "/x"}}
    out = {"plain": group._why_not(resolve_config(on), topo, None),
           "fsdp": group._why_not(resolve_config({**on, "distributed": {"strategy": "fsdp"}}), topo, None),
           "nccl": group._why_not(resolve_config({**on, "distributed": {"backend": "nccl"}}), topo, None),
           "accelerate": group._why_not(resolve_config(on), topo, "accelerate")}
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    out["ddp"] = group._why_not(resolve_config(on), topo, None)
    del ddp
    return out


@pytest.mark.processes
def test_only_a_gloo_group_with_ddp_harden_makes_is_given_up():
    from robustdist.testing.ranks import run_ranks

    [reasons] = run_ranks(_reasons, 1, timeout=60)
    assert reasons["plain"] is None
    assert "distributed.strategy is fsdp" in reasons["fsdp"]
    assert "distributed.backend 'nccl' is not gloo" in reasons["nccl"]
    assert "accelerate made the model's DDP" in reasons["accelerate"]
    assert "a DistributedDataParallel module made on it exists" in reasons["ddp"]


def _alone(rank, who):
    """Only rank ``who`` tries to give up the group (the other never calls harden): its bounded error."""
    import time

    from robustdist.config.schema import resolve_config
    from robustdist.ray import group
    from robustdist.runtime.errors import InitError
    from robustdist.runtime.topology import detect_topology

    if rank != who:
        time.sleep(6)
        return ""
    config = resolve_config({"recovery": {"in_process": True}, "checkpoint": {"dir": "/x"},
                             "distributed": {"init_timeout": 2}})
    start = time.monotonic()
    try:
        group._take_over(config, detect_topology())
    except InitError as e:
        return str(e), time.monotonic() - start, group.taken()
    return "no error"


@pytest.mark.processes
@pytest.mark.parametrize("who", [0, 1])
def test_a_rank_that_never_takes_part_is_named_within_the_init_timeout(who):
    from robustdist.testing.ranks import run_ranks

    message, seconds, taken = run_ranks(_alone, 2, args=(who,), timeout=60)[who]
    assert seconds < 10 and taken is None, (seconds, taken)
    assert message.startswith(f"[rank {who}]") and "within 2 s (distributed.init_timeout)" in message, message
    assert ("rank 1 did not read robustdist's group address" if who == 0 else
            "rank 0 did not publish robustdist's group address") in message, message
    assert "expected" in message and "Fix: call harden() in every worker's training function with the same " \
        "configuration" in message, message


@pytest.mark.processes
def test_a_fault_while_another_rank_waits_in_ray_train_report_escalates_at_once_and_resumes_bitwise(reference,
                                                                                                     restarted):
    """Ray's ``ray.train.report`` of step 6 raises on rank 1 (an upload that failed, say) while rank 0 waits in
    Ray's report barrier, which nothing of robustdist can interrupt: rank 0 cannot join an in-process recovery. Its
    fault watch says so for it ("escalate (waiting in ray.train.report)"), so rank 1 escalates at once (not after
    the decision bound, where it would read a plain "escalate"), Ray restarts the worker group once more, and the
    run resumes bitwise (``restarted``'s second fault, in the group Ray restarted after its first)."""
    faulted, seen = restarted
    assert seen[1:] == [{"1": "OSError: Ray's report of step 6 failed (simulated)"}], seen
    first = {}  # each rank's log from the worker group the fault was in
    for rank in range(2):
        mine = _groups(faulted, rank)
        assert mine[2]["resumed"] == 6 and mine[2]["source"] == "memory", mine
        first[rank] = (Path(faulted["out"]) / f"log-{rank}-{mine[1]['pid']}.txt").read_text()
    assert "waits in ray.train.report, which robustdist cannot interrupt" in first[0], first[0]
    assert "did not recover (escalate (waiting in ray.train.report))" in first[1], first[1]
    _assert_bitwise(faulted, reference)


@pytest.mark.processes
def test_a_worker_stuck_in_a_transfer_the_teardown_cannot_end_hands_its_error_to_ray_and_resumes_bitwise(reference,
                                                                                                          tmp_path):
    """Rank 1 stops (8 s) while rank 0's 200 MB point-to-point send to it is under way (in the generation before
    any recovery): rank 0 finds rank 1's heartbeats stopped, shuts the group's connections down, and stays blocked
    in the send (gloo does not end it); rank 1, continued, stays blocked in its receive the same way. Each such
    rank is judged stuck and its error handed to Ray's controller, which shows what it received first (either rank
    or both, by timing) and restarts the worker group once; the run resumes bitwise."""
    faulted = _config(tmp_path, "stuck", stuck_at=5)
    seen = _fit_restarted(tmp_path, faulted, "stuck")
    assert len(seen) == 1 and seen[0] and set(seen[0]) <= {"0", "1"}, seen
    for rank, error in seen[0].items():
        assert error.startswith(f"RecoveryError: [rank {rank}] in-process recovery generation 0: this rank's "
                                "training thread is still blocked in send_to_a_stopping_peer (ray_train_v2.py:"), seen
    rows = _generations(faulted)
    for rank in range(2):
        mine = [r for r in rows if r["rank"] == rank]
        assert [r["generation"] for r in mine] == [0, 0] and mine[0]["pid"] != mine[1]["pid"], mine  # Ray's restart
        assert mine[1]["resumed"] == 4 and mine[1]["source"] == "memory", mine
    _assert_bitwise(faulted, reference)


@pytest.mark.processes
def test_a_rank_whose_files_for_ray_cannot_be_staged_is_a_fault_recovered_in_the_same_workers_bitwise(in_place,
                                                                                                        reference):
    """Rank 1 cannot stage its files for the report of step 6 (a full disk, say). Every rank learns it in
    robustdist's own collective before Ray's barrier, so none waits there: every rank raises the same error naming
    rank 1, which is a fault like any other, recovered in the same workers (Ray's controller sees nothing) from
    the in-memory tier, bitwise (``in_place``'s second fault, in the generation that recovered from its first)."""
    faulted = in_place[0]
    _assert_in_place(*in_place, reference)
    rows = _generations(faulted)
    for rank in range(2):
        mine = [r for r in rows if r["rank"] == rank]
        log = (Path(faulted["out"]) / f"log-{rank}-{mine[0]['pid']}.txt").read_text()
        assert ("reporting checkpoint step 6 to Ray Train failed: rank 1 could not stage their files (rank 1: "
                "OSError: [Errno 28] No space left on device: staging step 6 (simulated)); expected every") in log, log
