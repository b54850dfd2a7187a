"""Which dead worker ``robustdist run``'s agent starts again alone, and how.

torchrun's agent stops every worker on every node when one dies and starts them all again. ``robustdist run`` runs
torchrun's own agent (``LocalElasticAgent``, through ``torch.distributed.run``) with one change, :class:`Replacer`,
called where the agent looks at its workers: when a worker was **killed by a signal** (SIGKILL from the OOM killer
or a preemption, SIGSEGV in a native library), it starts that worker again alone, with the same environment plus
:data:`~robustdist.runtime.replacing.REPLACES_ENV`, and leaves the others running. The replacement joins the
survivors' in-process recovery (:mod:`robustdist.recovery.replacement`) and resumes with them from the in-memory
tier. Each replacement uses one of ``--max-restarts``, as a restart of the group would.

**A warm spare** (``--spares 1``, the default; :mod:`.warm_spare`): from each attempt's start (and while a restart is
left) the agent keeps one process per node that has done a worker's slow start, whether or not the script recovers
in process, and the next worker killed on the node is forked from it (or is it); without one the replacement starts
cold, as torchrun starts a worker.

Everything else is torchrun's own path (every worker stopped and started again, or the job failed when no restart
is left), and the agent logs why:

* the run cannot take a replacement: rank 0 publishes :data:`~robustdist.runtime.replacing.STATE_KEY` in the agent's
  store only while an in-process recovery run trains (``recovery.in_process`` on a run it supports);
* a worker **exited** with a code: an exception, or a rank that escalated (the in-process loop decided the job
  restarts), or the stuck-rank exit (86): a restart of the job is what it asked for;
* the dead worker is global rank 0 and its process served the attempt's store: the agent serves it instead
  (:mod:`.attempt_store`) only with c10d rendezvous, the agent's store shared and ``--max-restarts`` > 0;
* a worker has already finished (exit 0): the run is ending;
* no ``--max-restarts`` is left.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from robustdist.launcher.attempt_store import AttemptStore
from robustdist.launcher.deaths import DeathWatch
from robustdist.launcher.warm_spare import WarmSpare, describe_exit
from robustdist.runtime import _elastic_compat
from robustdist.runtime.replacing import ATTEMPT_STORE_ENV, REPLACES_ENV, STATE_KEY, attempt_store_info, job_of
from robustdist.runtime.stored import json_value

__all__ = ["Replacer", "describe_exit"]

log = logging.getLogger(__name__)  # the launcher is no rank: no rank prefix


class Replacer:
    """The agent's hook: ``replacer(agent, worker_group, torch_monitor)`` returns the group's ``RunResult``."""

    def __init__(self, spares: int = 1, store_timeout: float = 2.0) -> None:
        self.replaced: list[dict[str, Any]] = []  # one record per replacement: rank, old and new pid, how it died
        self.spare = WarmSpare(spares)
        self._client: tuple[tuple[str, int], Any] | None = None  # (address, connection) of the workers' store
        self._timeout = store_timeout
        self._looks = 0  # the agent's looks at its workers, counted
        self._ids: set[Any] = set()  # the workers' ids last seen (all new: torchrun restarted them)
        # local rank -> the generation rank 0 had published when it was started again: joining until a later one is
        self._joining: dict[int, int] = {}
        self.attempt = AttemptStore()  # each attempt's store, served here on node 0 (outlives rank 0's process)
        self._death_watch = DeathWatch()

    def starting(self, agent: Any, group: Any) -> None:
        """The agent's hook after each rendezvous, before it starts the workers: this attempt's store, and a warm
        spare started with them (:data:`.spare.WITH_WORKERS`) where none is alive."""
        try:
            self.attempt.start(group)
        except SignalException:
            raise
        except Exception as e:  # the workers then make it as under torchrun (rank 0 serves)
            log.warning("robustdist run: no agent-served store for this attempt (%s: %s)", type(e).__name__,
                        str(e)[:200])
        try:
            self.spare.start_with_workers(agent)
        except SignalException:
            raise
        except Exception as e:  # no spare now: the monitor's looks start one once the run can take a replacement
            log.warning("robustdist run: could not start a warm spare with the workers (%s: %s); replacements start "
                        "cold until one is warm", type(e).__name__, str(e)[:200])

    def stopped(self, group: Any) -> None:
        """The agent's hook once it has stopped the workers: their attempt's store goes with them."""
        self.attempt.close()

    def wait(self, agent: Any, interval: float) -> None:
        """The agent's wait before each look at its workers: until one ends, at most ``interval`` (its
        ``--monitor-interval``; :mod:`.deaths`)."""
        try:
            self._death_watch.wait(_elastic_compat.worker_processes(agent).values(), interval)
        except SignalException:
            raise
        except Exception as e:  # the look after it still sees every death, an interval late as under torchrun
            log.debug("robustdist run: the wait for a worker's end failed (%s: %s)", type(e).__name__, e)
            time.sleep(interval)

    def close(self) -> None:
        """End the spare, if one is waiting (the launcher's end; the spare also ends when its input closes)."""
        self.attempt.close()
        self._death_watch.close()
        self.spare.close()

    def __call__(self, agent: Any, group: Any, monitor: Callable[[Any], Any]) -> Any:
        self._looks += 1
        try:
            procs = _elastic_compat.worker_processes(agent)
            codes = {lr: p.poll() for lr, p in procs.items()}
        except SignalException:  # torchrun's SIGTERM/SIGINT: the agent shuts the workers down
            raise
        except Exception as e:  # a torch that moved the agent's internals: torchrun's own behaviour
            log.warning("robustdist run: cannot read the workers' processes (%s: %s); a dead worker restarts every "
                        "worker, as torchrun does", type(e).__name__, str(e)[:200])
            return monitor(group)
        if all(c in (None, 0) for c in codes.values()):  # deaths first: a spare started now would slow them
            try:
                self.spare.tend(agent, lambda: self._in_process(group))
            except SignalException:
                raise
            except Exception as e:  # no spare this look (descriptors, memory): the next look tries again
                log.warning("robustdist run: could not tend the warm spare (%s: %s); expected to start or check it. "
                            "A replacement meanwhile starts cold, and the next look tries again. Fix: none needed "
                            "if it passes; if it repeats, see the error (descriptors, memory) or run with --spares 0",
                            type(e).__name__, str(e)[:200])
        ids = {w.id for w in group.workers}
        if self._ids and not ids & self._ids:  # torchrun restarted every worker (a membership change, a death torch's
            self._forget(group)  # own look saw first): rank 0's state is of processes gone
        self._ids = ids
        dead = {lr: code for lr, code in codes.items() if code is not None and code != 0}
        if not dead:  # torch's look judges this view: a death after it is this hook's to handle at the next look
            with _elastic_compat.workers_seen_as([procs[lr] for lr, code in codes.items() if code is None]):
                return monitor(group)
        refused = self._refusal(agent, group, dead, codes)
        if refused is not None:
            log.warning("robustdist run: %s; %s, as torchrun does. %s", self._deaths(group, dead), refused[0],
                        refused[1])
            # torchrun's restart is charged for the whole group: the replacements that never joined are not
            _elastic_compat.take_restarts(agent, -len(self._still_joining(group)))
            self._forget(group)  # before torch stops the workers: no death of the next ones is replaced from it
            return monitor(group)
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        before = len(self.replaced)
        generation = self._published_generation(group)
        for lr, code in sorted(dead.items()):
            worker = group.workers[lr]
            old = worker.id
            record: dict[str, Any] = {"rank": worker.global_rank, "pid": old, "died": describe_exit(code),
                                      "n": len(self.replaced) + 1}
            try:
                master, run = job_of(_elastic_compat.worker_launch(agent, worker)["env"])
                extra = {REPLACES_ENV: json.dumps({**record, "master": master, "run": run})}
                spare = self.spare.take(agent, worker, extra, self._looks)
                new = spare if spare is not None else _elastic_compat.start_worker_again(agent, worker, extra)
            except SignalException:
                raise
            except Exception as e:
                log.error("robustdist run: could not start rank %d again alone (%s: %s); expected torchrun's process "
                          "context to take a new worker. Every worker restarts instead.", worker.global_rank,
                          type(e).__name__, str(e)[:300])
                _elastic_compat.take_restarts(agent, -(len(dead) - len(self.replaced) + before))  # not started: the
                self._forget(group)  # restart torchrun now makes is charged by torchrun itself
                return monitor(group)
            record.update(new_pid=new, wall=time.time(), spare=spare is not None)
            self.replaced.append(record)
            self._joining[lr] = -1 if generation is None else generation
            self._ids.discard(old)
            self._ids.add(new)
            how = "" if spare is None else self.spare.taken_from()
            log.warning("robustdist run: rank %d (local rank %d, pid %s) died (%s); started it again alone as pid %d "
                        "(replacement %d%s); the other workers keep running and take it in at their next in-process "
                        "recovery generation", worker.global_rank, lr, old, record["died"], new, record["n"], how)
        return RunResult(state=WorkerState.HEALTHY)

    def _forget(self, group: Any) -> None:
        """The workers are about to be stopped and started again (torchrun's path): rank 0's state names processes
        about to be gone, so no death of the next ones may be replaced from it (rank 0 publishes afresh)."""
        self._joining.clear()
        try:
            self._store(group).delete_key(STATE_KEY)
        except SignalException:
            raise
        except Exception as e:  # rank 0's own store (it serves the port) went with it: so did the key
            log.debug("robustdist run: could not remove the state: %s", e)
            self._client = None

    def _store(self, group: Any) -> Any:
        """The store the workers were given (MASTER_ADDR:MASTER_PORT: the agent's own where it is shared, rank 0's
        where TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), one connection per address (a new rendezvous may move it)."""
        address = (str(group.master_addr), int(group.master_port))
        if self._client is None or self._client[0] != address:
            import socket

            from robustdist.runtime import job_store

            with socket.create_connection(address, timeout=0.5):  # refused at once: no 2 s of client retries
                pass

            self._client = (address, job_store.connect(*address, timeout=self._timeout))
        return self._client[1]

    def _in_process(self, group: Any) -> bool:
        """Whether the run can take a replacement now: rank 0's state is published (it withdraws it while a recovery
        rebuilds, at the end, and the agent removes it when the workers are restarted)."""
        try:
            return bool(self._store(group).check([STATE_KEY]))
        except SignalException:
            raise
        except Exception as e:  # rank 0's own store, between two of its generations or processes: not now
            log.debug("robustdist run: could not read the workers' store at %s:%s: %s: %s", group.master_addr,
                      group.master_port, type(e).__name__, str(e)[:200])
            self._client = None
            return False

    def _published_state(self, group: Any) -> dict[str, Any]:
        """The state rank 0 published for replacements (empty: none, or unreadable)."""
        try:
            state = json_value(self._store(group).get(STATE_KEY), 8192)
        except SignalException:
            raise
        except Exception:  # no state (the get times out or fails), or not JSON
            return {}
        return state if isinstance(state, dict) else {}

    def _published_generation(self, group: Any) -> int | None:
        """The in-process generation rank 0's published state names (None: none, or unreadable)."""
        generation = self._published_state(group).get("generation")
        return generation if type(generation) is int and generation >= 0 else None

    def _still_joining(self, group: Any) -> set[int]:
        """The local ranks started again alone that have not joined the others yet (rank 0 has published no
        generation after the one it had published when they were started)."""
        if self._joining:
            now = self._published_generation(group)
            for lr, then in list(self._joining.items()):
                if now is not None and then >= 0 and now > then:
                    del self._joining[lr]
        return set(self._joining)

    def _outlives_rank0(self, group: Any) -> bool:
        """Whether rank 0's published state says its generations live in the store this agent serves (not in one
        its own process served, as with ``init_method`` ``tcp://``)."""
        state = self._published_state(group)
        served = attempt_store_info(os.environ.get(ATTEMPT_STORE_ENV, ""))
        return (state.get("outlives_rank0") is True and served is not None
                and (state.get("host"), state.get("port")) == (served["addr"], served["port"]))

    @staticmethod
    def _deaths(group: Any, dead: dict[int, int]) -> str:
        return ", ".join(f"rank {group.workers[lr].global_rank} (local rank {lr}) ended with {describe_exit(c)}"
                         for lr, c in sorted(dead.items()))

    def _refusal(self, agent: Any, group: Any, dead: dict[int, int],
                 codes: dict[int, int | None]) -> tuple[str, str] | None:
        """Why these deaths end in torchrun's path (what happens, the fix), or None: replace them."""
        restart = "every worker is stopped and started again (or the job fails when no --max-restarts is left)"
        exited = [lr for lr, c in dead.items() if c > 0]
        if exited:
            return restart, ("A worker that exits with a code asked for it (an exception, or its in-process recovery "
                             "escalated): only a worker killed by a signal is started again alone.")
        local = {w.local_rank for w in group.workers}
        alone = all(w.world_size == len(local) for w in group.workers)  # one node: no survivor elsewhere
        if alone and set(dead) | self._still_joining(group) >= local:
            return restart, ("Every worker died, or died while the ones started again before it were still joining: "
                             "no survivor is left to take a replacement in (it would wait for a verdict no rank can "
                             "give), so torchrun's restart of every worker is taken at once.")
        if any(group.workers[lr].global_rank == 0 for lr in dead) and not (self.attempt.serves
                                                                           and self._outlives_rank0(group)):
            return restart, ("Rank 0 is replaced alone only where this agent serves the attempt's store (c10d "
                             "rendezvous, the agent's store shared, --max-restarts > 0, init_method env://) and the "
                             "run keeps its generations there; here rank 0's process served it. The restart resumes "
                             "from the in-memory tier.")
        if any(c == 0 for c in codes.values()):
            return restart, "A worker has already finished: the run is ending, so nothing is replaced."
        if not self._in_process(group):
            return restart, ("The run takes no replacement (it does not recover in process: recovery.in_process is "
                             "off, unsupported for this run, or the run is not training now). Fix: "
                             "recovery.in_process: true in the config given to harden(), and h.run(train).")
        if not _elastic_compat.take_restarts(agent, len(dead)):  # one per worker started again
            return (f"{_elastic_compat.restarts_left(agent)} --max-restarts left for {len(dead)} dead worker(s), so "
                    "the job fails or restarts as torchrun decides"), "Fix: raise --max-restarts."
        return None
