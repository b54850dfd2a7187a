"""detect_topology: each launcher's env, the process group as a source, and every TopologyError."""

from __future__ import annotations

import os

import pytest
import torch

from robustdist.runtime.errors import RobustDistWarning, TopologyError
from robustdist.runtime.topology import Topology, detect_topology, parse_visible_devices
from robustdist.testing.ranks import run_ranks

LAUNCHER_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "CUDA_VISIBLE_DEVICES",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
]


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, whatever the shell running the tests had."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _set(mp, **values):
    for k, v in values.items():
        mp.setenv(k, str(v))


def test_single_process(clean_env):
    topo = detect_topology()
    assert topo == Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                            launcher="single", device=torch.device("cpu"), master_addr=None, master_port=None,
                            visible_devices=None)
    assert not topo.is_distributed and topo.is_rank_zero


def test_torchrun_env(clean_env):
    _set(clean_env, RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1, GROUP_WORLD_SIZE=2,
         MASTER_ADDR="node0", MASTER_PORT=29500, TORCHELASTIC_RUN_ID="job1", TORCHELASTIC_RESTART_COUNT=0,
         CUDA_VISIBLE_DEVICES="0,1,2,3")
    topo = detect_topology()
    assert (topo.launcher, topo.rank, topo.world_size, topo.local_rank, topo.local_world_size) == ("torchrun", 5, 8, 1, 4)
    assert (topo.node_rank, topo.num_nodes, topo.master_addr, topo.master_port) == (1, 2, "node0", 29500)
    assert topo.visible_devices == (0, 1, 2, 3)
    assert topo.device == torch.device("cpu")  # no CUDA on this machine


def test_torchrun_inside_srun_is_not_a_disagreement(clean_env):
    # `srun --ntasks-per-node=1 torchrun ...`: SLURM counts nodes, torchrun counts ranks.
    _set(clean_env, RANK=9, WORLD_SIZE=16, LOCAL_RANK=1, LOCAL_WORLD_SIZE=8, GROUP_RANK=1, GROUP_WORLD_SIZE=2,
         TORCHELASTIC_RUN_ID="j", SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_NODEID=1, SLURM_NNODES=2)
    topo = detect_topology()
    assert (topo.launcher, topo.rank, topo.world_size, topo.node_rank) == ("torchrun", 9, 16, 1)


def test_slurm_env(clean_env):
    _set(clean_env, SLURM_PROCID=5, SLURM_NTASKS=7, SLURM_LOCALID=1, SLURM_NNODES=2, SLURM_NODEID=1,
         SLURM_TASKS_PER_NODE="4,3")
    with pytest.warns(RobustDistWarning, match="world size 7 is not a multiple of the local world size 3"):
        topo = detect_topology()
    assert (topo.launcher, topo.rank, topo.world_size, topo.local_rank, topo.local_world_size) == ("slurm", 5, 7, 1, 3)
    assert (topo.node_rank, topo.num_nodes) == (1, 2)


def test_slurm_tasks_per_node_repeat_syntax(clean_env):
    _set(clean_env, SLURM_PROCID=2, SLURM_NTASKS=6, SLURM_LOCALID=0, SLURM_NNODES=3, SLURM_NODEID=1,
         SLURM_TASKS_PER_NODE="2(x3)")
    topo = detect_topology()
    assert (topo.local_world_size, topo.node_rank, topo.num_nodes) == (2, 1, 3)


def test_manual_launch_assumes_one_node(clean_env):
    _set(clean_env, RANK=2, WORLD_SIZE=3, MASTER_ADDR="127.0.0.1", MASTER_PORT=1234)
    topo = detect_topology()
    assert (topo.launcher, topo.rank, topo.world_size, topo.local_rank, topo.local_world_size) == ("manual", 2, 3, 2, 3)
    assert (topo.node_rank, topo.num_nodes) == (0, 1)


def test_environ_is_injectable(clean_env):
    topo = detect_topology(environ={"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert (topo.launcher, topo.rank, topo.world_size) == ("torchrun", 1, 2)


def test_uneven_nodes_warn(clean_env):
    _set(clean_env, RANK=0, WORLD_SIZE=3, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, TORCHELASTIC_RUN_ID="x")
    with pytest.warns(RobustDistWarning, match="world size 3 is not a multiple of the local world size 2"):
        detect_topology()


# ----------------------------------------------------------------------------- errors, messages pinned
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": 4, "WORLD_SIZE": 4},
         "[rank 4] rank 4 is outside world size 4; expected 0 <= rank < 4. Fix: every process needs a distinct RANK"),
        ({"RANK": 0, "WORLD_SIZE": 0},
         "[rank 0] WORLD_SIZE='0' is out of range; expected an integer in 1..16777216 (a size or count is at "
         "least 1). Fix: unset WORLD_SIZE"),
        ({"RANK": -1, "WORLD_SIZE": 2},
         "RANK='-1' is out of range; expected an integer in 0..16777215 (a rank or id counts from 0). Fix: unset RANK"),
        ({"RANK": 1, "WORLD_SIZE": 4, "LOCAL_RANK": 2, "LOCAL_WORLD_SIZE": 2},
         "[rank 1] local rank 2 is outside local world size 2; expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE. "
         "Fix: set LOCAL_WORLD_SIZE"),
        ({"RANK": "one", "WORLD_SIZE": 2},
         "RANK='one' is not an integer; expected a whole number set by the launcher. Fix: unset RANK"),
        ({"RANK": 1, "WORLD_SIZE": 2, "SLURM_PROCID": 0, "SLURM_NTASKS": 2},
         "[rank 1] RANK=1 but SLURM_PROCID=0; expected them to agree when srun starts one task per rank. "
         "Fix: derive RANK from SLURM_PROCID"),
        ({"RANK": 1, "WORLD_SIZE": 4, "SLURM_PROCID": 1, "SLURM_NTASKS": 2},
         "[rank 1] WORLD_SIZE=4 but SLURM_NTASKS=2; expected them to agree"),
        ({"RANK": 0, "WORLD_SIZE": 2, "MASTER_PORT": "70000"},
         "[rank 0] MASTER_PORT='70000' is not a TCP port; expected an integer in 1..65535. Fix: set MASTER_PORT"),
        ({"RANK": 0, "WORLD_SIZE": 2, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a TCP port"),
    ],
)
def test_topology_errors(clean_env, env, message):
    _set(clean_env, **env)
    with pytest.raises(TopologyError) as exc:
        detect_topology()
    assert message in str(exc.value)
    assert exc.value.rank is not None or message.startswith("RANK=")  # a bad RANK has no rank to name


def test_stale_master_port_is_ignored_by_a_single_process(clean_env):
    _set(clean_env, MASTER_PORT="junk")
    assert detect_topology().master_port is None


def test_local_rank_past_visible_gpus_is_caught_before_nccl(clean_env, monkeypatch):
    # Only the GPU discovery is faked; the detection code path is the real one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _set(clean_env, RANK=2, WORLD_SIZE=4, LOCAL_RANK=2, LOCAL_WORLD_SIZE=4, CUDA_VISIBLE_DEVICES="0,1",
         TORCHELASTIC_RUN_ID="x")
    with pytest.raises(TopologyError) as exc:
        detect_topology()
    assert str(exc.value) == (
        "[rank 2] LOCAL_RANK=2 but only 2 CUDA device(s) are visible (CUDA_VISIBLE_DEVICES = '0,1'); expected "
        "LOCAL_RANK < 2. NCCL would fail later with 'invalid device ordinal'. Fix: start at most 2 processes per "
        "node (torchrun --nproc_per_node=2) or make more GPUs visible."
    )


def test_cuda_device_is_the_local_rank(clean_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    _set(clean_env, RANK=3, WORLD_SIZE=4, LOCAL_RANK=3, LOCAL_WORLD_SIZE=4, TORCHELASTIC_RUN_ID="x")
    assert detect_topology().device == torch.device("cuda", 3)


def test_local_device_is_harden_s_device_and_becomes_the_current_one(clean_env, monkeypatch):
    from robustdist import local_device

    assert local_device() == torch.device("cpu")  # one process, no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)  # the one call that needs a real GPU
    _set(clean_env, RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, TORCHELASTIC_RUN_ID="x")
    assert local_device() == detect_topology().device == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 1)]
    assert local_device(set_current=False) == torch.device("cuda", 1) and len(chosen) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _set(clean_env, LOCAL_RANK=2, CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(TopologyError, match=r"^\[rank 5\] LOCAL_RANK=2 but only 2 CUDA device\(s\) are visible"):
        local_device()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", ()),
        ("-1", ()),
        ("2,3", (2, 3)),
        (" 0, 1 ", (0, 1)),
        ("0,1,-1,2", (0, 1)),  # CUDA stops at the first invalid entry
        ("0,foo,1", (0,)),
        ("GPU-5c2e4f0a-1b2c-3d4e-5f60-718293a4b5c6,GPU-aaaa",
         ("GPU-5c2e4f0a-1b2c-3d4e-5f60-718293a4b5c6", "GPU-aaaa")),
        ("MIG-4f1c2d3e-0000-1111-2222-333344445555", ("MIG-4f1c2d3e-0000-1111-2222-333344445555",)),
        ("MIG-GPU-5c2e4f0a-1b2c-3d4e-5f60-718293a4b5c6/1/0", ("MIG-GPU-5c2e4f0a-1b2c-3d4e-5f60-718293a4b5c6/1/0",)),
    ],
)
def test_parse_visible_devices(value, expected):
    assert parse_visible_devices(value) == expected


# ----------------------------------------------------------------------------- real process groups
def _topology_in_rank(rank):
    topo = detect_topology()
    return (topo.launcher, topo.rank, topo.world_size, topo.local_rank, topo.master_port is not None)


@pytest.mark.processes
def test_process_group_is_a_source_on_real_ranks():
    assert run_ranks(_topology_in_rank, 3, timeout=60) == [("manual", r, 3, r, True) for r in range(3)]


def _stale_rank_env(rank):
    os.environ["RANK"] = str(1 - rank)  # the group says one thing, the env another
    try:
        detect_topology()
    except TopologyError as e:
        return str(e)
    return None


@pytest.mark.processes
def test_process_group_disagreeing_with_env_raises():
    messages = run_ranks(_stale_rank_env, 2, timeout=60)
    assert messages[0].startswith("[rank 0] the process group says rank 0 but RANK=1 in the environment")
    assert "Fix: pass no explicit rank/world_size to init_process_group" in messages[1]
