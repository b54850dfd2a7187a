"""Ray Train V2 across two lab nodes: a real 2-node Ray cluster (``ray start --head`` in node 0, ``ray start
--address`` in node 1, each with its own address and its own private temp disk, as two machines would have),
one training worker per node (``STRICT_SPREAD``), checkpoints and Ray's storage on a directory both nodes
share (as NFS would be).

Rank 1 deletes robustdist's checkpoint directory and SIGKILLs itself at step 7: the only copy of step 6 left
is the one that reached Ray's storage, so the restart proves that every rank's files got there (each rank
reported its own files from its own node: the client records every report) and that ``h.resume()`` takes
Ray's checkpoint with no user code. The result is bitwise equal to the same run without faults. Both Ray
nodes are torn down with the lab: every process in each node's network namespace is killed, and afterwards
no process is left in those namespaces (Ray renames its workers, so a command-line check would miss them).
Only processes in the lab's namespaces are killed; ``ray stop`` is never used: it stops every Ray on the
machine, and the suite's own Ray cluster may be running beside this one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time

import pytest
import torch

from tests.multinode._lab import PY, ROOT, finish, logs, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(420)]
RAY_PORT = 6379
BUDGET_S = 330  # every wait of the test together, so that a failure reports with the logs before the timeout


def _ray_env(token):
    """Token authentication (Ray 2.60's default for a new cluster), its token given to every node and the
    driver, as a real cluster propagates it; the host's ``~/.ray/auth_token`` is neither read nor written.

    ``GLOO_SOCKET_IFNAME=eth0`` (the workers inherit it from their raylet), as docs/ray.md tells multi-node
    users: a lab node's hostname resolves to 127.0.1.1 (the stock Debian /etc/hosts), and without it Ray
    Train's own gloo group fails before the training function runs (``connectFullMesh ... remote=[127.0.1.1]``).

    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (the driver passes it on to each run's controller): the controller polls
    its workers every 0.5 s instead of 2 s, as in tests/ray/conftest.py, which says why."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0",
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
            "RAY_memory_monitor_refresh_ms": "0"}  # Ray's host-wide memory monitor must not spend the one retry


def _ray_start(lab, index, temp, token):
    ray = os.path.join(os.path.dirname(PY), "ray")
    node = lab.nodes[index]
    where = (["--head", f"--port={RAY_PORT}", "--include-dashboard=false", "--disable-usage-stats"] if index == 0
             else [f"--address={lab.nodes[0].address}:{RAY_PORT}"])
    argv = [ray, "start", "--block", *where, f"--node-ip-address={node.address}", "--num-cpus=1", "--num-gpus=0",
            "--object-store-memory=100000000", f"--temp-dir={temp}"]
    return lab.popen(index, argv, env=_ray_env(token), name=f"ray-n{index}")


def _netns_inode(pid):
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _pids_in(inodes):
    """Live (non-zombie) pids whose network namespace is one of ``inodes``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if _netns_inode(pid) in inodes:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(pid))
            except OSError:
                continue
    return found


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_killed_worker_resumes_bitwise_on_two_ray_nodes_from_every_ranks_files_in_ray(node_lab, tmp_path):
    pytest.importorskip("ray")
    deadline = time.monotonic() + BUDGET_S

    def left():
        return max(1.0, deadline - time.monotonic())

    token = secrets.token_hex(32)
    temp = tempfile.mkdtemp(prefix="rdray-")  # short: Ray's socket paths live under it (a node-local tmpfs)
    try:
        lab = node_lab(2, local_disk=temp, disk_size="256m")
        inodes = {_netns_inode(n.holder.pid) for n in lab.nodes}
        heads = [_ray_start(lab, 0, temp, token)]
        wait_for(lambda: "Ray runtime started" in lab.log("ray-n0"), min(90, left()), "the Ray head on node 0",
                 lab=lab, procs=heads)
        heads.append(_ray_start(lab, 1, temp, token))
        wait_for(lambda: "Ray runtime started" in lab.log("ray-n1"), min(90, left()),
                 "the Ray worker node on node 1", lab=lab, procs=heads[1:])
        work = tmp_path / "work"  # shared by both nodes
        work.mkdir()
        driver = lab.popen(0, [PY, "-m", "tests.multinode.ray_driver", "--address",
                               f"{lab.nodes[0].address}:{RAY_PORT}", "--node-ip", lab.nodes[0].address,
                               "--work", str(work)], env=_ray_env(token), name="driver", cwd=str(ROOT))
        assert finish([driver], left(), lab) == [0], logs(lab)

        for name in ("reference", "faults"):  # the driver got here only if both fits succeeded
            assert json.loads((work / f"{name}.result.json").read_text())["metrics"]["step"] == 9, name
        reference = _records(work / "reference" / "resumes.jsonl")
        attempts = _records(work / "faults" / "resumes.jsonl")
        # The restart resumes from the newest checkpoint Ray registered: step 6 (the last report before the kill
        # at step 7) where Ray registered it before the worker died, as Ray 2.60 does; Ray 2.52's controller may
        # not yet have collected that report when the worker is SIGKILLed, and then hands back step 3.
        again = sorted({r["resumed"] for r in attempts if r["resumed"]})
        assert len(again) == 1 and again[0] in (3, 6), attempts
        step = again[0]
        assert sorted((r["rank"], r["resumed"]) for r in attempts) == [(0, 0), (0, step), (1, 0), (1, step)], attempts
        # One worker per node in every attempt (which rank lands on which node may change with the restart).
        for run in (reference, [r for r in attempts if r["resumed"] == 0], [r for r in attempts if r["resumed"]]):
            assert sorted(r["host"] for r in run) == ["node0", "node1"], run
        resumed = [r for r in attempts if r["resumed"] == step]
        # robustdist's directory was gone: the step came from Ray's checkpoint, on both ranks.
        assert {r["source"] for r in resumed} == {"ray"}, resumed
        ray_ckpt = resumed[0]["ray_checkpoint"]
        assert ray_ckpt and f"step_{step:010d}" in ray_ckpt and {r["ray_checkpoint"] for r in resumed} == {ray_ckpt}
        assert ray_ckpt.startswith(str(work / "ray" / "faults"))
        assert {"manifest.json", "replicated.pt", "rank_00000.pt", "rank_00001.pt"} <= set(os.listdir(ray_ckpt))
        # Each rank reported its own files of that step from its own node; together they are Ray's checkpoint.
        sent = {r["rank"]: r for r in _records(work / "faults" / "reports.jsonl")
                if (r["name"] or "").startswith(f"step_{step:010d}")}
        assert sorted(sent) == [0, 1] and sent[0]["host"] != sent[1]["host"], sent
        assert "rank_00001.pt" in sent[1]["files"] and "rank_00001.pt" not in sent[0]["files"], sent
        assert "rank_00000.pt" in sent[0]["files"] and "manifest.json" in sent[0]["files"], sent
        assert set(sent[0]["files"]) | set(sent[1]["files"]) == set(os.listdir(ray_ckpt)), sent

        final = torch.load(work / "faults" / "final.pt", weights_only=True)
        expected = torch.load(work / "reference" / "final.pt", weights_only=True)
        assert final.keys() == expected.keys()
        for key in expected:
            assert torch.equal(final[key], expected[key]), f"{key} differs from the run without a fault"

        assert len(_pids_in(inodes)) >= 6  # the check sees the cluster: ray start, GCS, raylets, workers...
        lab.close()  # both Ray nodes go down with their namespaces (bounded)
        assert not _pids_in(inodes), "processes of the lab's Ray cluster survived its teardown"
    finally:
        shutil.rmtree(temp, ignore_errors=True)
