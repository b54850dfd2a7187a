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
simply retry until the fresh one appears, bounded by ``distributed.init_timeout``. The process group, and
everything robustdist keeps in the default store (barrier arrivals, watchdog records), then lives in a store
that exists only for this attempt.

**The attempt number.** The agent's store lives as long as the job, so it can count attempts where the
environment cannot. Before publishing, rank 0 adds 1 to a counter key in the agent store (an atomic ``add``:
the value is ``attempt + 1``) and writes the attempt into the fresh store; the other ranks read it there,
after the token proved the store is this attempt's (never from a key an earlier attempt may have left in the
agent store). Every rank of the attempt therefore reports the same number (:func:`attempt_of`), 0 on the
first. For a store that outlives attempts but is no fresh one (the agent store without restarts, or a group
robustdist only adopted), :func:`count_attempt` is the same count, taken by rank 0 and shared through the
group by the caller (:func:`attempt_mode`, :func:`contribution`). Limit: torch 2.13 keeps the agent store on
the node whose agent was rendezvous rank 0 at the first rendezvous; if that node leaves an elastic job, the
next store starts counting at 0 again.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (needed in torch 2.13 for a restarted agent to rejoin) torchrun
gives the workers no store that outlives an attempt: rank 0's worker hosts a new one each time. Then, and only
then, the number is the largest ``TORCHELASTIC_RESTART_COUNT`` of any rank, agreed through the group: the
same on every rank, and at least the real attempt as far as any agent counted it (a restart that no agent
counted, such as a node joining an elastic job, is missed).

Why ``TORCHELASTIC_RESTART_COUNT`` cannot be used: each agent counts its own restarts of its own workers
(``max_restarts - remaining``). When a worker fails on one node, that node's agent restarts its workers and
counts 1; the other agents see the rendezvous change and restart theirs as a membership change, which does
not count. After one failure the variable is 1 on one node and 0 on the others (torch #108158, seen on a
2-node job), and a script that reads 0 as "fresh run" discards the checkpoint it should resume from. A
script can also overwrite the variable before init; the store's count does not depend on it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any


from robustdist.init import rendezvous as _rendezvous
from robustdist.runtime import _torch_compat
from robustdist.runtime import job_store
from robustdist.runtime.errors import InitError
from robustdist.runtime.log import get_logger
from robustdist.runtime.replacing import (
    ATTEMPT_STORE_ENV,
    ATTEMPT_TOKEN_KEY,
    RUN_ENV,
    attempt_store_info,
    job_of,
    publishable_host,
    published_store,
)

log = get_logger(__name__)
_KEY = "robustdist/attempt_store"
_TOKEN = ATTEMPT_TOKEN_KEY
_counted: dict[tuple[Any, ...], int] = {}  # (job id, store address) -> the attempt this process counted
_COUNTER = "robustdist/attempt_counter"  # in the agent's (job-lifetime) store: rank 0 adds 1 per attempt
_ATTEMPT = "robustdist/attempt"  # in the attempt's own store: the number rank 0 counted
_CONNECT_S = 5.0


def needed(environ: Mapping[str, str], init_method: str) -> bool:
    """True when torchrun can restart workers and shares its (job-lifetime) store with them."""
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    return (init_method.startswith("env://") and restarts > 0
            and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def attempt_mode(environ: Mapping[str, str], init_method: str) -> str:
    """Where this attempt's number comes from: ``"fresh-store"`` (restarts enabled and the agent's store shared:
    rank 0 counts in the agent store, the others read this attempt's store), ``"agent-store"`` (the agent's store
    shared, no per-attempt store: rank 0 counts, the group shares it), ``"restart-count"`` (torchrun without a
    shared store, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the largest ``TORCHELASTIC_RESTART_COUNT`` of any
    rank, shared through the group) or ``"none"`` (no torchrun: 0)."""
    shared = environ.get("TORCHELASTIC_USE_AGENT_STORE")
    if needed(environ, init_method):
        return "fresh-store"
    if shared == "True" and init_method.startswith("env://"):
        return "agent-store"
    return "none" if shared is None else "restart-count"


def contribution(mode: str, rank: int, job_store: Any, environ: Mapping[str, str]) -> int:
    """This rank's part of the attempt number, which the group then reduces with MAX: rank 0's count in the
    job's store (``"agent-store"``), this rank's ``TORCHELASTIC_RESTART_COUNT`` (``"restart-count"``), else 0."""
    if mode == "agent-store":
        return count_in_group_store(job_store) if rank == 0 else 0
    if mode == "restart-count":
        raw = environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
        return int(raw) if raw.isdigit() and len(raw) < 10 else 0
    return 0


def count_attempt(job_store: Any) -> int:
    """Rank 0 only, once per attempt: count this attempt in a store that lives as long as the job, and return
    its number (0 on the first). ``job_store`` may be wrapped in ``PrefixStore`` layers: the count is kept in the store
    under them, so a group robustdist created and one it adopted count in the same key."""
    raw = _torch_compat.innermost_store(job_store)
    # A process is one attempt (torchrun restarts workers as new processes): a second init in it (a retry, a
    # second harden()) is the same attempt, not the next.
    key = (os.environ.get("TORCHELASTIC_RUN_ID", ""), getattr(raw, "host", None), getattr(raw, "port", id(raw)))
    if key not in _counted:
        _counted[key] = int(raw.add(_COUNTER, 1)) - 1
    return _counted[key]


def count_in_group_store(store: Any) -> int:
    """Rank 0's :func:`count_attempt` in an adopted group's store (the agent's, for a group made with ``env://``
    under torchrun); -1 when there is no store or it cannot count (the attempt then falls back to 0)."""
    if store is None:
        return -1
    try:
        return count_attempt(store)
    except Exception as e:  # a custom store without add()
        log.warning("could not count this attempt in the process group's store (%s: %s); attempt is 0",
                    type(e).__name__, str(e)[:200])
        return -1


def attempt_of(store: Any, rank: int | None = None) -> int:
    """The attempt number rank 0 wrote into this attempt's store (see the module docstring); store content is input,
    so anything but a count is an InitError."""
    raw = store.get(_ATTEMPT)
    text = raw[:24].decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)[:24]
    if not text.isdigit() or int(text) >= 2**31:
        raise InitError(f"this attempt's store holds {text!r} as the attempt number; expected the count rank 0 writes "
                        f"there ({_ATTEMPT}). Fix: nothing else may write that key in the job's store.", rank=rank)
    return int(text)


def attempt_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float, *,
                  generation: int = 1) -> Any:
    """The store for this attempt (a server on rank 0, a client elsewhere), by ``timeout_s`` (the init timeout).

    ``generation`` is the process's rendezvous round: a second group made in the same process publishes its
    store under a key of its own, so a client cannot take the previous round's record, whose store a kept
    model may still hold open (its token would match)."""
    key = _KEY if generation <= 1 else f"{_KEY}/{generation}"
    served = served_by_agent(rank)
    if served is not None:
        return _agent_served(served, addr, port, rank, world_size, timeout_s, key)
    if rank == 0 and not publishable_host(addr):  # the other ranks would refuse to dial it: said here, at once
        raise InitError(f"MASTER_ADDR={addr[:300]!r} is not an address robustdist can publish to the other ranks "
                        "for this attempt's store; expected an IP address or an ASCII host name (letters, "
                        "digits, '.', '-', '_', ':', '%', brackets; at most 253 characters). Fix: set MASTER_ADDR "
                        "(torchrun's --master-addr or --rdzv-endpoint) to the node's IP address.", rank=rank)
    deadline = time.monotonic() + timeout_s
    endpoint = _rendezvous.Endpoint("env", f"MASTER_ADDR={addr!r}, MASTER_PORT={port}", host=addr, port=port,
                                    addresses=[addr])
    agent = _rendezvous.connect_tcp(endpoint, rank=rank, world_size=world_size, deadline=deadline,
                                    init_timeout=timeout_s, serving="torchrun's agent on the master node")
    if rank == 0:
        server = job_store.serve(addr, 0, world_size=world_size, timeout=timeout_s)
        token = uuid.uuid4().hex
        server.set(_TOKEN, token)
        server.set(_ATTEMPT, str(count_attempt(agent)))
        agent.set(key, json.dumps({"addr": addr, "port": server.port, "token": token}))
        log.debug("attempt store on %s:%d", addr, server.port)
        return server
    last_error = "no address published yet"
    while time.monotonic() < deadline:
        try:
            agent.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            info = published_store(agent.get(key))  # input: a garbled one is read again, and named at the deadline
            if info is None:
                last_error = (f"the address published under {key!r} is not the JSON rank 0 writes there (another "
                              "job on this port, or a garbled value)")
            else:
                store, last_error = _published_attempt_store(info, world_size, deadline, timeout_s)
                if store is not None:
                    return store
        except (RuntimeError, OSError, ValueError) as e:  # DistError is a RuntimeError; ValueError: a token not UTF-8
            last_error = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        time.sleep(0.2)
    raise InitError(f"could not reach rank 0's store for this torchrun attempt within {timeout_s:g} s (last: "
                    f"{last_error}); expected rank 0 to publish it in the agent store at {addr}:{port}. Fix: check "
                    "rank 0's log for an earlier failure, or raise distributed.init_timeout.", rank=rank)


def _published_attempt_store(info: dict[str, Any], world_size: int, deadline: float,
                              timeout_s: float) -> tuple[Any, str]:
    """(the attempt's store at the address rank 0 published, "") or (None, why not: the address is read again)."""
    host, port = info["addr"], info["port"]
    # a previous attempt's dead server refuses at once
    store, _, detail = _rendezvous.try_connect(host, port, world_size, min(deadline, time.monotonic() + _CONNECT_S),
                                               retry_refused=False)
    if store is None:
        return None, f"{host}:{port}: {detail}"
    if store.check([_TOKEN]) and store.get(_TOKEN).decode() == info["token"]:
        store.set_timeout(timedelta(seconds=timeout_s))
        return store, ""
    return None, f"{host}:{port} is a different store (a reused port)"


def served_by_agent(rank: int) -> dict[str, Any] | None:
    """``{"addr", "port", "token", "master", "run"}`` of the attempt's store where ``robustdist run``'s agent serves
    it (:data:`~robustdist.runtime.replacing.ATTEMPT_STORE_ENV`, only under :data:`~robustdist.runtime.replacing.RUN_ENV`),
    else None (rank 0 serves it). The environment is input: anything but what the agent sets is an InitError. A value
    made for another job (``master``/``run`` not this worker's ``MASTER_ADDR:MASTER_PORT`` and
    ``TORCHELASTIC_RUN_ID``: a torchrun started inside a worker inherits it) is not this job's: None."""
    raw = os.environ.get(ATTEMPT_STORE_ENV)
    if raw is None or os.environ.get(RUN_ENV) != "1":
        return None
    info = attempt_store_info(raw)
    if info is None:
        raise InitError(f"{ATTEMPT_STORE_ENV}={raw[:200]!r}; expected the JSON robustdist run's agent sets "
                        '({"addr": host, "port": 1-65535, "token": 32 hex digits, "master": "host:port", "run": '
                        'run id}). Fix: unset it (only the launcher sets it).', rank=rank)
    if (info["master"], info["run"]) != job_of():
        log.debug("%s names the job at %s (run %r), not this one: not used", ATTEMPT_STORE_ENV, info["master"],
                  info["run"])
        return None
    return info


def _agent_served(info: dict[str, Any], addr: str, port: int, rank: int, world_size: int, timeout_s: float,
                  key: str) -> Any:
    """A client of the attempt's store the agent serves, checked by its token; rank 0 counts the attempt there once
    (a replacement of rank 0 finds its predecessor's count), the others wait for that count. Rank 0 also publishes
    the store's address where a rank without the variable looks for rank 0's own (an agent that could not read
    node 0's address in time gives its workers none): they join the same store."""
    deadline = time.monotonic() + timeout_s
    host, served, last_error = info["addr"], info["port"], "not tried"
    while True:
        store, _, detail = _rendezvous.try_connect(host, served, world_size,
                                                   min(deadline, time.monotonic() + _CONNECT_S), retry_refused=True)
        if store is not None:
            break
        last_error = f"{detail}"
        if time.monotonic() >= deadline:
            raise InitError(f"could not reach this attempt's store at {host}:{served} within {timeout_s:g} s "
                            f"({last_error}); expected robustdist run's agent on node 0 to serve it. Fix: check that "
                            "launcher's log and the network to that node, or raise distributed.init_timeout.",
                            rank=rank)
        time.sleep(0.2)
    try:
        if not (store.check([_TOKEN]) and store.get(_TOKEN).decode("ascii", "replace") == info["token"]):
            raise InitError(f"the store at {host}:{served} is not this attempt's (its token differs); expected the one "
                            f"robustdist run's agent serves for this attempt. Fix: the attempt ended (see the "
                            "launcher's log); nothing else may listen on that port.", rank=rank)
        if rank == 0:
            agent = _rendezvous.connect_tcp(
                _rendezvous.Endpoint("env", f"MASTER_ADDR={addr!r}, MASTER_PORT={port}", host=addr, port=port,
                                     addresses=[addr]),
                rank=rank, world_size=world_size, deadline=deadline, init_timeout=timeout_s,
                serving="torchrun's agent on the master node")
            if not store.check([_ATTEMPT]):  # a replacement of rank 0 finds the count already there
                store.set(_ATTEMPT, str(count_attempt(agent)))
            agent.set(key, json.dumps({"addr": host, "port": served, "token": info["token"]}))  # (rank 0's record form)
        elif rank != 0:
            store.wait([_ATTEMPT], timedelta(seconds=max(0.1, deadline - time.monotonic())))
    except InitError:
        raise
    except (RuntimeError, OSError, ValueError) as e:  # DistError is a RuntimeError
        raise InitError(f"this attempt's store at {host}:{served} failed during the rendezvous ({type(e).__name__}: "
                        f"{str(e)[:300]}); expected rank 0 to count the attempt there within {timeout_s:g} s. Fix: "
                        "see rank 0's log and the launcher's.", rank=rank) from e
    store.set_timeout(timedelta(seconds=timeout_s))
    log.debug("attempt store served by robustdist run's agent at %s:%d", host, served)
    return store
