"""The address rank 0 publishes when Ray Train's group is given up for in-process recovery is read from Ray's
store, which is input: anything but ``[host, port]`` is a named InitError on the reading rank, never a raw
unpacking error. A real TCPStore in this process stands in for Ray's group store (no Ray needed)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from robustdist.config.schema import HardenConfig
from robustdist.ray import group
from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import InitError
from robustdist.runtime.topology import Topology


@pytest.mark.parametrize("value", ['"host"', "[1, 2]", '["h", 0]', '["h", 70000]', '["h", true]', '["h", 1, 2]',
                                   "not json", "[" * 5000, '["' + "h" * 2000 + '", 1]'])
def test_a_hostile_published_address_is_a_named_error(monkeypatch, value):
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set("robustdist/ray-takeover/endpoint", value)
    monkeypatch.setattr(_dist, "rank", lambda group=None: 1)
    monkeypatch.setattr(_dist, "world_size", lambda group=None: 2)
    monkeypatch.setattr(_torch_compat, "default_store", lambda: store)
    topo = Topology(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0, num_nodes=1,
                    launcher="ray_train", device=torch.device("cpu"), master_addr="127.0.0.1", master_port=1,
                    visible_devices=None)
    start = time.monotonic()
    with pytest.raises(InitError) as info:
        group._take_over(HardenConfig.from_dict({"distributed": {"init_timeout": 5}}), topo)
    message = str(info.value)
    assert message.startswith("[rank 1] giving up Ray Train's process group for in-process recovery: read b")
    assert "under the key 'robustdist/ray-takeover/endpoint'" in message and "expected the JSON [host, port]" in message
    assert time.monotonic() - start < 5 and not group.taken()
