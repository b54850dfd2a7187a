"""Ray Train V2 across two lab nodes: a real 2-node Ray cluster (``ray start --head`` in node 0, ``ray start
--address`` in node 1, each with its own address and its own private temp disk, as two machines would have),
one training worker per node (``STRICT_SPREAD``), checkpoints and Ray's storage on a directory both nodes
share (as NFS would be).

Rank 1 (on node 1) deletes robustdist's checkpoint directory and SIGKILLs itself at step 7: the only copy of
step 6 left is the one that reached Ray's storage, so the restart proves that every rank's files got there
(rank 1's from node 1) and that ``h.resume()`` takes Ray's checkpoint with no user code. The result is bitwise
equal to the same run without faults. Both Ray nodes are torn down with the lab (every process in each node's
network namespace is killed; ``ray stop`` is never used, as it would stop any Ray on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile

import pytest
import torch

from tests.multinode._lab import PY, ROOT, finish, logs, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]
RAY_PORT = 6379


def _ray_env(token):
    """Token authentication (Ray 2.60's default for a new cluster), its token given to every node and the
    driver, as a real cluster propagates it; the host's ``~/.ray/auth_token`` is neither read nor written.

    ``GLOO_SOCKET_IFNAME=eth0`` (the workers inherit it from their raylet), as docs/ray.md tells multi-node
    users: a lab node's hostname resolves to 127.0.1.1 (the stock Debian /etc/hosts), and without it Ray
    Train's own gloo group fails before the training function runs (``connectFullMesh ... remote=[127.0.1.1]``)."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0"}


def _ray_start(lab, index, temp, token):
    ray = os.path.join(os.path.dirname(PY), "ray")
    node = lab.nodes[index]
    where = (["--head", f"--port={RAY_PORT}", "--include-dashboard=false", "--disable-usage-stats"] if index == 0
             else [f"--address={lab.nodes[0].address}:{RAY_PORT}"])
    argv = [ray, "start", "--block", *where, f"--node-ip-address={node.address}", "--num-cpus=1", "--num-gpus=0",
            "--object-store-memory=100000000", f"--temp-dir={temp}"]
    return lab.popen(index, argv, env=_ray_env(token), name=f"ray-n{index}")


def _processes_using(temp):
    """Pids whose command line names the lab cluster's temp dir (every Ray process of a node does)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if temp.encode() in fh.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_killed_worker_on_the_second_node_resumes_bitwise_from_every_ranks_files_in_ray(node_lab, tmp_path):
    pytest.importorskip("ray")
    token = secrets.token_hex(32)
    temp = tempfile.mkdtemp(prefix="rdray-")  # short: Ray's socket paths live under it (a node-local tmpfs)
    try:
        lab = node_lab(2, local_disk=temp, disk_size="256m")
        heads = [_ray_start(lab, 0, temp, token)]
        wait_for(lambda: "Ray runtime started" in lab.log("ray-n0"), 90, "the Ray head on node 0", lab=lab,
                 procs=heads)
        heads.append(_ray_start(lab, 1, temp, token))
        wait_for(lambda: "Ray runtime started" in lab.log("ray-n1"), 90, "the Ray worker node on node 1", lab=lab,
                 procs=heads[1:])
        work = tmp_path / "work"  # shared by both nodes
        work.mkdir()
        driver = lab.popen(0, [PY, "-m", "tests.multinode.ray_driver", "--address",
                               f"{lab.nodes[0].address}:{RAY_PORT}", "--node-ip", lab.nodes[0].address,
                               "--work", str(work)], env=_ray_env(token), name="driver", cwd=str(ROOT))
        assert finish([driver], 360, lab) == [0], logs(lab)

        for name in ("reference", "faults"):
            result = json.loads((work / f"{name}.result.json").read_text())
            assert result["error"] is None and result["metrics"]["step"] == 9, (name, result)
        reference = _records(work / "reference" / "resumes.jsonl")
        attempts = _records(work / "faults" / "resumes.jsonl")
        assert sorted((r["rank"], r["resumed"]) for r in attempts) == [(0, 0), (0, 6), (1, 0), (1, 6)], attempts
        # One worker per node in every attempt (which rank lands on which node may change with the restart).
        for run in (reference, [r for r in attempts if r["resumed"] == 0], [r for r in attempts if r["resumed"]]):
            assert sorted(r["host"] for r in run) == ["node0", "node1"], run
        resumed = [r for r in attempts if r["resumed"] == 6]
        # robustdist's directory was gone: step 6 came from Ray's checkpoint, on both ranks.
        assert {r["source"] for r in resumed} == {"ray"}, resumed
        ray_ckpt = resumed[0]["ray_checkpoint"]
        assert ray_ckpt and "step_0000000006" in ray_ckpt and {r["ray_checkpoint"] for r in resumed} == {ray_ckpt}
        # Every rank's files are in Ray's storage, each written from its own node (one rank per node, above).
        assert {"manifest.json", "replicated.pt", "rank_00000.pt", "rank_00001.pt"} <= set(os.listdir(ray_ckpt))
        assert ray_ckpt.startswith(str(work / "ray" / "faults"))

        final = torch.load(work / "faults" / "final.pt", weights_only=True)
        expected = torch.load(work / "reference" / "final.pt", weights_only=True)
        assert final.keys() == expected.keys()
        for key in expected:
            assert torch.equal(final[key], expected[key]), f"{key} differs from the run without a fault"

        assert len(_processes_using(temp)) >= 4  # the check sees the cluster: two raylets, GCS, ray start x2...
        lab.close()  # both Ray nodes go down with their namespaces (bounded; nothing survives)
        assert all(p.poll() is not None for p in heads)
        assert not _processes_using(temp), "Ray processes of the lab cluster survived its teardown"
    finally:
        shutil.rmtree(temp, ignore_errors=True)
