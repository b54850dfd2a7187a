"""Bad rendezvous addresses fail fast across real nodes: every rank that started raises InitError within
``distributed.init_timeout``, naming the address, what it resolved to, the node and the fix."""

from __future__ import annotations

import os

import pytest

from tests.multinode._lab import JOB, PY, events, finish, job_args, logs, of

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]
# Every case but the loopback one waits it out once (a rank that nothing answers, or that waits for a rank that never
# comes): short, and still past a connect to an address no machine owns (ARP gives up after ~3 s).
INIT_TIMEOUT = 4


def _ranks_env(lab, master_addr: str, master_port: int) -> list[dict[str, str]]:
    """The launcher env of a 2-node x 1-rank job, as torchrun would set it, without torchrun."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE"))}
    return [{**base, "RANK": str(i), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
             "GROUP_RANK": str(i), "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": master_addr,
             "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
            for i in range(2)]


def _init_seconds(ev) -> float:
    """The longest a rank spent from calling harden() to its error: the part init_timeout bounds (a process's
    start-up and imports are left out, so a loaded machine does not make the bound fail)."""
    evs = events(ev)
    began = {e["pid"]: e["time"] for e in of(evs, "harden")}
    return max((e["time"] - began[e["pid"]] for e in of(evs, "error")), default=0.0)


def _errors_or_killed_by_agent(ev, lab) -> dict:
    """Each rank's error event. Under torchrun, once node 0's agent exits (its worker failed) the store it
    served is gone, and node 1's agent may stop its worker before that worker's own error: then that rank
    never started training, and its agent says why."""
    errors = {e["rank"]: e for e in of(events(ev), "error")}
    assert not of(events(ev), "start"), "a rank got past init"
    for rank in {0, 1} - set(errors):
        assert "RendezvousConnectionError" in lab.log(f"agent-n{rank}") or "SIGTERM" in lab.log(f"agent-n{rank}"), \
            logs(lab)
    return errors


@pytest.mark.parametrize("case", ["loopback", "nobody-owns-it"])
def test_every_rank_fails_fast_naming_the_address_and_the_fix(node_lab, tmp_path, case):
    lab = node_lab(2)
    ev = tmp_path / "events"
    addr = {"loopback": "127.0.0.1", "nobody-owns-it": "10.213.0.99"}[case]
    envs = _ranks_env(lab, addr, 29511)
    procs = [lab.popen(i, [PY, JOB, *job_args(ev, init_timeout=INIT_TIMEOUT)], env=envs[i], name=f"rank{i}")
             for i in range(2)]
    assert finish(procs, 180, lab) == [3, 3], logs(lab)
    elapsed = _init_seconds(ev)
    errors = {e["rank"]: e for e in of(events(ev), "error")}
    assert sorted(errors) == [0, 1], logs(lab)
    for rank, e in errors.items():
        assert e["type"] == "InitError", e
        assert f"node {rank} (host node{rank}, 10.213.0.{rank + 1})" in e["message"], e["message"]
        assert addr in e["message"]
    if case == "loopback":  # refused before any connection: well inside the bound
        for e in errors.values():
            assert "'127.0.0.1' is a loopback address on node" in e["message"], e["message"]
            assert "Nothing was connected" in e["message"]
            assert "--local_addr" in e["message"] and "/etc/hosts" in e["message"]
        assert elapsed < INIT_TIMEOUT + 20
    else:  # rank 0 cannot serve on an address it does not own; rank 1 gets no answer from it
        assert elapsed < INIT_TIMEOUT + 25, f"{elapsed:.0f} s: not bounded by init_timeout ({INIT_TIMEOUT} s)"
        assert "nothing answers" in errors[1]["message"], errors[1]["message"]
        assert f"within {INIT_TIMEOUT} s (distributed.init_timeout)" in errors[1]["message"], errors[1]["message"]


def test_a_script_that_sets_master_port_under_torchrun_fails_fast_on_both_nodes(node_lab, tmp_path):
    """What old tutorials do: os.environ["MASTER_PORT"] = "12355" under torchrun, whose agent serves the store
    on another port: nobody listens on 12355 on node 0."""
    lab = node_lab(2)
    ev = tmp_path / "events"
    agents = [lab.torchrun(i, JOB, job_args(ev, init_timeout=INIT_TIMEOUT, override_master_port=12355))
              for i in range(2)]
    finish(agents, 240, lab)
    errors = _errors_or_killed_by_agent(ev, lab)
    assert _init_seconds(ev) < INIT_TIMEOUT + 20
    for rank, e in errors.items():
        assert e["type"] == "InitError" and "10.213.0.1:12355" in e["message"], e["message"]
        assert f"node {rank} (host node{rank}, 10.213.0.{rank + 1})" in e["message"]
        assert "MASTER_PORT" in e["message"] and "Fix:" in e["message"]


def test_torchrun_without_local_addr_is_refused_on_the_node_whose_hostname_is_loopback(node_lab, tmp_path):
    """torchrun advertises node 0 by its hostname, which node 0's own /etc/hosts maps to 127.0.1.1 (the stock
    shape): rank 0 refuses before connecting and says to pass --local_addr; rank 1, which resolves the name
    to node 0's real address, is told within init_timeout that rank 0 never arrived."""
    lab = node_lab(2)
    ev = tmp_path / "events"
    agents = [lab.torchrun(i, JOB, job_args(ev, init_timeout=INIT_TIMEOUT), local_addr=False) for i in range(2)]
    finish(agents, 120, lab)
    errors = _errors_or_killed_by_agent(ev, lab)
    assert 0 in errors, logs(lab)
    zero = errors[0]["message"]
    assert "MASTER_ADDR='node0'" in zero and "resolves only to loopback (127.0.1.1) on node 0 (host node0" in zero
    assert "launch torchrun with --local_addr" in zero
    assert errors.get(1, {"type": "InitError"})["type"] == "InitError"
