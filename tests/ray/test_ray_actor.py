"""RobustGPUActor on a real local Ray cluster: its device mapping and NUMA pinning, release() and what a
released attribute says, gpu_actor_options on a CPU-only cluster, and robustdist inside real Ray Train workers.
(The memory plan is in test_ray_memory.py.)"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
import pickle
import re
import sys

import pytest
import torch

from robustdist.ray import actor as ray_actor
from robustdist.ray.actor import RobustGPUActor, gpu_actor_options, gpu_positions, parse_cpulist, pin_to_numa
from robustdist.runtime.errors import ConfigError, TopologyError
from robustdist.testing.ranks import run_ranks

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


@pytest.mark.processes
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


# ----------------------------------------------------------------------------- release, locally
def _local_actor(monkeypatch):
    """A RobustGPUActor in this process (no Ray worker): only Ray's GPU assignment is faked (none)."""
    monkeypatch.setattr(ray_actor, "_assigned_gpu_ids", lambda: [])
    monkeypatch.setattr("robustdist.bf16.install_ray_serializers", lambda: None)
    actor = RobustGPUActor()
    actor.model, actor.cache, actor.note = torch.nn.Linear(2, 2), torch.zeros(3), "kept"
    return actor


def test_release_without_names_drops_nothing(monkeypatch, caplog):
    actor = _local_actor(monkeypatch)
    with caplog.at_level(logging.INFO, logger="robustdist"):
        assert actor.release() == []
    assert isinstance(actor.model, torch.nn.Module) and actor.cache.shape == (3,)
    assert "no attribute names given, so nothing was dropped" in caplog.text


def test_released_attributes_explain_themselves(monkeypatch, caplog):
    actor = _local_actor(monkeypatch)
    with caplog.at_level(logging.INFO, logger="robustdist"):
        assert actor.release("model", "absent") == ["model"]
    assert "dropped ['model'] (['absent'] not set on the actor)" in caplog.text
    with pytest.raises(AttributeError) as exc:
        actor.model
    assert str(exc.value) == ("RobustGPUActor.model was released by release('model') (deleted to free its memory), "
                              "so it is gone; expected it to be re-created before use. Fix: re-create it "
                              "(self.model = ...) before calling methods that use it, or release it only once it is "
                              "no longer needed.")
    # Any other missing name, dunders included, is a plain AttributeError: pickling and copying still work.
    with pytest.raises(AttributeError, match=r"^'RobustGPUActor' object has no attribute 'nothing'$"):
        actor.nothing
    assert not hasattr(actor, "__getstate_missing__") and not hasattr(actor, "absent")
    for clone in (pickle.loads(pickle.dumps(actor)), copy.deepcopy(actor), copy.copy(actor)):
        assert clone.note == "kept" and clone.cache.shape == (3,)
        with pytest.raises(AttributeError, match="was released by release"):
            clone.model
    actor.model = torch.nn.Linear(2, 2)  # re-created: an ordinary attribute again
    assert actor.model.in_features == 2


def test_shutdown_frees_every_tensor_and_module(monkeypatch):
    actor = _local_actor(monkeypatch)
    actor.__ray_shutdown__()
    assert not hasattr(actor, "model") and not hasattr(actor, "cache")
    assert actor.note == "kept" and actor.device == torch.device("cpu") and actor.devices == [torch.device("cpu")]


# ----------------------------------------------------------------------------- gpu_actor_options, offline
@pytest.mark.parametrize("bad", [0, -1, True, "1", float("nan"), float("inf"), None])
def test_gpu_actor_options_validates_num_gpus(bad):
    with pytest.raises(ConfigError, match=rf"^num_gpus={re.escape(repr(bad))}; expected a number > 0 .* Fix:"):
        gpu_actor_options(bad)


def test_gpu_actor_options_with_gpus(monkeypatch):
    """Only what needs GPUs is faked: the cluster's GPU figures."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    nodes = [{"Alive": True, "Resources": {"CPU": 8, "GPU": 1}}, {"Alive": True, "Resources": {"CPU": 8, "GPU": 1}},
             {"Alive": False, "Resources": {"GPU": 8}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16, "GPU": 2})
    assert gpu_actor_options(1) == {"num_gpus": 1} and gpu_actor_options(0.5) == {"num_gpus": 0.5}
    with pytest.raises(TopologyError) as exc:  # 2 GPUs in the cluster, but no node has 2: pending forever
        gpu_actor_options(2)
    assert str(exc.value).startswith("the Ray cluster has 2 GPUs (at most 1 on one node) and the actor asks for "
                                     "num_gpus=2, so Ray would keep the actor pending forever")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(TopologyError, match=r"found no Ray cluster to check .* Fix: call ray\.init"):
        gpu_actor_options(1)


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

        def rebuild(self, dim):
            self.model = torch.nn.Linear(dim, dim).to(self.device)

    actor = ray.remote(num_cpus=0, num_gpus=0)(Worker).remote(3)  # holds no CPU the Ray Train test needs
    yield ray, actor
    ray.kill(actor)


@pytest.mark.processes
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
    assert ray.get(actor.release.remote()) == []  # no names: nothing dropped, later calls still work
    assert ray.get(actor.attributes.remote()) == ["cache", "model"]
    assert ray.get(actor.forward.remote(torch.ones(1, 3))).shape == (1, 3)


@pytest.mark.processes
def test_released_attribute_through_ray(worker):
    ray, actor = worker
    assert ray.get(actor.release.remote("model")) == ["model"]
    assert ray.get(actor.attributes.remote()) == ["cache"]
    with pytest.raises(ray.exceptions.RayTaskError) as exc:
        ray.get(actor.forward.remote(torch.ones(1, 3)), timeout=60)
    assert isinstance(exc.value, AttributeError)  # Ray's error derives from the cause's type
    assert "Worker.model was released by release('model')" in str(exc.value)
    assert "Fix: re-create it (self.model = ...)" in str(exc.value)
    ray.get(actor.rebuild.remote(3))  # re-created: the actor works again
    assert ray.get(actor.forward.remote(torch.ones(1, 3)), timeout=60).shape == (1, 3)


@pytest.mark.processes
def test_gpu_actor_options_on_a_cpu_only_cluster(ray_cluster, caplog):
    ray = ray_cluster
    assert ray.cluster_resources().get("GPU", 0) == 0  # really CPU-only: num_gpus=1 would stay pending
    with pytest.raises(TopologyError) as exc:
        gpu_actor_options(1)
    assert str(exc.value) == ("the Ray cluster has 0 GPUs and the actor asks for num_gpus=1, so Ray would keep the "
                              "actor pending forever; expected a node with at least 1 GPU. Fix: add GPU nodes (or "
                              "start Ray with --num-gpus), ask for fewer GPUs, or pass fallback_to_cpu=True to run "
                              "the actor on the CPU.")
    with caplog.at_level(logging.WARNING, logger="robustdist"):
        options = gpu_actor_options(1, fallback_to_cpu=True)
    assert options == {"num_gpus": 0}
    assert "the Ray cluster has 0 GPUs and the actor asks for num_gpus=1: the actor will run on the CPU" in caplog.text

    class Probe(RobustGPUActor):
        pass

    actor = ray.remote(Probe).options(num_cpus=0, **options).remote()  # num_cpus=0: leaves Ray Train its CPUs
    try:
        health = ray.get(actor.health.remote(), timeout=60)  # ready, not pending
        assert health["device"] == "cpu" and health["assigned_gpu_ids"] == []
    finally:
        ray.kill(actor)


@pytest.mark.processes
@pytest.mark.timeout(300, method="thread")  # a last resort: Ray Train's driver loop can swallow the signal
def test_robustdist_inside_ray_train_workers(ray_cluster, tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
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
