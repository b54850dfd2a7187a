"""The private names of torchelastic's agent that ``robustdist run`` uses, fenced here (and nowhere else:
``tests/test_private_api.py``), listed in :data:`PRIVATE_APIS` like ``_torch_compat``'s.

``robustdist run`` is torchrun's own launcher with a ``LocalElasticAgent`` whose monitor starts one dead worker
again and leaves the others running; everything it needs of the agent's inside (its process context, its restart
budget, the monitor's loop) is one function below. Without them ``robustdist run`` behaves exactly as torchrun.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from robustdist.runtime._torch_compat import _VERIFIED, _attr
from robustdist.runtime.private_api import PrivateAPI

__all__ = ["PRIVATE_APIS", "adopt_worker", "elastic_agent_class", "launcher_agent", "restarts_left",
           "start_worker_again", "take_restarts", "worker_launch", "worker_processes", "workers_seen_as"]


def elastic_agent_class(on_monitor: Callable[[Any, Any, Callable[[Any], Any]], Any],
                        on_start: Callable[[Any, Any], Any] | None = None, on_stop: Callable[[Any], Any] | None = None,
                        on_wait: Callable[[Any, float], Any] | None = None) -> type:
    """A ``LocalElasticAgent`` whose ``_monitor_workers(group)`` is ``on_monitor(agent, group, torch's own)``, and
    which calls ``on_start(agent, group)`` after each rendezvous, just before it starts the group's workers, and
    ``on_stop(group)`` once it has stopped them. With ``on_wait``, the agent calls ``on_wait(agent, interval)``
    before each look instead of sleeping its ``monitor_interval`` (``on_wait`` may return early)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):  # type: ignore[misc]
        _rd_interval: float | None = None

        def _invoke_run(self, *args: Any, **kwargs: Any) -> Any:
            spec = self._worker_group.spec  # torch's loop sleeps spec.monitor_interval (read once) before each look
            if on_wait is None or self._rd_interval is not None:
                return super()._invoke_run(*args, **kwargs)
            self._rd_interval, spec.monitor_interval = spec.monitor_interval, 0.0
            try:
                return super()._invoke_run(*args, **kwargs)
            finally:
                spec.monitor_interval, self._rd_interval = self._rd_interval, None

        def _monitor_workers(self, worker_group: Any) -> Any:
            if on_wait is not None and self._rd_interval is not None:
                on_wait(self, self._rd_interval)
            return on_monitor(self, worker_group, super()._monitor_workers)

        def _start_workers(self, worker_group: Any) -> Any:
            if on_start is not None:
                on_start(self, worker_group)
            return super()._start_workers(worker_group)

        def _stop_workers(self, worker_group: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return super()._stop_workers(worker_group, *args, **kwargs)
            finally:
                if on_stop is not None:
                    on_stop(worker_group)

    return Agent


@contextlib.contextmanager
def launcher_agent(cls: type) -> Iterator[None]:
    """torchrun's ``launch_agent`` makes ``cls`` in place of ``LocalElasticAgent`` inside the block (``robustdist
    run``'s own process only)."""
    from torch.distributed.launcher import api

    saved, api.LocalElasticAgent = api.LocalElasticAgent, cls
    try:
        yield
    finally:
        api.LocalElasticAgent = saved


def worker_processes(agent: Any) -> dict[int, Any]:
    """Local rank -> the worker's ``Popen`` (empty where the workers are not subprocesses)."""
    handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
    return {lr: h.proc for lr, h in handlers.items()} if isinstance(handlers, dict) else {}


@contextlib.contextmanager
def workers_seen_as(running: Iterable[Any]) -> Iterator[None]:
    """Inside, the agent's own look at its workers (``_monitor_workers``, which polls each handler's ``proc``) sees the
    ``running`` processes (``Popen``-like, as the caller saw them) running: one that ends in between is seen at the
    next look, by the caller first. torch's look stops every worker at the first death it sees, so it must judge the
    caller's view. A shadow a signal leaves behind is inert: it answers as the process's own ``poll`` once out."""
    inside = [True]
    frozen = [p for p in running if hasattr(p, "__dict__") and _shadow_or_none(vars(p).get("poll"))]
    try:
        for proc in frozen:
            proc.poll = functools.partial(_seen_running, inside, proc)
        yield
    finally:
        inside[0] = False
        for proc in frozen:
            vars(proc).pop("poll", None)


def _seen_running(inside: list[bool], proc: Any) -> int | None:
    return None if inside[0] else type(proc).poll(proc)


def _shadow_or_none(attr: Any) -> bool:
    return attr is None or (isinstance(attr, functools.partial) and attr.func is _seen_running)


def restarts_left(agent: Any) -> int:
    """How many of the agent's ``--max-restarts`` are left."""
    return int(agent._remaining_restarts)


def take_restarts(agent: Any, n: int) -> bool:
    """Use ``n`` of the agent's ``--max-restarts`` (one per worker started again; a negative ``n`` gives them back);
    False, using none, when fewer are left."""
    if agent._remaining_restarts < n:
        return False
    agent._remaining_restarts -= n
    return True


def worker_launch(agent: Any, worker: Any) -> dict[str, Any]:
    """How the agent started ``worker``: ``entrypoint``, ``args``, ``env`` (the worker's own variables), ``stdout`` and
    ``stderr`` (the file torchrun redirects it to, else "": ``os.devnull`` for a rank ``--local-ranks-filter``
    leaves out), and ``numa`` (NUMA options, or None)."""
    pc, lr = agent._pcontext, worker.local_rank
    return dict(entrypoint=pc.entrypoint, args=tuple(pc.args[lr]), env=dict(pc.envs[lr]), stdout=pc.stdouts[lr] or "",
                stderr=pc.stderrs[lr] or "", numa=getattr(pc, "_numa_options", None))


def start_worker_again(agent: Any, worker: Any, extra_env: dict[str, str]) -> int:
    """Start ``worker`` (its local rank) again, alone, as the agent started it (entrypoint, arguments, the agent's
    environment with the worker's variables and ``extra_env``, a session of its own); a redirected output is appended
    to the same file, which torchrun's ``--tee`` keeps following. The agent's process context watches the new process
    from then on (and stops it at the end). Returns its pid."""
    import os
    import subprocess

    spec = worker_launch(agent, worker)
    if spec["numa"] is not None:  # torch's own handler applies the binding (its output files start afresh)
        import inspect

        from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

        kwargs: dict[str, Any] = dict(entrypoint=spec["entrypoint"], args=spec["args"],
                                      env={**spec["env"], **extra_env}, stdout=spec["stdout"], stderr=spec["stderr"],
                                      local_rank_id=worker.local_rank)
        if "numa_options" in inspect.signature(get_subprocess_handler).parameters:
            kwargs["numa_options"] = spec["numa"]
        return adopt_worker(agent, worker, get_subprocess_handler(**kwargs))
    out = open(spec["stdout"], "a") if spec["stdout"] else None  # noqa: SIM115 - the handler closes them
    err = open(spec["stderr"], "a") if spec["stderr"] else None  # noqa: SIM115
    proc = subprocess.Popen([spec["entrypoint"], *map(str, spec["args"])], env={**os.environ, **spec["env"],
                                                                                **extra_env},
                            stdout=out, stderr=err, start_new_session=True)
    return adopt_worker(agent, worker, proc, files=(out, err))


def adopt_worker(agent: Any, worker: Any, handler_or_proc: Any, files: tuple[Any, Any] = (None, None)) -> int:
    """Make the agent's process context watch (and, at the end, stop) this process as ``worker``: a torch
    ``SubprocessHandler``, or a ``Popen`` started in a session of its own (``files``: its open output files, closed
    with it). The dead worker's handler's files are closed."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    handler = handler_or_proc
    if not isinstance(handler, SubprocessHandler):  # torch's handler without its constructor (which starts a process)
        handler = SubprocessHandler.__new__(SubprocessHandler)
        handler.proc, handler.local_rank_id = handler_or_proc, worker.local_rank
        handler._stdout, handler._stderr = files
    old = agent._pcontext.subprocess_handlers.get(worker.local_rank)
    for f in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
        if f is not None:
            f.close()
    agent._pcontext.subprocess_handlers[worker.local_rank] = handler
    worker.id = handler.proc.pid
    return int(handler.proc.pid)


def _probe_agent() -> Any:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.launcher import api

    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    return (_attr(LocalElasticAgent, "_monitor_workers") and _attr(LocalElasticAgent, "_start_workers")
            and _attr(LocalElasticAgent, "_invoke_run")
            and _attr(api, "LocalElasticAgent") and _attr(SubprocessContext, "_start")
            and _attr(SubprocessHandler, "close")) or None


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("torch.distributed.elastic LocalElasticAgent._monitor_workers/_invoke_run/_pcontext/_remaining_restarts"
               ", WorkerSpec.monitor_interval (read once by _invoke_run), "
               "SubprocessContext.subprocess_handlers/_numa_options (the agent's look polls each handler's proc), "
               "SubprocessHandler._stdout/_stderr, "
               "launcher.api.LocalElasticAgent", "torch",
               "robustdist run starts one dead worker again and leaves the others running (torchrun's agent stops "
               "them all); without them it behaves exactly as torchrun", _VERIFIED, _probe_agent),
)
