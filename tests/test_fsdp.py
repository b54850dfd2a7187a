"""fsdp_calibrate on real gloo ranks with FSDP2 (fully_shard runs on CPU): meshes, strategies, and checks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from robustdist.errors import TopologyError
from robustdist.fsdp import fsdp_calibrate
from robustdist.testing import run_ranks

TOTAL = 8  # samples per step in the reference; split evenly across ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(TOTAL, 6, generator=g), torch.randn(TOTAL, 3, generator=g)


def _reference():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _calibrate_and_train(rank, nodes):
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    host = f"node{rank // (world // nodes)}"
    cal = fsdp_calibrate(hostname=host)
    model = _model()
    fully_shard(model, **cal.fully_shard_kwargs())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    per = TOTAL // world
    loss = nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
    loss.backward()
    opt.step()
    losses = [None] * world
    dist.all_gather_object(losses, loss.item())
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    fsdp1 = cal.fsdp1_kwargs()  # built here; running FSDP1 itself needs an accelerator
    fsdp1_summary = (fsdp1["sharding_strategy"].name, str(fsdp1["device_id"]), isinstance(fsdp1.get("process_group"), tuple))
    return (cal.sharding_strategy, cal.mesh_shape, cal.mesh_dim_names, cal.num_nodes, cal.local_world_size,
            sum(losses) / world, full, fsdp1_summary)


def _node_env(world, nodes):
    per = world // nodes
    return [{"LOCAL_RANK": str(r % per), "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(r // per)}
            for r in range(world)]


@pytest.mark.parametrize(("world", "nodes", "strategy", "shape", "names"), [
    (2, 1, "FULL_SHARD", (2,), ("shard",)),
    (4, 1, "FULL_SHARD", (4,), ("shard",)),
    (4, 2, "HYBRID_SHARD", (2, 2), ("replicate", "shard")),
])
def test_strategy_mesh_and_a_training_step_match_the_reference(world, nodes, strategy, shape, names):
    ref_loss, ref_params = _reference()
    out = run_ranks(_calibrate_and_train, world, args=(nodes,), env=_node_env(world, nodes), timeout=120)
    for got_strategy, got_shape, got_names, num_nodes, local_world, loss, params, fsdp1 in out:
        assert (got_strategy, got_shape, got_names) == (strategy, shape, names)
        assert fsdp1 == (strategy, "cpu", strategy == "HYBRID_SHARD")
        assert (num_nodes, local_world) == (nodes, world // nodes)
        assert abs(loss - ref_loss) < 1e-5
        assert all(torch.allclose(params[k], ref_params[k], atol=1e-6) for k in ref_params)


def _hybrid_on_one_node(rank):
    cal = fsdp_calibrate(strategy="HYBRID_SHARD")
    return cal.sharding_strategy, cal.warnings


def test_hybrid_on_one_node_degrades_with_a_warning():
    for strategy, warnings in run_ranks(_hybrid_on_one_node, 2, timeout=60):
        assert strategy == "FULL_SHARD" and "HYBRID_SHARD was requested on a single node" in warnings[0]


def _mismatch(rank, case):
    try:
        if case == "env":
            os.environ["WORLD_SIZE"] = "4"
            fsdp_calibrate()
        elif case == "uneven":
            fsdp_calibrate(hostname="node0" if rank < 3 else "node1")
        elif case == "gpus":
            fsdp_calibrate(visible_devices=[0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7])
    except TopologyError as e:
        return str(e)
    return None


def test_env_world_size_differs_from_the_group():
    for rank, message in enumerate(run_ranks(_mismatch, 2, args=("env",), timeout=60)):
        assert message == (f"[rank {rank}] WORLD_SIZE=4 in the environment but the process group has 2 ranks; "
                           "expected them to agree, or FSDP shards for one world while the launcher counts another. "
                           "Fix: do not override WORLD_SIZE after the launcher sets it, and create the group with the "
                           "launcher's ranks.")


def test_uneven_nodes():
    for message in run_ranks(_mismatch, 4, args=("uneven",), env=_node_env(4, 2), timeout=60):
        assert "nodes run different numbers of ranks (node0: 3, node1: 1); expected the same on every node" in message
        assert "Fix: launch the same --nproc_per_node on every node" in message


def test_a_process_seeing_four_gpus():
    # the seed's trap: 2 Ray workers granted 4 GPUs each, one process per worker
    for message in run_ranks(_mismatch, 2, args=("gpus",), timeout=60):
        assert "each process sees 4 GPUs" in message and "its node runs 2 process(es)" in message
        assert "6 of the job's 8 GPUs would sit idle while world_size counts 2 ranks" in message
        assert "Fix: in Ray Train use ScalingConfig(num_workers=8, resources_per_worker={'GPU': 1})" in message


def test_single_process_is_no_shard(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cal = fsdp_calibrate()
    assert (cal.sharding_strategy, cal.world_size, cal.mesh_shape) == ("NO_SHARD", 1, (1,))
