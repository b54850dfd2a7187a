"""RobustGPUActor on a real local Ray cluster, its device mapping and NUMA pinning, the memory plan, and
robustdist inside real Ray Train workers."""

from __future__ import annotations

import collections
import dataclasses
import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from robustdist import ray_actor
from robustdist.errors import ConfigError, TopologyError
from robustdist.ray_actor import RobustGPUActor, gpu_positions, parse_cpulist, pin_to_numa
from robustdist.ray_memory import RAY_MIN_OBJECT_STORE, estimate_offload_bytes, ray_memory_plan
from robustdist.testing import run_ranks

Batch = collections.namedtuple("Batch", ["x", "y"])


@dataclasses.dataclass
class Sample:
    features: torch.Tensor
    label: int


# ----------------------------------------------------------------------------- pure device mapping
def test_gpu_positions():
    assert gpu_positions(["3"], "2,3") == [1]
    assert gpu_positions(["2", "3"], "2,3") == [0, 1]
    assert gpu_positions(["5"], "5") == [0]  # Ray narrowed CUDA_VISIBLE_DEVICES to the actor's GPU
    assert gpu_positions(["1"], None) == [1]  # unset: the id is the ordinal
    uuids = "GPU-aaaa-1111,GPU-bbbb-2222"
    assert gpu_positions(["GPU-bbbb-2222"], uuids) == [1]
    with pytest.raises(TopologyError) as exc:
        gpu_positions(["4"], "2,3")
    assert str(exc.value) == ("Ray assigned GPU '4' but it is not in this process's CUDA_VISIBLE_DEVICES='2,3'; "
                              "expected every assigned id to be visible. Fix: do not set CUDA_VISIBLE_DEVICES "
                              "yourself inside Ray actors (Ray narrows it per actor).")


def _fake_gpus(monkeypatch, assigned, visible, current):
    """Only what needs a GPU is faked: the ids Ray assigned and torch.cuda's device calls."""
    calls = []
    monkeypatch.setattr(ray_actor, "_assigned_gpu_ids", lambda: assigned)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr("robustdist.bf16.install_ray_serializers", lambda: None)
    return calls


def test_actor_maps_the_assigned_gpu_to_its_position(monkeypatch):
    calls = _fake_gpus(monkeypatch, ["3"], "2,3", current=1)
    actor = RobustGPUActor()
    assert calls == [1] and actor.device == torch.device("cuda", 1) and actor.devices == [torch.device("cuda", 1)]


def test_device_mismatch_is_a_topology_error(monkeypatch):
    _fake_gpus(monkeypatch, ["3"], "2,3", current=0)
    with pytest.raises(TopologyError, match=r"device mismatch: Ray assigned GPU ids \['3'\], CUDA_VISIBLE_DEVICES='2,3' "
                                            r"puts them at cuda:1, but torch uses cuda:0"):
        RobustGPUActor()


# ----------------------------------------------------------------------------- NUMA
def _fake_sysfs(root, bus, node, cpulist):
    dev = root / "bus/pci/devices" / bus
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{node}\n")
    (dev / "local_cpulist").write_text(f"{cpulist}\n")


def _pin_in_child(rank, root, bus):
    before = sorted(os.sched_getaffinity(0))
    node, cpus = pin_to_numa(bus, root)
    return before, node, None if cpus is None else sorted(cpus), sorted(os.sched_getaffinity(0))


def test_numa_pinning_against_a_fake_sysfs(tmp_path):
    first_cpu = min(os.sched_getaffinity(0))
    _fake_sysfs(tmp_path, "0000:3b:00.0", 1, f"{first_cpu}")
    _fake_sysfs(tmp_path, "0000:af:00.0", 0, "4000-4001")
    pinned, absent, missing = (run_ranks(_pin_in_child, 1, args=(str(tmp_path), bus), init=False, timeout=60)[0]
                               for bus in ("0000:3B:00.0", "0000:af:00.0", "0000:00:00.0"))
    assert pinned[1:] == (1, [first_cpu], [first_cpu])  # affinity really changed (in a child process)
    assert absent[1] == 0 and absent[2] is None and absent[3] == absent[0]  # CPUs that do not exist: a no-op
    assert missing[1:3] == (None, None) and missing[3] == missing[0]
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}


# ----------------------------------------------------------------------------- memory plan
GIB = 2**30


@given(st.integers(1, 1024), st.integers(0, 512), st.integers(0, 64))
def test_memory_plan_never_exceeds_ram_and_is_monotonic(ram_gib, offload_gib, pinned_gib):
    ram, offload, pinned = ram_gib * GIB, offload_gib * GIB, pinned_gib * GIB
    try:
        plan = ray_memory_plan(total_ram=ram, offload_bytes=offload, pinned_bytes=pinned)
    except ConfigError as e:
        assert "no safe object store size" in str(e) and "short by" in str(e)
        assert ram * 0.9 - offload - pinned < RAY_MIN_OBJECT_STORE
        return
    assert plan.offload_bytes + plan.pinned_bytes + plan.headroom_bytes + plan.object_store_memory <= ram
    assert plan.object_store_memory <= 0.3 * ram
    bigger = ray_memory_plan(total_ram=ram + GIB, offload_bytes=offload, pinned_bytes=pinned)
    assert bigger.object_store_memory >= plan.object_store_memory  # rises with RAM
    if offload >= GIB:
        less = ray_memory_plan(total_ram=ram, offload_bytes=offload - GIB, pinned_bytes=pinned)
        assert less.object_store_memory >= plan.object_store_memory  # falls with offload


def test_memory_plan_spells_out_the_arithmetic():
    plan = ray_memory_plan(total_ram=64 * GIB, offload_bytes=40 * GIB)
    assert plan.object_store_memory == 64 * GIB - int(64 * GIB * 0.1) - 40 * GIB  # below Ray's 30% default
    assert plan.explanation == ("total RAM 64.00 GiB - headroom 6.40 GiB - CPU offload 40.00 GiB - pinned buffers "
                                "0.00 GiB = usable 17.60 GiB; object store 17.60 GiB")
    assert plan.ray_init_kwargs() == {"object_store_memory": plan.object_store_memory}
    with pytest.raises(ConfigError) as exc:
        ray_memory_plan(total_ram=16 * GIB, offload_bytes=15 * GIB)
    assert str(exc.value).startswith("no safe object store size: total RAM 16.00 GiB - headroom 1.60 GiB (10%) - CPU "
                                     "offload 15.00 GiB - pinned buffers 0.00 GiB = -0.60 GiB, below Ray's minimum")


def test_estimate_offload_bytes():
    model = torch.nn.Linear(10, 10)  # 110 fp32 parameters = 440 bytes
    assert estimate_offload_bytes(model, "adam") == 440 * 4
    assert estimate_offload_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1), include_grads=False) == 440
    assert estimate_offload_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 440 * 3
    assert estimate_offload_bytes(model, torch.optim.AdamW, ranks_per_node=8) == 440 * 4 * 8
    with pytest.raises(ConfigError, match="optimizer 'lion' has no known state size"):
        estimate_offload_bytes(model, "lion")


# ----------------------------------------------------------------------------- a real Ray cluster
@pytest.fixture(scope="module")
def worker(ray_cluster):
    ray = ray_cluster

    class Worker(RobustGPUActor):
        def __init__(self, dim):
            super().__init__()
            self.model = torch.nn.Linear(dim, dim).to(self.device)
            self.cache = torch.zeros(1000)

        def forward(self, x):
            return self.model(self.to_device(x))

        def move(self, obj):
            return self.to_device(obj)

        def echo(self, t):
            return t

        def attributes(self):
            return sorted(k for k in vars(self) if k in ("model", "cache"))

    actor = ray.remote(num_cpus=0, num_gpus=0)(Worker).remote(3)  # holds no CPU the Ray Train test needs
    yield ray, actor
    ray.kill(actor)


def test_actor_on_cpu(worker):
    ray, actor = worker
    assert ray.get(actor.forward.remote(torch.ones(2, 3))).shape == (2, 3)
    nested = {"batch": Batch(torch.ones(2), [torch.zeros(1), (torch.arange(3),)]),
              "sample": Sample(torch.ones(2), 7), "name": "x"}
    moved = ray.get(actor.move.remote(nested))
    assert isinstance(moved["batch"], Batch) and isinstance(moved["sample"], Sample) and moved["name"] == "x"
    assert torch.equal(moved["batch"].y[1][0], torch.arange(3)) and moved["sample"].label == 7
    health = ray.get(actor.health.remote())
    assert health["device"] == "cpu" and health["devices"] == ["cpu"] and health["assigned_gpu_ids"] == []
    assert health["rss_bytes"] > 0 and health["pid"] != os.getpid() and health["node_id"]
    assert set(health["versions"]) == {"python", "torch", "ray", "robustdist"} and health["cpu_affinity"]
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    back = ray.get(actor.echo.remote(bits))
    assert torch.equal(back.view(torch.int16), bits.view(torch.int16))  # bit-exact, NaN payloads included
    assert ray.get(actor.release.remote()) == ["model", "cache"] or sorted(ray.get(actor.attributes.remote())) == []
    assert ray.get(actor.attributes.remote()) == []


@pytest.mark.timeout(300, method="thread")  # a last resort: Ray Train's driver loop can swallow the signal
def test_robustdist_inside_ray_train_workers(ray_cluster, tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    try:
        import ray_train_example
    finally:
        sys.path.pop(0)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(ray_train_example)  # the workers cannot import examples/
    result = ray_train_example.build_trainer(str(tmp_path / "ray"), str(tmp_path / "ckpt"), epochs=2).fit()
    assert result.error is None
    assert result.metrics["launcher"] == "ray_train" and result.metrics["world_size"] == 2
    assert result.metrics["created_group"] is False  # harden() used Ray's group as it is
    assert result.metrics["model"] == "DistributedDataParallel" and result.metrics["agreement"] == "gradients"
    assert result.metrics["epoch"] == 1 and result.checkpoint is not None
    from robustdist.checkpoint import AtomicCheckpointer

    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    loaded = AtomicCheckpointer(tmp_path / "restore").load(result.checkpoint, state={"model": model})
    assert loaded.step == 1 and loaded.manifest["world_size"] == 2
