"""A node-local checkpoint directory is refused, not half-committed: each lab node has a private tmpfs at
``checkpoint.dir``, as a node's local NVMe would be."""

from __future__ import annotations

import pytest

from tests.multinode._lab import JOB, events, finish, job_args, logs, of

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]


def test_a_node_local_checkpoint_dir_is_refused_on_every_rank_before_anything_is_committed(node_lab, tmp_path):
    ckpt = tmp_path / "ckpt"
    lab = node_lab(2, local_disk=ckpt, disk_size="32m")
    ev = tmp_path / "events"
    agents = [lab.torchrun(i, JOB, job_args(ev, ckpt=ckpt, steps=10, every=2)) for i in range(2)]
    assert finish(agents, 150, lab) != [0, 0]
    errors = of(events(ev), "error")
    assert sorted(e["rank"] for e in errors) == [0, 1], logs(lab)
    assert not of(events(ev), "step"), "a rank trained past the refused checkpoint directory"
    for e in errors:
        assert e["type"] == "CheckpointError", e
        message = e["message"]
        assert "is not the same directory on every node" in message
        # The nodes are named by node rank, hostname and address: these are two real nodes.
        assert "node 0 (host node0, 10.213.0.1)" in message and "node 1 (host node1, 10.213.0.2)" in message
        assert "Fix: put checkpoint.dir on shared storage" in message
    for i in range(2):  # nothing that looks like a checkpoint (or a probe) on either node's disk
        left = lab.exec(i, ["ls", "-A", str(ckpt)]).split()
        assert not [name for name in left if name.startswith(("step_", ".tmp-step_", ".robustdist-probe"))], left
