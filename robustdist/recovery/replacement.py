"""A worker started in place of a dead one joins the survivors' in-process recovery (``robustdist run``).

Under ``robustdist run`` (:data:`~robustdist.runtime.replacing.RUN_ENV`), rank 0 of every in-process generation
publishes where the generation stands in the agent's store (:func:`publish`: the recovery scope, the generation,
its store's address, and the per-process counters that name store keys), and withdraws it when the run ends. When
a worker is killed by a signal the agent starts it again alone (:mod:`robustdist.launcher.agent`), with
:data:`~robustdist.runtime.replacing.REPLACES_ENV`. The new process runs the script from the top; its ``harden``
calls :func:`join` before it makes its group:

1. it reads the published state (bounded by ``distributed.init_timeout``, like every step here);
2. in that generation's store, it declares the dead rank's fault (so every survivor's watch gets it out of what it
   waits in: a collective with the dead rank fails at once anyway), then gives the decision the dead process cannot,
   "recover", and leaves the generation as the survivors do;
3. it waits for the generation's verdict: "recover" and it takes the survivors' counters and generation number, so
   its group is made at their next rendezvous round and ``h.run`` continues in their next generation, resuming from
   the in-memory tier (its node's copy, or the replica) as every rank does; anything else (the survivors escalated)
   and it raises :class:`~robustdist.RecoveryError`, so the launcher's restart takes over.

The store and the environment are input: a state that is not the expected JSON, names another world size, a
scope or counter out of form, or an environment naming another rank, is a :class:`~robustdist.RecoveryError`
naming what was found.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Any


from robustdist.health import watchdog as _watchdog
from robustdist.init import elastic_store as _elastic_store
from robustdist.init import process_group as _process_group
from robustdist.init import reach as _reach
from robustdist.init import rendezvous as _rendezvous
from robustdist.recovery import handover
from robustdist.recovery.faults import SCOPE, declare_found
from robustdist.runtime import _torch_compat
from robustdist.runtime import job_store
from robustdist.runtime.deadline import bounded
from robustdist.runtime.errors import InitError, RecoveryError
from robustdist.runtime.log import get_logger
from robustdist.runtime.node import node_label
from robustdist.runtime.replacing import REPLACES_ENV, RUN_ENV, STATE_KEY, job_of
from robustdist.runtime.store_barrier import wait_for
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["COUNTERS", "counters", "join", "publish", "withdraw"]

log = get_logger(__name__)

COUNTERS: dict[str, tuple[Any, str]] = {
    "rendezvous": (_rendezvous, "_generation"), "reach": (_reach, "_generation"),
    "barrier": (_process_group, "_barrier_generation"), "watchdog": (_watchdog, "_generation")}
"""Every per-process counter that names store keys (the same sequence on every rank that made the same calls): a
replacement takes the survivors' values. ``tests/recovery/test_replacement.py`` checks no other such counter exists."""

_MAX_STATE = 8192  # bytes of a published state read as JSON
_MAX_COUNT = 2**31
_SCOPE_RE = re.compile(re.escape(SCOPE) + r"/([0-9]{1,9})")
_published: dict[str, Any] = {}  # "at": where rank 0 published (to withdraw); "joined": this process joined once


def counters() -> dict[str, int]:
    return {name: int(getattr(module, attr)) for name, (module, attr) in COUNTERS.items()}


def _agent_endpoint() -> tuple[str, int] | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    return (host, int(port)) if host and port.isdigit() and len(port) < 6 else None


def _connect(host: str, port: int, deadline: float, what: str, rank: int, retry: bool = True) -> Any:
    store, kind, detail = _rendezvous.try_connect(host, port, 1, deadline, retry_refused=retry)
    if store is None:
        raise RecoveryError(f"could not reach {what} at {host}:{port} ({kind}: {detail}); expected it to answer. Fix: "
                            "check the launcher's log (robustdist run) and the network to that host.", rank=rank)
    return store


def publish(store: Any, scope: str, generation: int, world: int, fingerprint: str, timeout: float = 10.0) -> None:
    """Rank 0, at the start of each in-process generation under ``robustdist run``: say where the run stands, in the
    agent's store. Only for the script's first ``h.run`` (a replacement runs the script from the top, so it can only
    stand in for that one). Never raises (without it, a dead worker restarts the job, as under torchrun)."""
    if os.environ.get(RUN_ENV) != "1" or (endpoint := _agent_endpoint()) is None or not scope.endswith("/1"):
        return
    inner = _torch_compat.innermost_store(store)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if not host or not port:
        return
    try:  # the store this generation lives in is the one robustdist run's agent serves: it outlives rank 0
        served = _elastic_store.served_by_agent(0)
    except InitError:  # already refused at init: not this process's store then
        served = None
    kept = served is not None and (served["addr"], served["port"]) == (host, int(port))
    state = json.dumps({"scope": scope, "generation": generation, "world": world, "host": host, "port": int(port),
                        "counters": counters(), "fingerprint": fingerprint, "pid": os.getpid(), "wall": time.time(),
                        "outlives_rank0": kept})

    def put() -> None:  # a connection per call: under TORCH_DISABLE_SHARE_RDZV_TCP_STORE rank 0's own process serves
        # the job's port, a new server each generation
        _connect(*endpoint, time.monotonic() + timeout, "the agent's store", 0).set(STATE_KEY, state)

    end = time.monotonic() + timeout
    _, problem, finished = bounded(put, end, "replacement-publish", ends_by=end + 15)
    if problem is not None or not finished:
        log.warning("rank 0: could not publish in-process generation %d in robustdist run's store (%s); a worker "
                    "killed now restarts every worker. Fix: check the launcher on the master node.", generation,
                    f"{type(problem).__name__}: {str(problem)[:200]}" if problem else "no answer")
    else:
        _published["at"] = endpoint


def withdraw(timeout: float = 5.0) -> None:
    """Rank 0, when its run ends (or escalates): a worker dying now is not replaced. Never raises."""
    endpoint = _published.pop("at", None)
    if endpoint is None:
        return
    try:  # the store went with this process's last generation (rank 0 served it): the key went with it
        with socket.create_connection(endpoint, timeout=1.0):
            pass
    except OSError:
        return
    end = time.monotonic() + timeout
    bounded(lambda: _connect(*endpoint, end, "the agent's store", 0).delete_key(STATE_KEY), end,
            "replacement-withdraw", ends_by=end + 15)


def _state(raw: bytes, world: int, rank: int) -> dict[str, Any]:
    """The published state, checked (store content is input)."""
    def bad(found: str) -> RecoveryError:
        return RecoveryError(f"the in-process state in robustdist run's store ({STATE_KEY}) is {found}; expected the "
                             "JSON rank 0 publishes. This replacement cannot join, so the launcher's restart takes over."
                             " Fix: nothing else may write that key (another job on the same rendezvous endpoint?).",
                             rank=rank)
    try:
        state = json_value(raw, _MAX_STATE)
    except Unreadable as e:
        raise bad(str(e)) from None
    if not isinstance(state, dict):
        raise bad(f"a JSON {type(state).__name__}")
    scope, gen, counts = state.get("scope"), state.get("generation"), state.get("counters")
    if not isinstance(scope, str) or not _SCOPE_RE.fullmatch(scope):
        raise bad(f"a state with scope {str(scope)[:80]!r}")
    if not isinstance(gen, int) or isinstance(gen, bool) or not 0 <= gen < _MAX_COUNT:
        raise bad(f"a state with generation {str(gen)[:80]}")
    if state.get("world") != world:
        raise bad(f"a state of world size {str(state.get('world'))[:80]} (this worker's is {world})")
    if not isinstance(state.get("host"), str) or not isinstance(state.get("port"), int) or \
            not 0 < state["port"] < 65536:
        raise bad("a state without a valid store address")
    if not isinstance(state.get("fingerprint"), str):
        raise bad("a state without a configuration fingerprint")
    if not isinstance(counts, dict) or set(counts) != set(COUNTERS) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_COUNT for v in counts.values()):
        raise bad(f"a state with counters {str(counts)[:200]}")
    return state


def _replaces(rank: int) -> dict[str, Any] | None:
    """What :data:`REPLACES_ENV` says, where it was set for this rank of this job (under ``robustdist run``); None
    where it is unset or was set for another job (inherited by a process a worker started). Anything else it holds
    is a named error."""
    raw = os.environ.get(REPLACES_ENV)
    if raw is None or os.environ.get(RUN_ENV) != "1":
        return None
    try:
        info = json_value(raw, 65536)  # the run id (--rdzv-id) may be long
    except Unreadable:
        info = None
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("master", "run")):
        info = None
    elif (info["master"], info["run"]) != job_of():
        log.debug("%s names a replacement in the job at %s (run %r), not this one: not used", REPLACES_ENV,
                  info["master"][:300], info["run"][:300])
        return None
    if info is None or info.get("rank") != rank or isinstance(info.get("rank"), bool):
        raise RecoveryError(f"{REPLACES_ENV}={raw[:200]!r}; expected the JSON robustdist run sets for a replacement of "
                            f'this rank ({rank}): {{"rank": {rank}, "pid", "died", "n", "master": "host:port", "run": '
                            "run id}. Fix: unset it (only the launcher sets it).", rank=rank)
    return info


def join(*, in_process: bool, rank: int, world: int, init_timeout: float,
         fingerprint: str = "") -> tuple[int, int] | None:
    """In a replacement's first ``harden`` (before its group exists): join the survivors' next generation, as the
    module docstring says, and return ``(call, generation)`` for :func:`robustdist.recovery.loop.continue_as`; None
    (nothing done) in any other process. Raises :class:`~robustdist.RecoveryError`."""
    if _published.get("joined") or (info := _replaces(rank)) is None:
        return None
    _published["joined"] = True  # once per process: a later harden() here is an ordinary one
    if not in_process:
        raise RecoveryError(f"this process replaces dead rank {rank} (robustdist run), but its config has "
                            "recovery.in_process off; expected the configuration the other ranks run. Fix: give every "
                            "rank the same config.", rank=rank)
    if (endpoint := _agent_endpoint()) is None:
        raise RecoveryError(f"this process replaces dead rank {rank}, but MASTER_ADDR/MASTER_PORT do not name the "
                            "agent's store; expected robustdist run's environment. Fix: launch with robustdist run.",
                            rank=rank)
    start = time.monotonic()
    deadline = start + init_timeout
    log.warning("rank %d: this process replaces the dead one (pid %s, %s): joining the others' in-process recovery "
                "through the store at %s:%d (at most %g s)", rank, info.get("pid"), str(info.get("died"))[:100],
                *endpoint, init_timeout)

    def take_part() -> tuple[dict[str, Any], str]:
        agent = _connect(*endpoint, deadline, "the agent's store", rank)
        if not wait_for(agent, [STATE_KEY], deadline, poll=0.05):
            raise RecoveryError(f"no in-process state in robustdist run's store within {init_timeout:g} s; "
                                "expected rank 0 to publish it while the run trains. Fix: see rank 0's log.",
                                rank=rank)
        state = _state(agent.get(STATE_KEY), world, rank)
        scope, gen = state["scope"], state["generation"]
        if fingerprint and state["fingerprint"] != fingerprint:
            raise RecoveryError(f"this replacement's configuration (fingerprint {fingerprint[:12]}) is not the one the "
                                f"others run (rank 0's: {state['fingerprint'][:12]}); expected the script's first "
                                "harden() to be the run's. The launcher's restart takes over. Fix: give every rank the "
                                "same config, and harden the run once per script.", rank=rank)
        # a store that refuses at once is gone (its generation with it): no retrying until the deadline
        store = _connect(state["host"], state["port"], deadline, f"generation {gen}'s store", rank, retry=False)
        what = (f"the process of rank {rank} (pid {info.get('pid')}) died ({str(info.get('died'))[:100]}); "
                f"robustdist run started a replacement (pid {os.getpid()})")
        declare_found(store, generation=gen, found={rank: (node_label(), what)}, by=-1, world_size=world, scope=scope)
        # for the dead process, which cannot: unless it decided before it died (then its word stands)
        store.compare_set(f"{scope}/{gen}/decision/{rank}", "", "recover")
        store.set(f"{scope}/{gen}/left/{rank}", "1")
        verdict = f"{scope}/{gen}/verdict"
        wait_for(store, [verdict], deadline, poll=0.05)
        return state, store.get(verdict).decode("ascii", "replace") if store.check([verdict]) else "none"

    value, problem, finished = bounded(take_part, deadline + 5, "replacement-join", ends_by=deadline + 20)
    if problem is not None:
        if isinstance(problem, RecoveryError):
            raise problem
        raise RecoveryError(f"this replacement of rank {rank} could not join the survivors ({type(problem).__name__}: "
                            f"{str(problem)[:300]}); expected their generation's store to answer. The launcher's "
                            "restart takes over. Fix: see rank 0's log.", rank=rank) from problem
    if not finished or value[1] != "recover":
        raise RecoveryError(f"this replacement of rank {rank} found the survivors' verdict "
                            f"{'missing' if not finished else repr(value[1][:80])} after {time.monotonic() - start:.1f} s;"
                            " expected \"recover\" (they escalated, or gave up waiting: distributed.init_timeout). The "
                            "launcher's restart takes over. Fix: see rank 0's log.", rank=rank)
    state = value[0]
    if rank == 0:  # as a living rank 0 does at a "recover" verdict: a death while the next generation is built is not
        # replaced from this generation's state (every other replacement of this death read it before deciding)
        end = time.monotonic() + 5.0
        bounded(lambda: _connect(*endpoint, end, "the agent's store", 0).delete_key(STATE_KEY), end,
                "replacement-withdraw", ends_by=end + 15)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # rank 0 serves the store on the job's port: as the
        # survivors do, wait until the generation's server there is a new one (its rendezvous would lose the old one)
        host, port = state["host"], state["port"]
        handover.await_new_server(
            lambda: job_store.connect(host, port, timeout=handover.PROBE_S),
            (host, port), state["scope"], state["generation"], rank)
    for name, (module, attr) in COUNTERS.items():
        setattr(module, attr, state["counters"][name])
    log.warning("rank %d: this process replaces the dead one (%s) and joins in-process recovery generation %d "
                "(%.2f s to join)", rank, str(info.get("died"))[:100], state["generation"] + 1,
                time.monotonic() - start)
    return int(_SCOPE_RE.fullmatch(state["scope"]).group(1)), state["generation"] + 1  # type: ignore[union-attr]
