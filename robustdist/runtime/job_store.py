"""The job's store: where every robustdist part makes a ``TCPStore`` server or client.

A server never waits for its clients in the constructor (every wait robustdist makes is its own, bounded: the
rendezvous, :mod:`.store_barrier`), and it uses libuv unless ``USE_LIBUV=0`` says otherwise, as torch's own
rendezvous reads it. ``multi_tenant``: a second server asked for on the same port in this process shares the
first (rank 0 re-initialising while a model it kept still holds its previous group). A client is a connection of
the caller's own: a store client serialises its operations, so a thread that shares another's waits behind it
(:func:`connector`, :class:`StoreThread`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from robustdist.runtime import _torch_compat

__all__ = ["StoreThread", "connect", "connector", "serve"]

S = TypeVar("S", bound="StoreThread")


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


def connector(store: Any, timeout: float) -> Callable[[], Any]:
    """A function that opens a connection of the caller's own to ``store``'s TCPStore server (a thread sharing
    the group's would wait behind a main thread stuck in a store wait). Other store types are used as given."""
    inner = _torch_compat.innermost_store(store)
    if not isinstance(inner, dist.TCPStore):
        return lambda: store
    host, port = inner.host, inner.port
    return lambda: connect(host, port, timeout=timeout)


class StoreThread:
    """A daemon thread (its :meth:`_run`) that works on the job's store over a connection of its own (``connect``,
    from :func:`connector`), until it is stopped (``_stop``)."""

    def __init__(self, connect: Callable[[], Any], name: str) -> None:
        self._connect, self._name = connect, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        raise NotImplementedError

    def start(self: S) -> S:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _end(self, wait: float) -> None:
        """Stop it; wait at most ``wait`` s for the thread (a store call that does not return is abandoned: the
        thread is a daemon, and does nothing more once it returns)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=wait)

    def _client(self, client: Any) -> Any:
        """``client``, or a new connection when it is None; None when the thread is stopped (no connect is begun
        then, and one completed after the stop is not used: a store client retries its connect for its whole
        timeout, and an in-process recovery starts the next generation's server on the same port, so it may be
        to that server). Raises what the connect raises."""
        if client is not None:
            return client
        if self._stop.is_set():
            return None
        client = self._connect()
        return None if self._stop.is_set() else client
