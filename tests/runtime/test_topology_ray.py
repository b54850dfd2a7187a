"""Topology next to Ray Train: only a real Ray Train worker's context counts as ``launcher="ray_train"``.

Ray Train V2 raises from ``ray.train.get_context()`` outside a worker; Train V1 (Ray's default before V2, and
``RAY_TRAIN_V2_ENABLED=0`` on later Ray) returns a stub whose local world size is 0, which once made
``detect_topology()`` and ``harden()`` raise ``TopologyError`` in any process that had imported ``ray.train``.
(a) patch-and-assert on stand-in contexts; (b) a real driver process that imported ``ray.train`` under each
Train version. Inside real Ray Train workers: ``tests/ray/test_ray_topology.py`` (V1) and
``tests/ray/test_ray_actor.py`` / ``tests/ray/test_ray_train_v2.py`` (V2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from robustdist.runtime.topology import detect_topology

ROOT = Path(__file__).resolve().parents[2]


class _Context:
    """A stand-in for ``ray.train.get_context()``'s answer."""

    def __init__(self, rank, world, local_rank, local_world, node_rank=0):
        self.values = {"get_world_rank": rank, "get_world_size": world, "get_local_rank": local_rank,
                       "get_local_world_size": local_world, "get_node_rank": node_rank}
        self.asked: list[str] = []

    def __getattr__(self, name):
        if name not in self.values:
            raise AttributeError(name)

        def getter():
            self.asked.append(name)
            return self.values[name]

        return getter


def _fake_ray_train(monkeypatch, get_context) -> None:
    module = types.ModuleType("ray.train")
    module.get_context = get_context  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray.train", module)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_a_train_v1_stub_context_is_not_ray_train(monkeypatch, clean_env):
    """Train V1 outside a worker: world size 1, local world size 0. Only the local world size is asked."""
    stub = _Context(0, 1, 0, 0)
    _fake_ray_train(monkeypatch, lambda: stub)
    topo = detect_topology()
    assert (topo.launcher, topo.rank, topo.world_size, topo.local_world_size) == ("single", 0, 1, 1)
    assert stub.asked == ["get_local_world_size"]  # a stub's other getters would each warn once


@pytest.mark.parametrize("values", [(None, None, None, 1), (0, 1, None, 1), (0, True, 0, 1), (0, 0, 0, 1)],
                         ids=["tune-session", "no-local-rank", "bool", "world-0"])
def test_a_context_without_a_workers_ranks_is_not_ray_train(monkeypatch, clean_env, values):
    _fake_ray_train(monkeypatch, lambda: _Context(*values))
    assert detect_topology().launcher == "single"


def test_a_context_that_raises_is_not_ray_train(monkeypatch, clean_env):
    def outside():
        raise RuntimeError("`get_context` cannot be used outside of a Ray Train training function")

    _fake_ray_train(monkeypatch, outside)
    assert detect_topology().launcher == "single"


def test_a_workers_context_is_ray_train(monkeypatch, clean_env):
    _fake_ray_train(monkeypatch, lambda: _Context(3, 4, 1, 2, node_rank=1))
    topo = detect_topology()
    assert (topo.launcher, topo.rank, topo.world_size, topo.local_rank, topo.local_world_size, topo.node_rank,
            topo.num_nodes) == ("ray_train", 3, 4, 1, 2, 1, 2)


def test_ray_train_is_not_consulted_unless_imported(monkeypatch, clean_env):
    monkeypatch.delitem(sys.modules, "ray.train", raising=False)
    assert detect_topology().launcher == "single"


DRIVER = r"""
import json, logging, warnings
import torch
import ray.train  # what a driver script does before building a TorchTrainer
from robustdist import harden
from robustdist.runtime.topology import detect_topology

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    topo = detect_topology()
    h = harden(torch.nn.Linear(2, 2))
    with h:
        out = h.model(torch.ones(1, 2))
print(json.dumps({"launcher": topo.launcher, "world": topo.world_size, "local_world": topo.local_world_size,
                  "harden": h.topology.launcher, "shape": list(out.shape),
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
"""


@pytest.mark.processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("v2", ["0", "1"], ids=["train-v1", "train-v2"])
def test_a_driver_that_imported_ray_train_is_a_single_process(v2):
    """A real driver process (no Ray cluster needed) under each Train version's setting."""
    pytest.importorskip("ray.train")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(RAY_TRAIN_V2_ENABLED=v2, RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=200, cwd=ROOT,
                         env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert (seen["launcher"], seen["world"], seen["local_world"], seen["harden"], seen["shape"]) == \
        ("single", 1, 1, "single", [1, 2]), seen
    # Train V1's stub warns "meant to only be called inside a Trainer" for each getter asked; robustdist asks
    # quietly, so no such warning reaches the user.
    assert not [w for w in seen["warnings"] if "Trainer" in w or "Tuner" in w], seen["warnings"]
