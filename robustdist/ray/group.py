"""Ray Train's process group, given up for robustdist's own when in-process recovery is on.

In-process recovery makes a new process group after a fault, in the same processes, so robustdist must own the
group. In a Ray Train worker, Ray made the default group (its ``TorchConfig`` backend, before the training function
started). With ``recovery.in_process: true`` the first ``harden`` in the worker takes it over (:func:`prepare`):
rank 0 picks a free port on its node and tells every rank through the store of Ray's group; every rank says it has
read it; then every rank destroys Ray's group, and ``harden`` creates robustdist's own at that address, served by
rank 0 as under ``env://``. Every later generation is served there again. Neither the environment (Ray's
``MASTER_ADDR``/``MASTER_PORT`` stay as Ray set them) nor the configuration changes: only the topology given to the
init carries the new address.

Ray keeps no handle on its group: its shutdown destroys whatever default group exists then (none, once ``h`` is
closed), and ``ray.train.report`` and Ray's collectives go through Ray's actors, not the torch group. A fault that
is recovered in process never reaches Ray's controller, so it does not count against ``FailureConfig.max_failures``;
one that escalates does, as before.

Taken over only where in-process recovery can recover: a gloo group of Ray's, a run whose own backend resolves to
gloo, DDP made by ``harden`` (NCCL, FSDP, ``TORCH_GLOO_LAZY_INIT``, a framework's DDP or any DDP module already
made keep Ray's group, and the recovery loop says it is off). Subgroups the script made on Ray's group before
``harden`` die with it, and once ``h`` is closed no default group is left (Ray's was given up).

Rank 0 publishes the port of a store server it already runs (port 0: the OS's choice, so no other process can take
it meanwhile); the init's own server on that port shares it, and :func:`release` drops this module's reference once
the group holds it (later generations serve the port afresh, as under ``env://``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime import group_teardown
from robustdist.runtime import job_store
from robustdist.runtime.deadline import bounded
from robustdist.runtime.errors import InitError, ranks_phrase
from robustdist.runtime.log import get_logger
from robustdist.runtime.store_barrier import wait_for
from robustdist.runtime.stored import Unreadable, json_value
from robustdist.runtime.topology import Topology

__all__ = ["prepare", "release", "taken"]

log = get_logger(__name__)
_KEY = "robustdist/ray-takeover"
_taken: dict[str, Any] = {}  # {"host", "port"}: robustdist's group's address, once Ray's group was given up
_server: list[Any] = []  # rank 0: the store server on that port, until the first group of robustdist's holds it


def taken() -> tuple[str, int] | None:
    """The address robustdist's group is served at in place of Ray's, or None (not taken over in this process)."""
    return (_taken["host"], _taken["port"]) if _taken else None


def release() -> None:
    """The first group is made (or its init failed): the server taken for the port goes with the group's store."""
    _server.clear()


def prepare(config: Any, topo: Topology, *, framework: str | None = None) -> Topology:
    """The topology ``harden`` inits with: in a Ray Train worker with ``recovery.in_process`` and a gloo DDP run,
    Ray's group is given up (first call) and the topology carries robustdist's own address; otherwise ``topo``.
    Once given up, every later call in this process gets that address (Ray's is gone)."""
    if topo.launcher != "ray_train":
        return topo
    if not _taken:
        if not config.recovery.in_process:
            return topo
        why = _why_not(config, topo, framework)
        if why is not None:
            if _dist.is_up():
                log.info("rank %d: Ray Train's process group is kept (%s); in-process recovery is off", topo.rank, why)
            return topo
        _take_over(config, topo)
    return dataclasses.replace(topo, master_addr=_taken["host"], master_port=_taken["port"])


def _endpoint(raw: bytes) -> tuple[str, int] | None:
    """The ``[host, port]`` rank 0 published, or None for anything else."""
    try:
        got = json_value(raw, 1024)
    except Unreadable:
        return None
    if isinstance(got, list) and len(got) == 2 and isinstance(got[0], str) and 0 < len(got[0]) <= 255 \
            and type(got[1]) is int and 0 < got[1] < 65536:
        return got[0], got[1]
    return None


def _why_not(config: Any, topo: Topology, framework: str | None) -> str | None:
    import torch

    backend = config.distributed.backend
    if not _dist.is_up() or _torch_compat.default_store() is None:
        return "no process group with a store exists"
    if _dist.backend_kind() != "gloo":
        return f"its backend is {_dist.backend_kind()}, not gloo"
    if backend not in ("auto", "gloo") or (backend == "auto" and torch.cuda.is_available()):
        return f"distributed.backend {backend!r} is not gloo here (CUDA is visible, or another backend is asked for)"
    if config.distributed.strategy != "ddp":
        return f"distributed.strategy is {config.distributed.strategy}"
    if framework is not None:
        return f"{framework} made the model's DDP on it"
    if group_teardown.live_ddp_modules():
        return "a DistributedDataParallel module made on it exists"
    if os.environ.get("TORCH_GLOO_LAZY_INIT"):
        return "TORCH_GLOO_LAZY_INIT is set"
    return None


def _take_over(config: Any, topo: Topology) -> None:
    rank, world = _dist.rank(), _dist.world_size()
    store = _torch_compat.default_store()
    bound = float(config.distributed.init_timeout)
    deadline = time.monotonic() + bound
    fix = ("Fix: call harden() in every worker's training function with the same configuration (recovery.in_process, "
           "distributed.strategy and backend alike on every rank), or set recovery.in_process: false.")
    if rank == 0:
        host = topo.master_addr or _node_ip()  # Ray's rendezvous reached rank 0 there
        server = job_store.serve(host, 0, world_size=world, multi_tenant=True, timeout=bound + 60)
        _server.append(server)
        port = int(server.port)
        acks = [f"{_KEY}/read/{r}" for r in range(1, world)]

        def publish() -> None:
            store.set(f"{_KEY}/endpoint", json.dumps([host, port]))
            wait_for(store, acks, deadline)  # rank 0 serves Ray's store: it goes last

        _, error, finished = bounded(publish, deadline + 5, "ray-takeover")
        missing = [r for r, k in zip(range(1, world), acks) if not _check(store, k)]
        if error is not None or not finished or missing:
            release()
            found = (f"{ranks_phrase(missing)} did not read robustdist's group address within {bound:g} s "
                     "(distributed.init_timeout)" if missing else "publishing robustdist's group address failed")
            raise InitError(
                f"giving up Ray Train's process group for in-process recovery: {found}"
                + (f" ({type(error).__name__}: {str(error)[:200]})" if error else "")
                + f"; expected every worker to take part. {fix}", rank=rank, ranks=missing) from error
    else:
        key = f"{_KEY}/endpoint"

        def read() -> Any:
            if not wait_for(store, [key], deadline):
                return None
            raw = bytes(store.get(key))
            got = _endpoint(raw)
            if got is None:  # the store is input: anything but rank 0's [host, port] is named, never unpacked
                raise InitError(
                    f"giving up Ray Train's process group for in-process recovery: read {raw[:120]!r} under the key "
                    f"{key!r} of Ray's store; expected the JSON [host, port] rank 0 publishes. Fix: another process "
                    "writes into this job's store (a second job on the same address?); give each job its own.",
                    rank=rank)
            store.set(f"{_KEY}/read/{rank}", "1")
            return got

        got, error, _ = bounded(read, deadline + 5, "ray-takeover")
        if isinstance(error, InitError):
            raise error
        if got is None:
            raise InitError(
                f"giving up Ray Train's process group for in-process recovery: rank 0 did not publish robustdist's "
                f"group address within {bound:g} s (distributed.init_timeout)"
                + (f" ({type(error).__name__}: {str(error)[:200]})" if error else "")
                + f"; expected rank 0 to take part. {fix} See rank 0's log.", rank=rank) from error
        host, port = got
    del store
    group_teardown.destroy_default_group()
    _taken.update(host=str(host), port=int(port))
    log.info("rank %d: Ray Train's process group given up for robustdist's own at %s:%d (recovery.in_process: a "
             "fault recovers in these processes, without Ray restarting the workers)", rank, host, port)


def _check(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # the store itself failed: the key counts as unread
        return False


def _node_ip() -> str:
    import ray.util

    return str(ray.util.get_node_ip_address())
