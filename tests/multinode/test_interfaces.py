"""A node with two interfaces, gloo bound to the one that reaches no other node: named in seconds, not hung.

Two lab nodes, each with ``eth0`` (10.213.0.<i+1>, on the shared bridge) and ``eth1`` (10.214.0.<i+1>, which
reaches no other node). Each node runs one rank that connects to a TCPStore on node 0 and calls
:func:`robustdist.init.reach.check_peers`, as ``safe_init_process_group`` does before ``init_process_group``;
``robustdist doctor`` runs in node 1 against a listener on node 0.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from robustdist.testing.nodelab import NodeLab

pytestmark = pytest.mark.processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PORT = 29500
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID", "RAY_ADDRESS")

RANK_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, time
    from datetime import timedelta
    logging.basicConfig(level=logging.DEBUG)
    import torch.distributed as dist
    from robustdist.init.reach import check_peers
    from robustdist.runtime.errors import InitError

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=timedelta(seconds=30), wait_for_workers=False)
    start = time.monotonic()
    try:
        check_peers(store, rank, world, timeout_s=30)
        result = {"ok": True}
    except InitError as e:
        result = {"ok": False, "message": e.message, "text": str(e), "ranks": list(e.ranks or ())}
    result["seconds"] = time.monotonic() - start
    print("RESULT " + json.dumps(result), flush=True)
    store.add("finished", 1)  # rank 0 hosts the store: it stays until every rank has its answer
    deadline = time.monotonic() + 20
    while rank == 0 and int(store.add("finished", 0)) < world and time.monotonic() < deadline:
        time.sleep(0.05)
""")


def _lab(node_lab) -> NodeLab:
    return node_lab(2, alt_interface=True)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **extra}


def _check_peers(lab: NodeLab, tmp_path, ifnames: dict[int, str | None]) -> dict[int, dict]:
    """Run one rank per node (GLOO_SOCKET_IFNAME per node, None: unset); return each rank's RESULT."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = {}
    for i in range(2):
        env = _env(RANK=str(i), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(i),
                   MASTER_ADDR=lab.node(0).address, MASTER_PORT=str(PORT),
                   **({"GLOO_SOCKET_IFNAME": ifnames[i]} if ifnames[i] else {}))
        procs[i] = lab.popen(i, [sys.executable, str(script)], env=env, name=f"rank{i}", cwd=REPO)
    try:
        for proc in procs.values():
            proc.wait(timeout=60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    out = {}
    for i in range(2):
        log = lab.log(f"rank{i}")
        line = next((ln for ln in reversed(log.splitlines()) if ln.startswith("RESULT ")), None)
        assert line is not None, f"rank {i} printed no result:\n{log[-3000:]}"
        out[i] = json.loads(line[len("RESULT "):])
    return out


@pytest.mark.timeout(120)
def test_gloo_on_the_interface_that_reaches_no_peer_is_named_on_every_rank(node_lab, tmp_path):
    lab = _lab(node_lab)
    results = _check_peers(lab, tmp_path, {0: "eth0", 1: "eth1"})
    assert not results[0]["ok"] and not results[1]["ok"], results
    message = results[0]["message"]
    assert results[1]["message"] == message  # the same error on every rank
    assert message.startswith("rank 1 on node 1 (host node1, 10.214.0.2) binds gloo to GLOO_SOCKET_IFNAME=eth1 "
                              "(10.214.0.2), which rank 0 on node 0 (host node0, 10.213.0.1) cannot reach "), message
    assert "interfaces on node 1 that reach them: eth0 (10.213.0.2). Fix: set GLOO_SOCKET_IFNAME=eth0 on node 1" \
        in message
    assert results[0]["text"].startswith("[rank 0] ") and results[1]["text"].startswith("[rank 1] ")
    assert results[0]["ranks"] == results[1]["ranks"] == [1]
    assert all(r["seconds"] < 15 for r in results.values()), results  # two connect timeouts, not 30 minutes


@pytest.mark.timeout(120)
def test_hostname_on_loopback_is_named_with_the_interface_that_works(node_lab, tmp_path):
    # GLOO_SOCKET_IFNAME unset on node 1: gloo binds what hostname node1 resolves to, 127.0.1.1 (Debian's shape).
    lab = _lab(node_lab)
    results = _check_peers(lab, tmp_path, {0: "eth0", 1: None})
    assert results[0]["message"] == results[1]["message"], results
    message = results[0]["message"]
    assert message.startswith("rank 1 on node 1 (host node1, 10.213.0.2) binds gloo to its hostname's address, "
                              "node1 -> 127.0.1.1 (GLOO_SOCKET_IFNAME is unset), which rank 0 on node 0 "), message
    assert "interfaces on node 1 that reach them: eth0 (10.213.0.2). Fix: set GLOO_SOCKET_IFNAME=eth0 on node 1" \
        in message


@pytest.mark.timeout(120)
def test_eth0_on_both_nodes_passes(node_lab, tmp_path):
    lab = _lab(node_lab)
    results = _check_peers(lab, tmp_path, {0: "eth0", 1: "eth0"})
    assert results[0]["ok"] and results[1]["ok"], results
    assert all(r["seconds"] < 5 for r in results.values()), results


@pytest.mark.timeout(120)
def test_doctor_on_node_1_names_the_interface_that_does_not_reach_the_master(node_lab, tmp_path):
    lab = _lab(node_lab)
    master = lab.node(0).address
    listener = lab.popen(0, [sys.executable, "-c", "import socket, time\n"
                             f"s = socket.create_server(({master!r}, {PORT}))\ntime.sleep(90)"], name="listener")
    try:
        deadline = time.monotonic() + 20
        while not lab.reachable(1, 0, PORT) and time.monotonic() < deadline:
            time.sleep(0.2)
        env = _env(GLOO_SOCKET_IFNAME="eth1", MASTER_ADDR=master, MASTER_PORT=str(PORT))
        argv = ["env", *(f"-u{k}" for k in LAUNCH_VARS), *(f"{k}={v}" for k, v in env.items() if k in
                                                             ("PYTHONPATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
                                                              "MASTER_ADDR", "MASTER_PORT")),
                sys.executable, "-m", "robustdist", "doctor", "--json"]
        out = lab.exec(1, argv, timeout=90, check=False)
    finally:
        listener.kill()
        listener.wait(timeout=10)
    findings = {f["check"]: f for f in json.loads(out)["findings"]}
    assert findings["reach.eth0"]["level"] == "ok" and "reaches" in findings["reach.eth0"]["value"], findings
    assert "connected" in findings["reach.eth0"]["value"]
    assert "does not reach" in findings["reach.eth1"]["value"]
    problem = findings["reach.GLOO_SOCKET_IFNAME"]
    assert problem["level"] == "error", problem
    assert problem["remedy"].startswith(f"GLOO_SOCKET_IFNAME=eth1 names eth1 (10.214.0.2), which does not reach "
                                        f"MASTER_ADDR {master}:{PORT} ("), problem
    assert problem["remedy"].endswith("interfaces here that reach it: eth0 (10.213.0.2). "
                                      "Fix: set GLOO_SOCKET_IFNAME=eth0"), problem


@pytest.mark.timeout(180)
def test_harden_names_the_interface_that_reaches_no_peer_through_safe_init(node_lab, tmp_path):
    """The same check on the real path: torchrun on each node, the user's script calls harden();
    node 1's GLOO_SOCKET_IFNAME names eth1. Both ranks raise within seconds instead of gloo hanging."""
    from tests.multinode._lab import JOB, events, finish, job_args, logs, of

    lab = node_lab(2, alt_interface=True)
    ev = tmp_path / "events"
    agents = [lab.torchrun(i, JOB, job_args(ev, steps=5, init_timeout=60),
                           env={"GLOO_SOCKET_IFNAME": "eth1"} if i == 1 else None) for i in range(2)]
    assert finish(agents, 150, lab) != [0, 0]
    errors = of(events(ev), "error")
    assert sorted(e["rank"] for e in errors) == [0, 1], logs(lab)
    for e in errors:
        assert e["type"] == "InitError"
        assert "binds gloo to GLOO_SOCKET_IFNAME=eth1 (10.214.0.2)" in e["message"]
        assert "interfaces on node 1 that reach them: eth0 (10.213.0.2)" in e["message"]
        assert "Fix: set GLOO_SOCKET_IFNAME=eth0 on node 1" in e["message"]
