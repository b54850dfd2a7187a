"""Each attempt's store, served by ``robustdist run``'s agent on node 0 instead of rank 0's process.

Under torchrun with ``--max-restarts`` and the agent's store shared with the workers, rank 0's process serves a fresh
TCPStore for each attempt (:mod:`robustdist.init.elastic_store`), and every in-process recovery generation keeps its
keys there: when rank 0 is killed the store goes with it, the survivors cannot agree on anything, and the job restarts.
Under ``robustdist run`` the agent of the round's node 0 (the node that runs global rank 0) serves that store from its
own process instead: started before the attempt's workers, closed when the next attempt starts or the launcher ends.
It is still a fresh store per attempt (nothing of an earlier one is read), and now one that outlives any worker, so a
killed rank 0 is replaced alone as any other rank is. The other agents read its address in the round's rendezvous
store (its keys are the round's own), and every agent gives it to its workers in
:data:`~robustdist.runtime.replacing.ATTEMPT_STORE_ENV`.

Only with c10d rendezvous (``--rdzv-backend c10d``, or ``--standalone``), the store shared and ``--max-restarts`` > 0;
otherwise (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, static rendezvous, no restarts) nothing changes: rank 0 serves,
and a killed rank 0 restarts every worker, as under torchrun. When node 0's agent cannot serve, it says so to the
others and every worker falls back to that. An agent that cannot read node 0's address within :attr:`wait_s` gives
its workers none: they look for the store where rank 0 publishes its own, and rank 0, served by the agent,
publishes the agent's there too, so they join the same store.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from robustdist.runtime import job_store
from robustdist.runtime.replacing import ATTEMPT_STORE_ENV, ATTEMPT_STORE_KEY, ATTEMPT_TOKEN_KEY, attempt_store_info
from robustdist.runtime.store_barrier import wait_for

__all__ = ["AttemptStore"]

log = logging.getLogger(__name__)  # the launcher is no rank: no rank prefix


class AttemptStore:
    """The agent's side: :meth:`start` before each attempt's workers start, :meth:`close` at the end."""

    def __init__(self, wait_s: float = 30.0) -> None:
        self.wait_s = wait_s  # how long an agent of another node waits for node 0's address (the same round)
        self._server: Any = None
        self.serves = False  # this agent serves the current attempt's store (its node runs rank 0)

    def start(self, group: Any) -> bool:
        """Before ``group``'s workers start: serve (node 0) or look up this attempt's store and put its address in the
        environment the workers inherit. False (the variable unset: rank 0's process serves) where it cannot."""
        self.close()
        os.environ.pop(ATTEMPT_STORE_ENV, None)
        spec = group.spec
        try:
            handler = spec.rdzv_handler
            eligible = (handler.get_backend() == "c10d" and bool(handler.use_agent_store) and spec.max_restarts > 0)
        except Exception as e:  # a rendezvous handler of another kind
            log.info("robustdist run: rank 0's process serves each attempt's store (rendezvous handler %s: %s)",
                     type(getattr(spec, "rdzv_handler", None)).__name__, e)
            return False
        if not eligible:
            return False
        rounds = group.store  # the round's own keys (torch's c10d rendezvous prefixes them with the round)
        try:
            if group.group_rank == 0:
                value = self._serve(spec, f"{group.master_addr}:{group.master_port}", handler.get_run_id())
                rounds.set(ATTEMPT_STORE_KEY, value)
            else:
                value = self._read(rounds)
        except SignalException:  # torchrun's SIGTERM: the agent shuts down
            self.close()
            raise
        except Exception as e:  # its workers look for rank 0's store; rank 0, served, publishes it there too
            self.close()
            log.warning("robustdist run: no agent-served store for this attempt (%s: %s); this node's workers look for "
                        "it where rank 0 publishes it. Fix: check node 0's launcher log.", type(e).__name__,
                        str(e)[:300])
            return False
        if attempt_store_info(value) is None:
            self.close()
            log.warning("robustdist run: node 0's agent serves no store for this attempt (%s); rank 0's process "
                        "serves it, so a killed rank 0 restarts every worker", value[:300])
            return False
        os.environ[ATTEMPT_STORE_ENV] = value
        self.serves = self._server is not None
        return True

    def _read(self, rounds: Any) -> str:
        """Node 0's published value, polled (a ``wait`` would hold the agent's store client, which torch's rendezvous
        heartbeats share, for as long as it waits)."""
        if not wait_for(rounds, [ATTEMPT_STORE_KEY], time.monotonic() + self.wait_s, poll=0.1):
            raise TimeoutError(f"node 0's agent published no address within {self.wait_s:g} s")
        return str(rounds.get(ATTEMPT_STORE_KEY).decode("utf-8", "replace"))

    def _serve(self, spec: Any, master: str, run: str) -> str:
        host = getattr(spec, "local_addr", None) or socket.getfqdn()
        if attempt_store_info(json.dumps({"addr": host, "port": 1, "token": "0" * 32, "master": master,
                                          "run": run})) is None:
            return json.dumps({"none": f"this node's address {host[:100]!r} is not a host name or IP address"})
        try:
            self._server = job_store.serve(host, 0, timeout=30)
            token = uuid.uuid4().hex
            self._server.set(ATTEMPT_TOKEN_KEY, token)
        except SignalException:
            self.close()
            raise
        except Exception as e:  # told to the other agents, so every worker falls back alike
            self.close()
            return json.dumps({"none": f"could not serve on {host}: {type(e).__name__}: {str(e)[:200]}"})
        log.info("robustdist run: this attempt's store is served by this agent at %s:%d", host, self._server.port)
        return json.dumps({"addr": host, "port": int(self._server.port), "token": token, "master": master, "run": run})

    def close(self) -> None:
        """Stop serving the store (its attempt's workers are gone: called when the agent stops them, before the next
        attempt starts and at the end, so no worker of a later attempt can find it through an old record): the server
        stops with the last reference to it,
        which is this one (a master ``TCPStore`` is not multi-tenant and nothing else here holds it)."""
        self._server, self.serves = None, False
