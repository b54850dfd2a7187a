"""The job's store: where every robustdist part makes a ``TCPStore`` server or client.

A server never waits for its clients in the constructor (every wait robustdist makes is its own, bounded: the
rendezvous, :mod:`.store_barrier`), and it uses libuv unless ``USE_LIBUV=0`` says otherwise, as torch's own
rendezvous reads it. ``multi_tenant``: a second server asked for on the same port in this process shares the
first (rank 0 re-initialising while a model it kept still holds its previous group). A client is a connection of
the caller's own: a store client serialises its operations, so a thread that shares another's waits behind it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["connect", "serve"]


def serve(host: str, port: int = 0, *, timeout: float | timedelta, world_size: int | None = None,
          multi_tenant: bool = False) -> Any:
    """A ``TCPStore`` server on ``host:port`` (port 0: a free one, read back from ``.port``); ``timeout`` bounds
    its own client's operations. Raises what torch raises (a port in use, an address this host does not own)."""
    return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False, multi_tenant=multi_tenant,
                         timeout=_delta(timeout), use_libuv=os.environ.get("USE_LIBUV", "1") == "1")


def connect(host: str, port: int, *, timeout: float | timedelta, world_size: int | None = None) -> Any:
    """A ``TCPStore`` client of ``host:port``; ``timeout`` bounds the handshake (torch retries inside it) and every
    later operation."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=_delta(timeout))


def _delta(timeout: float | timedelta) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
