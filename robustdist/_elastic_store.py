"""A fresh c10d store for each torchrun attempt, so a restarted group never reads the last attempt's keys.

torchrun (c10d rendezvous, torch >= 2.4) shares its agent's TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``) and, in torch 2.13, creates that store once per job: after a
restart (``--max-restarts``), ``init_process_group`` finds the previous attempt's keys (gloo peer addresses,
NCCL unique ids) still there. Verified here on torch 2.13 CPU: a gloo group re-initialised after a rank was
SIGKILLed fails with "Gloo connectFullMesh failed ... Connection refused" on the dead peer's old address
(torch #135712 describes the NCCL form). ``TORCHELASTIC_RESTART_COUNT`` cannot be used as a namespace: it
is counted per agent, so nodes disagree on it after a restart (torch #108158).

So when restarts are enabled (``TORCHELASTIC_MAX_RESTARTS > 0``) and the agent store is shared, rank 0
starts a new TCPStore on a free port and publishes its address and a random token in the agent store; the
other ranks read the address, connect, and check the token on the new store. A stale address from a
previous attempt points at a dead server (or, if its port was reused, a store without that token), so they
simply retry until the fresh one appears, bounded by the init timeout. The process group, and everything
robustdist keeps in the default store (barrier arrivals, watchdog records), then lives in a store that
exists only for this attempt.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from robustdist.errors import InitError
from robustdist.log import get_logger

log = get_logger(__name__)
_KEY = "robustdist/attempt_store"
_TOKEN = "robustdist/attempt_token"
_CONNECT_S = 5.0


def needed(environ: Mapping[str, str], init_method: str) -> bool:
    """True when torchrun can restart workers and shares its (job-lifetime) store with them."""
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    return (init_method.startswith("env://") and restarts > 0
            and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def attempt_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """The store for this attempt (a server on rank 0, a client elsewhere); see the module docstring."""
    agent = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    if rank == 0:
        server = dist.TCPStore(addr, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                               wait_for_workers=False)
        token = uuid.uuid4().hex
        server.set(_TOKEN, token)
        agent.set(_KEY, json.dumps({"addr": addr, "port": server.port, "token": token}))
        log.debug("attempt store on %s:%d", addr, server.port)
        return server
    deadline = time.monotonic() + timeout_s
    last_error = "no address published yet"
    while time.monotonic() < deadline:
        info = json.loads(agent.get(_KEY))  # blocks until rank 0 published (bounded by the store timeout)
        try:
            socket.create_connection((info["addr"], int(info["port"])), timeout=1.0).close()  # a dead one refuses now
            store = dist.TCPStore(info["addr"], int(info["port"]), world_size, is_master=False,
                                  timeout=timedelta(seconds=min(_CONNECT_S, timeout_s)))
            if store.check([_TOKEN]) and store.get(_TOKEN).decode() == info["token"]:
                store.set_timeout(timedelta(seconds=timeout_s))
                return store
            last_error = f"{info['addr']}:{info['port']} is a different store (a reused port)"
        except (RuntimeError, OSError, ValueError) as e:  # a previous attempt's dead server
            last_error = f"{info['addr']}:{info['port']}: {str(e).splitlines()[0]}"
        time.sleep(0.2)
    raise InitError(f"could not reach rank 0's store for this torchrun attempt within {timeout_s:g} s (last: "
                    f"{last_error}); expected rank 0 to publish it in the agent store at {addr}:{port}. Fix: check "
                    "rank 0's log for an earlier failure, or raise distributed.timeout.", rank=rank)
