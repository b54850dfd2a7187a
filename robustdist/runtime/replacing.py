"""What ``robustdist run``'s agent and its workers say to each other: environment variables and one key
in the agent's store. The standard library (and :mod:`.stored`) only: both sides import it (the launcher and :mod:`robustdist.recovery`
are peers)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["ATTEMPT_STORE_ENV", "ATTEMPT_STORE_KEY", "ATTEMPT_TOKEN_KEY", "REPLACES_ENV", "RUN_ENV", "STATE_KEY",
           "attempt_store_info", "job_of", "publishable_host", "published_store"]

RUN_ENV = "ROBUSTDIST_RUN"
"""Set to ``"1"`` by ``robustdist run`` for its workers: rank 0 then publishes its in-process recovery state."""

REPLACES_ENV = "ROBUSTDIST_REPLACES"
"""Set for a worker the agent started in place of a dead one: JSON ``{"rank", "pid", "died", "n", "master", "run"}``
(the global rank, the dead process's pid, how it died, the how-manyth replacement of this agent this is, and the job
it replaces a rank of, as :func:`job_of` the worker's environment: a process that inherited the value in another
job, such as a torchrun started inside the replacement, ignores it)."""

STATE_KEY = "robustdist/launcher/state"
"""In the agent's store (the job's lifetime): rank 0's current in-process recovery generation, as JSON
(:func:`robustdist.recovery.replacement.publish`). Present only while a run that can take a replacement trains:
the agent replaces a dead worker only then."""

ATTEMPT_STORE_ENV = "ROBUSTDIST_ATTEMPT_STORE"
"""Set by ``robustdist run``'s agents for every worker of an attempt, where torchrun shares its store with the workers
and can restart them (c10d rendezvous, ``--max-restarts`` > 0): JSON ``{"addr", "port", "token", "master", "run"}``
of the attempt's store (``master`` and ``run``: the job's ``MASTER_ADDR:MASTER_PORT`` and run id, which a worker
compares with its own), which the agent of node 0 serves (:mod:`robustdist.launcher.attempt_store`) in place of
rank 0's process, so the store outlives a killed rank 0. Its key ``token`` is the token's value in that store."""

ATTEMPT_STORE_KEY = "robustdist/launcher/attempt_store"
"""In the round's rendezvous store (fresh each round): the agent of node 0 publishes ``ATTEMPT_STORE_ENV``'s value
there for the other agents."""

ATTEMPT_TOKEN_KEY = "robustdist/attempt_token"
"""In an attempt's store (whoever serves it): the token its address was published with; a store on a reused port has
another, or none."""

_ADDR_RE = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")  # a host name (underscores too), IPv4, IPv6 (with a zone)
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")


def publishable_host(addr: str) -> bool:
    """Whether :func:`published_store` accepts ``addr`` as a host: an IP address or an ASCII host name."""
    return _ADDR_RE.fullmatch(addr) is not None


def published_store(raw: str | bytes, *, job: bool = False) -> dict[str, Any] | None:
    """``{"addr", "port", "token"}`` of a store's published address (with ``job``, also the ``master`` and ``run``
    it was published for), or None when ``raw`` is anything else: it is input, read back from a store or the
    environment."""
    try:
        info = json_value(raw, 1024)
    except Unreadable:
        return None
    keys = ("addr", "port", "token", "master", "run") if job else ("addr", "port", "token")
    ok = (isinstance(info, dict) and isinstance(info.get("addr"), str) and publishable_host(info["addr"])
          and type(info.get("port")) is int and 0 < info["port"] < 65536
          and isinstance(info.get("token"), str) and _TOKEN_RE.fullmatch(info["token"]) is not None
          and all(isinstance(info.get(k), str) and len(info[k]) <= 300 for k in keys[3:]))
    return {k: info[k] for k in keys} if ok else None


def attempt_store_info(raw: str) -> dict[str, Any] | None:
    """``{"addr", "port", "token", "master", "run"}`` from :data:`ATTEMPT_STORE_ENV`'s value, or None when it is
    anything else (both the agents, which pass it on, and the workers, which connect to it, check it)."""
    return published_store(raw, job=True)


def job_of(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``("MASTER_ADDR:MASTER_PORT", TORCHELASTIC_RUN_ID)`` of a worker's environment (this process's by default):
    the job a value ``robustdist run``'s agent sets for its workers belongs to. A process started inside a worker
    (a torchrun, another ``robustdist run``) inherits the value but has a job of its own."""
    env = os.environ if environ is None else environ
    return f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}", env.get("TORCHELASTIC_RUN_ID", "")
