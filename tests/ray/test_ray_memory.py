"""The Ray memory plan: the object store beside CPU offload, worker heaps and in-memory checkpoints, never
above Ray's own default unless asked; Ray's default reproduced and checked against what a starting Ray node
chooses."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from robustdist.ray import memory as ray_memory
from robustdist.ray.memory import (
    RAY_MIN_OBJECT_STORE,
    MemoryPlan,
    estimate_offload_bytes,
    ray_default_object_store,
    ray_memory_plan,
)
from robustdist.runtime.errors import ConfigError

GIB = 2**30


# ----------------------------------------------------------------------------- the plan's properties
@given(st.integers(1, 1024), st.integers(0, 512), st.integers(0, 64), st.integers(0, 64))
def test_memory_plan_never_exceeds_ram_and_is_monotonic(ram_gib, offload_gib, pinned_gib, heap_gib):
    ram, offload, pinned, heap = ram_gib * GIB, offload_gib * GIB, pinned_gib * GIB, heap_gib * GIB
    try:
        plan = ray_memory_plan(total_ram=ram, offload_bytes=offload, pinned_bytes=pinned, worker_heap_bytes=heap)
    except ConfigError as e:
        assert "no safe object store size" in str(e) and "short by" in str(e)
        assert ram - int(ram * 0.1) - offload - pinned - heap < RAY_MIN_OBJECT_STORE
        return
    assert (plan.offload_bytes + plan.pinned_bytes + plan.worker_heap_bytes + plan.headroom_bytes
            + plan.object_store_memory <= ram)
    assert plan.object_store_memory <= 0.3 * ram
    bigger = ray_memory_plan(total_ram=ram + GIB, offload_bytes=offload, pinned_bytes=pinned, worker_heap_bytes=heap)
    assert bigger.object_store_memory >= plan.object_store_memory  # rises with RAM
    if offload >= GIB:
        less = ray_memory_plan(total_ram=ram, offload_bytes=offload - GIB, pinned_bytes=pinned, worker_heap_bytes=heap)
        assert less.object_store_memory >= plan.object_store_memory  # falls with offload
    if heap >= GIB:
        less = ray_memory_plan(total_ram=ram, offload_bytes=offload, pinned_bytes=pinned, worker_heap_bytes=heap - GIB)
        assert less.object_store_memory >= plan.object_store_memory  # falls with the worker heaps


@given(st.integers(1, 2048), st.floats(0.01, 1.0), st.integers(0, 256), st.integers(0, 256 * 1024),
       st.none() | st.integers(0, 512 * GIB))
def test_plan_never_above_rays_default_without_an_explicit_fraction(ram_gib, available_share, offload_gib,
                                                                     heap_mib, shm):
    ram = ram_gib * GIB
    available = max(1, int(ram * available_share))
    try:
        plan = ray_memory_plan(total_ram=ram, available_ram=available, offload_bytes=offload_gib * GIB,
                               worker_heap_bytes=heap_mib * 2**20, shm_bytes=shm)
    except ConfigError as e:
        assert "no safe object store size" in str(e)
        return
    default = ray_default_object_store(ram, available, shm_bytes=shm)
    assert plan.ray_default == default and plan.object_store_memory <= default
    assert plan.object_store_memory == min(default, plan.usable_bytes)
    assert "larger than" not in plan.explanation


def test_an_explicit_larger_fraction_is_honoured_and_explained():
    plan = ray_memory_plan(total_ram=64 * GIB, object_store_fraction=0.5)
    assert plan.ray_default == int(64 * GIB * 0.3) and plan.object_store_memory == 32 * GIB
    assert plan.explanation.endswith("object store 32.00 GiB: larger than Ray's default 19.20 GiB (30% of available "
                                     "RAM 64.00 GiB) because object_store_fraction=0.5 was asked")
    smaller = ray_memory_plan(total_ram=64 * GIB, object_store_fraction=0.2)
    assert smaller.object_store_memory == int(64 * GIB * 0.2)
    assert smaller.explanation.endswith("object_store_fraction=0.2 of total RAM, not above Ray's default 19.20 GiB "
                                        "(30% of available RAM 64.00 GiB)")
    busy = ray_memory_plan(total_ram=64 * GIB, available_ram=16 * GIB)  # half the node already in use
    assert busy.object_store_memory == int(16 * GIB * 0.3) < 0.3 * 64 * GIB  # the old plan took 30% of total
    assert busy.explanation.endswith("object store 4.80 GiB: Ray's default 4.80 GiB (30% of available RAM 16.00 GiB)")


def test_memory_plan_spells_out_the_arithmetic():
    plan = ray_memory_plan(total_ram=64 * GIB, offload_bytes=40 * GIB)
    assert plan.object_store_memory == 64 * GIB - int(64 * GIB * 0.1) - 40 * GIB  # below Ray's 30% default
    assert plan.explanation == ("total RAM 64.00 GiB - headroom 6.40 GiB - CPU offload 40.00 GiB - pinned buffers "
                                "0.00 GiB - worker heaps 0.00 GiB = usable 17.60 GiB; object store 17.60 GiB: all the "
                                "usable RAM, below Ray's default 19.20 GiB (30% of available RAM 64.00 GiB)")
    assert plan.ray_init_kwargs() == {"object_store_memory": plan.object_store_memory}
    with pytest.raises(ConfigError) as exc:
        ray_memory_plan(total_ram=16 * GIB, offload_bytes=15 * GIB)
    assert str(exc.value).startswith("no safe object store size: total RAM 16.00 GiB - headroom 1.60 GiB (10%) - CPU "
                                     "offload 15.00 GiB - pinned buffers 0.00 GiB - worker heaps 0.00 GiB = -0.60 GiB, "
                                     "below Ray's minimum")
    old = MemoryPlan(total_ram=GIB, headroom_bytes=0, offload_bytes=0, pinned_bytes=0, object_store_memory=GIB // 4)
    assert old.worker_heap_bytes == 0 and old.ray_default is None  # old construction still works
    assert old.explanation.endswith("= usable 1.00 GiB; object store 0.25 GiB")


def test_worker_heaps_are_subtracted_and_named():
    plan = ray_memory_plan(total_ram=64 * GIB, offload_bytes=30 * GIB, worker_heap_bytes=8 * 3 * GIB)
    assert plan.object_store_memory == 64 * GIB - int(64 * GIB * 0.1) - 30 * GIB - 24 * GIB
    assert "- worker heaps 24.00 GiB = usable 3.60 GiB" in plan.explanation
    with pytest.raises(ConfigError) as exc:
        ray_memory_plan(total_ram=64 * GIB, offload_bytes=30 * GIB, worker_heap_bytes=8 * 4 * GIB)
    assert str(exc.value).startswith(
        "no safe object store size: total RAM 64.00 GiB - headroom 6.40 GiB (10%) - CPU offload 30.00 GiB - pinned "
        "buffers 0.00 GiB - worker heaps 32.00 GiB = -4.40 GiB, below Ray's minimum object store of 0.07 GiB; short "
        "by 4.47 GiB. Fix:")
    assert "shrink the worker heaps" in str(exc.value)
    with pytest.raises(ConfigError, match=r"^worker_heap_bytes=-1 is out of range"):
        ray_memory_plan(total_ram=GIB, worker_heap_bytes=-1)


def test_a_default_below_rays_minimum_is_refused():
    with pytest.raises(ConfigError, match=r"^no safe object store size: Ray's default object store here is 0\.03 GiB "
                                          r"\(30% of available RAM 0\.10 GiB\), below Ray's minimum"):
        ray_memory_plan(total_ram=64 * GIB, available_ram=100 * 2**20)
    with pytest.raises(ConfigError, match=r"^no safe object store size: object_store_fraction=0\.001 of total RAM "
                                          r"16\.00 GiB is 0\.02 GiB, below Ray's minimum"):
        ray_memory_plan(total_ram=16 * GIB, object_store_fraction=0.001)


# ----------------------------------------------------------------------------- offload estimate
def test_estimate_offload_bytes():
    model = torch.nn.Linear(10, 10)  # 110 fp32 parameters = 440 bytes
    assert estimate_offload_bytes(model, "adam") == 440 * 4
    assert estimate_offload_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1), include_grads=False) == 440
    assert estimate_offload_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 440 * 3
    assert estimate_offload_bytes(model, torch.optim.AdamW, ranks_per_node=8) == 440 * 4 * 8
    with pytest.raises(ConfigError, match="optimizer 'lion' has no known state size"):
        estimate_offload_bytes(model, "lion")


def test_sharded_offload_divides_by_the_shards():
    model = torch.nn.Linear(10, 10)  # P = G = 440 bytes, Adam S = 880 bytes
    full = estimate_offload_bytes(model, "adam")
    assert estimate_offload_bytes(model, "adam", shards=4) == full // 4  # 110 + 110 + 220
    assert estimate_offload_bytes(model, "adam", shards=3) == 147 + 147 + 294  # each term rounded up
    model, full = torch.nn.Linear(16, 16, bias=False), 256 * 4 * 4  # fp32 + Adam: 16 bytes per parameter
    # FSDP FULL_SHARD / ZeRO-3 offload on 2 nodes of 8 ranks: each node holds half the model's state ...
    assert estimate_offload_bytes(model, "adam", ranks_per_node=8, shards=16) == full // 2
    # ... HYBRID_SHARD within a node of 8: each node holds all of it once, not 8 times over.
    assert estimate_offload_bytes(model, "adam", ranks_per_node=8, shards=8) == full
    assert estimate_offload_bytes(model, "adam", ranks_per_node=8) == 8 * full  # unsharded: every rank a copy


@pytest.mark.parametrize("kwargs", [{"shards": 0}, {"shards": True}, {"shards": 2.0}, {"ranks_per_node": 0},
                                    {"ranks_per_node": False}, {"ranks_per_node": "8"}])
def test_offload_counts_are_validated(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ConfigError) as exc:
        estimate_offload_bytes(torch.nn.Linear(2, 2), "adam", **kwargs)
    assert str(exc.value).startswith(f"{name}={value!r}; expected an int >= 1 (") and "Fix: pass" in str(exc.value)


# ----------------------------------------------------------------------------- Ray's default, reproduced
def test_ray_default_arithmetic(monkeypatch):
    assert ray_default_object_store(64 * GIB) == int(64 * GIB * 0.3)  # a fresh node: 30% of it
    assert ray_default_object_store(64 * GIB, 10 * GIB) == int(10 * GIB * 0.3)  # 30% of what is available
    assert ray_default_object_store(available_ram=40 * GIB, shm_bytes=64 * 2**20) == 10**10  # Docker's /dev/shm
    assert ray_default_object_store(2048 * GIB) == 200 * 10**9  # Ray's cap
    assert ray_default_object_store(2048 * GIB, shm_bytes=150 * GIB) == int(150 * GIB * 0.95)
    monkeypatch.setenv("RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION", "0.5")
    assert ray_default_object_store(10 * GIB) == 5 * GIB  # Ray's own override, honoured as Ray does
    with pytest.raises(ConfigError, match=r"^available_ram=0; expected an int number of bytes > 0\. Fix:"):
        ray_default_object_store(available_ram=0)


FRESH_NODE = r"""
import json
from robustdist.ray.memory import ray_default_object_store, ray_memory_plan
import ray

ours = [ray_default_object_store()]
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
try:
    ours.append(ray_default_object_store())
    chosen = ray.cluster_resources()["object_store_memory"]
finally:
    ray.shutdown()
ours.append(ray_default_object_store())
print(json.dumps({"ours": ours, "ray": chosen, "plan": ray_memory_plan().object_store_memory}))
"""


@pytest.mark.processes
@pytest.mark.ray
@pytest.mark.timeout(240, method="thread")
def test_ray_default_matches_what_a_starting_ray_node_chooses():
    """Against the object store a fresh Ray node really sizes itself to (``ray.init()`` without
    ``object_store_memory``, read back through the public ``ray.cluster_resources()``), not a copy of Ray's
    constants or a path to its private helper. In a fresh interpreter, on its own local node."""
    import json
    import subprocess
    import sys

    pytest.importorskip("ray")
    out = subprocess.run([sys.executable, "-c", FRESH_NODE], capture_output=True, text=True, timeout=200,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # Memory in use moves while the node starts: ours is read before, during and after; Ray's lies between.
    slack = 64 * 2**20
    assert min(seen["ours"]) - slack <= seen["ray"] <= max(seen["ours"]) + slack, seen
    assert seen["plan"] <= max(seen["ours"]) + slack, seen  # the plan never goes above Ray's own default
    assert "import ray" not in open(ray_memory.__file__).read()  # pure arithmetic on what Ray reads
