"""A warm spare: a process that has done a worker's slow start (``import torch``, robustdist, DDP's first-use imports)
and waits to become a worker (``robustdist run --spares 1``, the default).

``robustdist run``'s agent (:mod:`.agent`) starts ``python -u -m robustdist.launcher.spare`` with the workers of each
attempt, and again, once the run can take a replacement, after a spare became a worker. The spare imports torch,
torch.distributed, DDP and DCP, and the modules ``robustdist.harden`` imports, and, on a build without CUDA, runs one
DDP step on a one-rank gloo group of its own (an in-memory store: no port, no file), which loads what a DDP
constructor and its first backward load (sympy, the compiler's modules), then destroys that group. It does this at
the lowest CPU priority (:mod:`.idle`: a thread at ``SCHED_IDLE``, the session's autogroup at nice 19; on a host
whose cores the ranks fill, a warm-up at their priority slowed every step while it lasted), then puts every thread of
the process back at the workers' policy; the spare started with the workers (:data:`WITH_WORKERS`) goes to their
priority after :data:`WITH_WORKERS_PATIENCE_S`, so that it is warm a few seconds after the first step. Where the
process could not come back (no ``CAP_SYS_NICE``, ``RLIMIT_NICE`` below ``20 - nice``: :func:`idle_possible`) it
warms at the workers' priority, and a warm-up not done at idle priority within :data:`IDLE_PATIENCE_S` finishes at
theirs. It says which on the agent's pipe.

It then reads its standard input, one line per worker: the worker's order, JSON ``{"env", "args", "cwd", "stdout",
"stderr"}``. Where it can (:func:`forks`: Linux's pidfds, no CUDA initialised), it **forks** for each order and stays
warm for the next one (:func:`serve`): the child starts a session of its own (as torchrun's workers do) and becomes
the worker, and the spare says on the agent's pipe ``P <pid>`` for each child and ``E <pid> <code>`` when one ends
(``Popen.returncode``'s form: ``-9`` for SIGKILL), as only a parent can know it. Each replacement then costs a fork,
not another warm-up beside the training (measured in benchmarks/findings.md, P11: about as much training time as the
kill itself). Where it cannot fork it becomes the one worker, as before. Either way the worker's environment becomes
the order's (exactly: nothing of the spare's kept), its output goes where the worker's would (appended to the file
torchrun redirects it to, which --tee follows), and it runs the worker's command, ``[-u] SCRIPT ARGS`` or ``[-u] -m
MODULE ARGS``, as ``python`` would (``runpy``, as ``__main__``, ``sys.argv`` and ``sys.path[0]`` set). An end of
input (the agent gone, or the launcher ending) ends the spare, quietly, once the workers it forked have ended.

On a build with CUDA the spare only imports (a backward can count the GPUs, which fixes ``CUDA_VISIBLE_DEVICES``
before the worker's script sets its own). The spare starts in ``/`` (nothing there shadows its imports) and moves to
the worker's directory. What a spare cannot undo: modules already imported are not imported again (a script that sets
an environment variable a module reads at import, before importing it, sees that module as imported with the
launcher's environment: torch reads ``OMP_NUM_THREADS`` and the like at import). ``--spares 0`` starts every
replacement cold.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import sys
import warnings
from typing import Any

from robustdist.launcher import idle as _idle

__all__ = ["FORKS", "HELD_EXIT", "IDLE_PATIENCE_S", "READY", "READY_FD_ENV", "READY_IDLE", "READY_LATE",
           "READY_WITH_WORKERS", "WITH_WORKERS", "WITH_WORKERS_PATIENCE_S", "become", "forks", "idle_possible", "main",
           "serve", "warm", "usable"]

_MAX_ORDER = 1 << 20  # bytes of an order (the environment and the arguments)


def warm() -> None:
    """Import and run what a worker's start would (no side effect outside this process)."""
    import encodings.idna  # noqa: F401 - a hostname lookup imports it

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel

    # what harden() imports (the facade itself stays for the script: `from robustdist import harden` must find the
    # function, which an `import robustdist.harden` here would shadow with the module)
    for module in ("robustdist.recovery.loop", "robustdist.recovery.joining", "robustdist.parallel.ddp",
                   "robustdist.parallel.fsdp", "robustdist.checkpoint.checkpointer", "robustdist.checkpoint.local.tier",
                   "robustdist.health.watchdog", "robustdist.health.step_guard", "robustdist.data.dataloader",
                   "robustdist.config.io", "robustdist.init.process_group", "robustdist.ray.group"):
        importlib.import_module(module)

    if torch.backends.cuda.is_built():  # a backward may count the GPUs, fixing CUDA_VISIBLE_DEVICES before the
        return  # worker's own (a script may set it after `import torch`): imports only
    fresh = torch.random.get_rng_state()  # the layer's initialisation draws from it: a worker finds it as it was
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(2, 1))
        model(torch.zeros(2, 2)).sum().backward()
        del model
    finally:
        dist.destroy_process_group()
        torch.random.set_rng_state(fresh)


def idle_possible() -> bool:
    """Whether this spare warms at idle priority (:func:`robustdist.launcher.idle.possible`)."""
    return _idle.possible()


def usable(args: list[str]) -> bool:
    """Whether a worker's arguments (after the interpreter) are a command a spare can run: ``[-u] SCRIPT ...`` or
    ``[-u] -m MODULE ...`` (torchrun's, without ``--no-python``)."""
    rest = args[1:] if args[:1] == ["-u"] else args
    if rest[:1] == ["-m"]:
        return len(rest) >= 2 and bool(rest[1]) and not rest[1].startswith("-")
    return bool(rest) and not rest[0].startswith("-")


def _redirect(path: Any, fd: int) -> None:
    if path:
        target = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # after the dead worker's
        os.dup2(target, fd)
        os.close(target)


def become(order: dict[str, Any]) -> None:
    """Turn this process into the worker ``order`` describes, and run it (returns when the script does)."""
    env, args = order["env"], [str(a) for a in order["args"]]
    if not isinstance(env, dict) or not usable(args):
        raise ValueError(f"robustdist spare: an order it cannot run (args {args[:4]}); expected [-u] SCRIPT or -m "
                         "MODULE. Fix: none needed, robustdist run starts such a worker cold (a bug if seen)")
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(order.get("stdout"), 1)
    _redirect(order.get("stderr"), 2)
    os.chdir(str(order["cwd"]))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    rest = args[1:] if args[0] == "-u" else args
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]  # runpy sets argv[0] to the module's path
        if not getattr(sys.flags, "safe_path", False):  # python -m puts the working directory first (none with -P)
            sys.path[0] = os.getcwd()
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [rest[0], *rest[1:]]  # runpy keeps argv[0] as given, as python does
        if not getattr(sys.flags, "safe_path", False):  # python puts the script's real directory first (none with -P)
            sys.path[0] = os.path.dirname(os.path.realpath(rest[0]))
        runpy.run_path(rest[0], run_name="__main__")


READY_FD_ENV = "ROBUSTDIST_SPARE_READY_FD"
"""The agent's pipe (a file descriptor number) on which the spare writes one byte once warm: :data:`READY_IDLE`
(it warmed at ``SCHED_IDLE``), :data:`READY_LATE` (it began so, and finished at the workers' priority after
:data:`IDLE_PATIENCE_S`), :data:`READY` (at the workers' priority throughout: it could not return from idle) or
:data:`READY_WITH_WORKERS` (started with :data:`WITH_WORKERS`)."""
READY, READY_IDLE, READY_LATE, READY_WITH_WORKERS = b"1", b"2", b"3", b"4"
IDLE_PATIENCE_S = 30.0
"""A warm-up at idle priority not done by then finishes at the workers' priority (:data:`READY_LATE`): a host with
little idle CPU time would starve it, and the spare would never be ready."""
WITH_WORKERS = "--with-workers"
"""The spare's argument when the agent starts it with the workers of an attempt: it warms at idle priority for
:data:`WITH_WORKERS_PATIENCE_S` (the workers' own start, imports and rendezvous, gets the CPU first), then at their
priority, and says :data:`READY_WITH_WORKERS`. At idle priority throughout, beside ranks that fill the cores, it would
wait for the CPU until the training pauses (tens of seconds, or more), and the kills of a job's first minute (a bad
node, a bad configuration) would get a cold start."""
WITH_WORKERS_PATIENCE_S = 2.0


FORKS = b"F"
"""Said right after the readiness byte by a spare that forks each worker and stays warm (:func:`serve`). Then, per
order (which carries an ``id``): ``P <id> <pid>`` (forked; the child waits for the agent's ``{"go": id}``, or ends
at ``{"drop": id}`` or when this spare ends), ``X <id> <reason>`` (not run); and ``E <pid> <code>`` when a worker
it forked ends (``Popen.returncode``'s form)."""
HELD_EXIT = 1
"""How a forked child ends that never became a worker (dropped, or its spare died first): a code, so that the agent
never takes it for a worker that finished."""


def forks() -> bool:
    """Whether this process can hand out workers by fork: Linux's ``pidfd_open`` (Python 3.9+, Linux 5.3+; each child's
    end is waited for with it) and no CUDA driver in this process (a forked child could not use it; the warm-up never
    loads it, but a ``sitecustomize`` might)."""
    if not hasattr(os, "fork") or not hasattr(os, "pidfd_open") or not hasattr(os, "waitstatus_to_exitcode"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
        with open("/proc/self/maps", "rb") as maps:  # noqa: PTH123 - the kernel's own file
            return b"libcuda.so" not in maps.read(64 << 20)
    except OSError:  # an older kernel, a sandbox refusing the call, no /proc
        return False


def _say(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode())
    except OSError:  # the agent stopped listening; its input's end ends this spare
        pass


def _fork(order: dict[str, Any], keep: list[int]) -> tuple[int, int] | dict[str, Any]:
    """Fork the worker for ``order``: in this spare, ``(pid, go)`` once the child leads a session of its own (``go``:
    the pipe on which a byte lets it run; its end, without one, ends it); in the child, once let go, ``order`` (the
    spare's descriptors, ``keep`` among them, closed)."""
    go_r, go_w = os.pipe()
    up_r, up_w = os.pipe()
    try:
        with warnings.catch_warnings():  # Python 3.12+: NumPy's OpenBLAS pool is a thread, and it is fork-safe
            warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
            pid = os.fork()
    except OSError:
        for fd in (go_r, go_w, up_r, up_w):
            os.close(fd)
        raise
    if pid == 0:
        try:
            os.close(go_w)
            os.close(up_r)
            os.setsid()  # before the agent learns the pid: torch stops a worker with killpg(pid)
            os.write(up_w, b"s")
            os.close(up_w)
            let_go = os.read(go_r, 1) == b"g"
            os.close(go_r)
            for fd in keep:
                os.close(fd)
        except BaseException:  # noqa: BLE001 - nothing of the spare's may run on in a child
            os._exit(HELD_EXIT)
        if not let_go:
            os._exit(HELD_EXIT)
        _reseed()
        return order
    os.close(go_r)
    os.close(up_w)
    up = os.read(up_r, 1)
    os.close(up_r)
    if up != b"s":  # it ended before its session was made
        os.close(go_w)
        os.waitpid(pid, 0)
        raise OSError(f"the forked child (pid {pid}) ended at once")
    return pid, go_w


TORCH_FIXED_SEED = 67280421310721  # torch's default generator's seed in a fresh process, on builds that fix it


def _reseed() -> None:
    """A forked worker's random streams as a fresh process has them, not the spare's (which every child shares):
    NumPy's and torch's default generators drawn afresh, torch's only where a fresh process's is (builds that fix it
    start from the same seed in every process, which the warm-up kept). Python reseeds ``random`` at a fork itself."""
    numpy = sys.modules.get("numpy.random")
    if numpy is not None:
        numpy.seed()
    torch = sys.modules.get("torch")
    if torch is not None and torch.initial_seed() != TORCH_FIXED_SEED:
        torch.seed()


def serve(status: int) -> dict[str, Any] | None:
    """Fork a worker for each order on standard input and report on ``status`` (see :data:`FORKS`); returns the
    order in the child that becomes a worker, None in this spare once its input has ended (or held an order it would
    not take) and every worker it forked has ended: it waits for them, so none is left a zombie."""
    children: dict[int, int] = {}  # pid -> pidfd
    held: dict[str, tuple[int, int]] = {}  # order id -> (pid, go pipe), forked and waiting for the agent's word
    pending, taking = b"", True
    # what the warm-up left is shared with every worker forked from here until one writes to it: a collection in a
    # worker would touch (and so copy) every object's page; frozen, its collections skip them (CPython's advice for
    # servers that fork without exec)
    gc.collect()
    gc.freeze()
    poller = select.poll()
    poller.register(0, select.POLLIN)
    by_fd: dict[int, int] = {}

    def release(oid: str, go: bool) -> None:
        pid, fd = held.pop(oid)
        try:
            if go:
                os.write(fd, b"g")
        except OSError:  # it ended meanwhile: its E line follows
            pass
        os.close(fd)

    def stop_taking() -> None:
        nonlocal taking
        if taking:
            taking = False
            poller.unregister(0)
            for oid in list(held):
                release(oid, go=False)

    while taking or children:
        for fd, _ in poller.poll():
            if fd != 0:
                pid = by_fd.pop(fd)
                poller.unregister(fd)
                _, how = os.waitpid(pid, 0)
                os.close(children.pop(pid))
                _say(status, f"E {pid} {os.waitstatus_to_exitcode(how)}\n")
                continue
            chunk = os.read(0, 1 << 16)
            pending += chunk
            if not chunk or (b"\n" not in pending and len(pending) > _MAX_ORDER):
                if chunk:  # not robustdist run's agent: take nothing more from it
                    _say(status, f"X - an order longer than {_MAX_ORDER} bytes; expected robustdist run's agent\n")
                stop_taking()
                continue
            while taking and b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                result = _take(line, status, held, release, [status, *children.values(),
                                                              *(go for _, go in held.values())])
                if isinstance(result, dict):
                    return result  # the child, let go: it becomes the worker
                if result is not None:
                    pid, pidfd = result
                    children[pid], by_fd[pidfd] = pidfd, pid
                    poller.register(pidfd, select.POLLIN)
    return None


def _take(line: bytes, status: int, held: dict[str, tuple[int, int]], release: Any,
          keep: list[int]) -> dict[str, Any] | tuple[int, int] | None:
    """One line from the agent: an order (forked: ``(pid, pidfd)``; in the child, once let go, the order), or the
    word for a held one (``{"go": id}``, ``{"drop": id}``). Whatever is wrong is said on ``status``."""
    oid = "-"
    try:
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("not a JSON object")
        word = next((w for w in ("go", "drop") if w in message), None)
        if word is not None:
            if str(message[word]) in held:
                release(str(message[word]), go=word == "go")
            return None
        oid = str(message.get("id", "-"))[:40]
        oid = oid if oid.isalnum() else "-"
        if oid == "-" or not isinstance(message.get("env"), dict) or not isinstance(
                message.get("args"), list) or not usable([str(a) for a in message["args"]]):
            raise ValueError("not an order of robustdist run's (id, env, args [-u] SCRIPT or -m MODULE)")
        forked = _fork(message, keep)
        if isinstance(forked, dict):
            return forked
        pid, go = forked
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            os.close(go)  # it ends, never having run
            os.waitpid(pid, 0)
            raise
    except (ValueError, RecursionError, OSError) as e:  # not JSON, not an order; no process (memory, limits)
        reason = f"{type(e).__name__}: {str(e)[:200]}".replace("\n", " ")
        _say(status, f"X {oid} {reason}\n")
        return None
    held[oid] = (pid, go)
    _say(status, f"P {oid} {pid}\n")
    return pid, pidfd


def main() -> int:
    said = READY
    if WITH_WORKERS in sys.argv[1:]:
        if idle_possible():
            _idle.run(warm, patience_s=WITH_WORKERS_PATIENCE_S)
            said = READY_WITH_WORKERS
        else:
            warm()
    elif idle_possible():
        said = READY_IDLE if _idle.run(warm, patience_s=IDLE_PATIENCE_S) else READY_LATE
    else:
        warm()
    ready = os.environ.pop(READY_FD_ENV, "")
    forking = ready.isdigit() and forks()
    if ready.isdigit():
        try:
            os.write(int(ready), said + (FORKS if forking else b""))
            if not forking:
                os.close(int(ready))
        except OSError:  # the agent stopped listening: it still sends the order
            pass
    if forking:
        order = serve(int(ready))
    else:
        line = sys.stdin.buffer.readline(_MAX_ORDER)
        order = json.loads(line) if line.strip() else None  # none: the agent went away (or ended the spare)
    if order is None:
        return 0
    devnull = os.open(os.devnull, os.O_RDONLY)  # the agent's pipe is done with: the worker reads nothing from it
    os.dup2(devnull, 0)
    os.close(devnull)
    become(order)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
