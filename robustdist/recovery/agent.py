"""Which dead worker ``robustdist run``'s agent starts again alone, and how (issue #35).

torchrun's agent stops every worker on every node when one dies and starts them all again. ``robustdist run`` runs
torchrun's own agent (``LocalElasticAgent``, through ``torch.distributed.run``) with one change, :class:`Replacer`,
called where the agent looks at its workers: when a worker was **killed by a signal** (SIGKILL from the OOM killer
or a preemption, SIGSEGV in a native library), it starts that worker again alone, with the same environment plus
:data:`~robustdist.runtime.replacing.REPLACES_ENV`, and leaves the others running. The replacement joins the
survivors' in-process recovery (:mod:`robustdist.recovery.replacement`) and resumes with them from the in-memory
tier. Each replacement uses one of ``--max-restarts``, as a restart of the group would.

Everything else is torchrun's own path (every worker stopped and started again, or the job failed when no restart
is left), and the agent logs why:

* the run cannot take a replacement: rank 0 publishes :data:`~robustdist.runtime.replacing.STATE_KEY` in the agent's
  store only while an in-process recovery run trains (``recovery.in_process`` on a run it supports);
* a worker **exited** with a code: an exception, or a rank that escalated (the in-process loop decided the job
  restarts), or the stuck-rank exit (86): a restart of the job is what it asked for;
* the dead worker is global rank 0 (its process serves the generation's store under ``--max-restarts``, and runs the
  job's checks; see docs/recovery.md);
* a worker has already finished (exit 0): the run is ending;
* no ``--max-restarts`` is left.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from robustdist.runtime import _torch_compat
from robustdist.runtime.log import get_logger
from robustdist.runtime.replacing import REPLACES_ENV, STATE_KEY

__all__ = ["Replacer", "describe_exit"]

log = get_logger(__name__)


def describe_exit(code: int) -> str:
    """``signal 9 (SIGKILL)`` for a negative ``Popen.returncode``, ``exit code 1`` otherwise."""
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class Replacer:
    """The agent's hook: ``replacer(agent, worker_group, torch_monitor)`` returns the group's ``RunResult``."""

    def __init__(self, store_timeout: float = 5.0) -> None:
        self.replaced: list[dict[str, Any]] = []  # one record per replacement: rank, old and new pid, how it died
        self._client: Any = None  # a connection to the store the workers use (MASTER_ADDR:MASTER_PORT)
        self._timeout = store_timeout

    def _store(self, group: Any) -> Any:
        """The store the workers were given (the agent's own, shared, but not always the object the group holds)."""
        if self._client is None:
            import torch.distributed as dist

            self._client = dist.TCPStore(group.master_addr, int(group.master_port), is_master=False,
                                         timeout=timedelta(seconds=self._timeout))
        return self._client

    def __call__(self, agent: Any, group: Any, monitor: Callable[[Any], Any]) -> Any:
        try:
            procs = _torch_compat.worker_processes(agent)
            codes = {lr: p.poll() for lr, p in procs.items()}
        except Exception as e:  # a torch that moved the agent's internals: torchrun's own behaviour
            log.warning("robustdist run: cannot read the workers' processes (%s: %s); a dead worker restarts every "
                        "worker, as torchrun does", type(e).__name__, str(e)[:200])
            return monitor(group)
        dead = {lr: code for lr, code in codes.items() if code is not None and code != 0}
        if not dead:
            return monitor(group)
        refused = self._refusal(agent, group, dead, codes)
        if refused is not None:
            log.warning("robustdist run: %s; %s, as torchrun does. %s", self._deaths(group, dead), refused[0],
                        refused[1])
            return monitor(group)
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        for lr, code in sorted(dead.items()):
            worker = group.workers[lr]
            old = worker.id
            record = {"rank": worker.global_rank, "pid": old, "died": describe_exit(code), "n": len(self.replaced) + 1}
            try:
                new = _torch_compat.start_worker_again(agent, worker, {REPLACES_ENV: json.dumps(record)},
                                                       f".replaced-{record['n']}")
            except Exception as e:
                log.error("robustdist run: could not start rank %d again alone (%s: %s); expected torchrun's process "
                          "context to take a new worker. Every worker restarts instead.", worker.global_rank,
                          type(e).__name__, str(e)[:300])
                return monitor(group)
            record.update(new_pid=new, wall=time.time())
            self.replaced.append(record)
            log.warning("robustdist run: rank %d (local rank %d, pid %s) died (%s); started it again alone as pid %d "
                        "(replacement %d); the other workers keep running and take it in at their next in-process "
                        "recovery generation", worker.global_rank, lr, old, record["died"], new, record["n"])
        return RunResult(state=WorkerState.HEALTHY)

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
        if any(group.workers[lr].global_rank == 0 for lr in dead):
            return restart, ("Rank 0 is not replaced alone (its process serves the job's store): the restart "
                             "resumes from the in-memory tier.")
        if any(c == 0 for c in codes.values()):
            return restart, "A worker has already finished: the run is ending, so nothing is replaced."
        try:
            in_process = bool(self._store(group).check([STATE_KEY]))
        except Exception as e:
            log.info("robustdist run: could not read the workers' store at %s:%s: %s: %s", group.master_addr,
                     group.master_port, type(e).__name__, str(e)[:200])
            self._client = None
            in_process = False
        if not in_process:
            return restart, ("The run takes no replacement (it does not recover in process: recovery.in_process is "
                             "off, unsupported for this run, or the run is not training now). Fix: "
                             "recovery.in_process: true in the config given to harden(), and h.run(train).")
        if not _torch_compat.take_restart(agent):
            return "no --max-restarts is left, so the job fails", "Fix: raise --max-restarts."
        return None
