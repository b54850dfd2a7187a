"""Test distributed code on CPU with real processes: :func:`run_ranks`.

``run_ranks(fn, world_size=2)`` starts ``world_size`` fresh interpreters (the ``spawn`` start method), sets
the launcher env a rank expects (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, and ``OMP_NUM_THREADS=1`` unless given, as torchrun does),
optionally initialises a process group, calls ``fn(rank, *args)`` and returns every rank's return value in
rank order. ``fn`` and ``args`` must pickle: define ``fn`` at module top level. Ranks are fresh interpreters
that re-import the main module, so a script calling ``run_ranks`` needs the ``if __name__ == "__main__":``
guard (pytest test modules need nothing).

Failure is always reported, never waited out:

* a rank that raises -> :class:`~robustdist.runtime.errors.RanksFailed` with that rank's formatted traceback;
* a rank that dies by a signal or exits without a result -> ``RanksFailed`` naming the rank and the signal
  or exit code;
* ranks still running at ``timeout`` -> each gets ``SIGUSR1`` (which dumps its Python stacks through
  ``faulthandler``), then all ranks are killed with their process groups (so dataloader workers and other
  grandchildren die too) and :class:`~robustdist.runtime.errors.RanksTimeout` names the unfinished ranks with
  their stacks.

Each rank runs in its own process group and gets ``PR_SET_PDEATHSIG`` on Linux, so no rank outlives the
caller even if the caller itself is killed.

A test suite that calls ``run_ranks`` hundreds of times can call :func:`use_forkserver` once: ranks are then
forked from a server process that has already imported torch, instead of each importing it (most of a small
rank's cost). Each rank still gets exactly the caller's environment at the call, as with ``spawn``.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import RanksFailed, RanksTimeout, ranks_phrase
from robustdist.testing import ports as _ports

__all__ = ["free_port", "run_ranks", "use_forkserver"]

_DUMP_WAIT_S = 1.0  # how long a hung rank gets to write its stack dump before it is killed
_start = {"method": "spawn", "preload": ()}  # what use_forkserver() changes, in this process only


def use_forkserver(preload: Sequence[str] = ("torch", "torch.distributed")) -> None:
    """Start later ranks from a ``forkserver`` that imports ``preload`` once (see the module docstring).

    The server starts at the next ``run_ranks`` and lives until this process exits. Environment variables
    read only when a library loads (``OMP_NUM_THREADS`` by OpenMP) take the value of that first call; each
    rank re-applies ``OMP_NUM_THREADS`` with ``torch.set_num_threads``.
    """
    _start.update(method="forkserver", preload=tuple(preload))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no other test on this machine is handed meanwhile
    (:func:`robustdist.testing.ports.free_port`); :func:`run_ranks` keeps its own port bound as well."""
    return _ports.free_port()


TIMEOUT_SCALE_ENV = "ROBUSTDIST_TEST_TIMEOUT_SCALE"


def _scaled(timeout: float) -> float:
    """``timeout`` times ``ROBUSTDIST_TEST_TIMEOUT_SCALE`` (unset or empty: 1)."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "").strip()
    if not raw:
        return timeout
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not 1 <= scale <= 100:
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={raw!r}; expected a number from 1 to 100. Fix: set it to e.g. 3, or "
                         "unset it.")
    return timeout * scale


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    init: bool = True,
    timeout: float = 60,
    env: Mapping[str, str | None] | Sequence[Mapping[str, str | None]] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` real processes and return their results in rank order.

    Args:
        fn: a module-level function (it is pickled by reference into each rank).
        world_size: how many ranks.
        args: extra positional arguments for ``fn``, pickled to every rank.
        backend: the process-group backend when ``init`` is true.
        init: create the process group (``env://``) before ``fn`` and destroy it after.
        timeout: seconds for the whole run; also the process group's collective timeout. Multiplied by
            ``ROBUSTDIST_TEST_TIMEOUT_SCALE`` when that is set (a number >= 1: a test suite on a loaded machine).
        env: extra environment for the ranks: one mapping for all ranks, or a sequence with one mapping per
            rank. A value of ``None`` unsets the variable.

    Raises:
        RanksFailed: a rank raised, exited without returning, or died by a signal.
        RanksTimeout: ranks were still running at ``timeout``; all ranks were killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; expected at least 1. Fix: pass world_size=2 or more.")
    timeout = _scaled(timeout)
    per_rank_env = _per_rank_env(env, world_size)
    try:
        payload = pickle.dumps((fn, tuple(args)))
    except Exception as e:
        raise TypeError(
            f"run_ranks cannot send {fn!r} and its args to the ranks: {e}. Expected a module-level function and "
            "picklable args, since ranks are fresh interpreters (spawn). Fix: move fn to module top level."
        ) from e
    ctx: Any = mp.get_context(str(_start["method"]))
    forked = _start["method"] == "forkserver"
    if forked:
        ctx.set_forkserver_preload(list(_start["preload"]))
    reservation, port = _ports.reserve_port()
    dump_dir = tempfile.mkdtemp(prefix="robustdist-ranks-")
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        for rank in range(world_size):
            rank_env = {
                "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                **per_rank_env[rank],
            }
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            child_env = _full_env(rank_env) if forked else None  # a forked rank has the server's environment
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, payload, backend, init, timeout, child_conn, os.path.join(dump_dir, f"{rank}.txt"),
                      os.getpid(), child_env),
                name=f"robustdist-rank-{rank}",
                daemon=False,  # ranks may start DataLoader workers; cleanup is ours (finally + PDEATHSIG)
            )
            with _environ(rank_env):
                proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        return _collect(procs, conns, timeout, dump_dir)
    finally:
        for proc in procs:
            _kill_rank(proc)
        for conn in conns:
            conn.close()
        reservation.close()
        shutil.rmtree(dump_dir, ignore_errors=True)


def _full_env(overrides: Mapping[str, str | None]) -> dict[str, str]:
    full = dict(os.environ)
    for k, val in overrides.items():
        if val is None:
            full.pop(k, None)
        else:
            full[k] = str(val)
    return full


def _per_rank_env(env: Any, world_size: int) -> list[dict[str, str | None]]:
    if env is None:
        return [{} for _ in range(world_size)]
    if isinstance(env, Mapping):
        return [dict(env) for _ in range(world_size)]
    envs = [dict(e) for e in env]
    if len(envs) != world_size:
        raise ValueError(
            f"env has {len(envs)} per-rank mappings but world_size={world_size}; expected one per rank. "
            "Fix: pass a single mapping for all ranks, or exactly world_size mappings."
        )
    return envs


@contextlib.contextmanager
def _environ(overrides: Mapping[str, str | None]) -> Iterator[None]:
    """Set env vars for a child's start (spawn copies os.environ), then restore the parent's exactly."""
    saved = {k: os.environ.get(k) for k in overrides}
    try:
        for k, val in overrides.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(val)
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _collect(procs: list[Any], conns: list[Any], timeout: float, dump_dir: str) -> list[Any]:
    deadline = time.monotonic() + timeout
    messages: dict[int, tuple[str, Any]] = {}
    pending = set(range(len(procs)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables = [conns[r] for r in pending if r not in messages] + [procs[r].sentinel for r in pending]
        mpc.wait(waitables, timeout=remaining)
        for rank in sorted(pending):
            if rank not in messages and conns[rank].poll():
                messages[rank] = _receive(conns[rank])
            if procs[rank].exitcode is not None:
                if rank not in messages and conns[rank].poll():
                    messages[rank] = _receive(conns[rank])
                pending.discard(rank)
    failures = {r: desc for r in range(len(procs)) if r not in pending and (desc := _failure(r, procs[r], messages.get(r)))}
    if pending:
        stacks = _dump_stacks(sorted(pending), procs, dump_dir)
        raise RanksTimeout(_timeout_message(sorted(pending), timeout, failures, stacks), failures=failures,
                           ranks=sorted(set(pending) | set(failures)))
    if failures:
        raise RanksFailed(_failure_message(failures, len(procs)), failures=failures)
    return [messages[r][1] for r in range(len(procs))]


def _receive(conn: Any) -> tuple[str, Any]:
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        return ("none", None)
    except Exception as e:  # the result pickled in the rank but does not unpickle here
        return ("err", f"the rank's return value could not be unpickled in the parent: {e!r}")


def _failure(rank: int, proc: Any, message: tuple[str, Any] | None) -> str | None:
    code = proc.exitcode
    kind, value = message if message is not None else ("none", None)
    if kind == "ok" and code == 0:
        return None
    if kind == "err":
        return f"rank {rank} raised:\n{value}"
    how = _exit_description(code)
    if kind == "ok":
        return f"rank {rank} returned a value but then {how}"
    return f"rank {rank} {how} without returning a result (its stderr says why)"


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"died by signal {name} ({-code})"
    return f"exited with code {code}"


def _failure_message(failures: dict[int, str], world_size: int) -> str:
    body = "\n\n".join(failures[r] for r in sorted(failures))
    return f"{len(failures)} of {world_size} ranks failed ({ranks_phrase(list(failures))}); expected every rank to return.\n\n{body}"


def _timeout_message(pending: list[int], timeout: float, failures: dict[int, str], stacks: dict[int, str]) -> str:
    parts = [
        f"{ranks_phrase(pending)} had not finished after {timeout:g} s and {'was' if len(pending) == 1 else 'were'} "
        "killed; expected every rank to return "
        "within the timeout. Their stacks at the timeout follow. Fix: look for a rank that skipped a collective "
        "or waits on one the others never enter, or raise timeout= if the work is just slow."
    ]
    parts += [f"rank {r} stack:\n{stacks.get(r) or '(no stack dump was written)'}" for r in pending]
    parts += [failures[r] for r in sorted(failures)]
    return "\n\n".join(parts)


def _dump_stacks(pending: list[int], procs: list[Any], dump_dir: str) -> dict[int, str]:
    for rank in pending:
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(_DUMP_WAIT_S)
    stacks = {}
    for rank in pending:
        with contextlib.suppress(OSError):
            with open(os.path.join(dump_dir, f"{rank}.txt"), encoding="utf-8", errors="replace") as fh:
                stacks[rank] = fh.read().strip()
    return stacks


def _kill_rank(proc: Any) -> None:
    """SIGKILL the rank's whole process group (its children too), then reap it."""
    if proc.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.exitcode is None:
        with contextlib.suppress(Exception):
            proc.kill()
    proc.join(5)


# ----------------------------------------------------------------------------- inside a rank
_dump_file: Any = None


def _rank_main(rank: int, payload: bytes, backend: str, init: bool, timeout: float, conn: Any,
               dump_path: str, parent_pid: int, env: dict[str, str] | None = None) -> None:
    global _dump_file
    os.setpgid(0, 0)  # own process group: the parent kills us and our children together
    _die_with_parent(parent_pid, forked=env is not None)
    # multiprocessing hands a child its parent's start method (spawn or forkserver here); a rank that a launcher
    # starts has the platform's default, and so do the processes it starts (DataLoader workers: fork on Linux)
    mp.set_start_method(None, force=True)
    if env is not None:  # forked from the server: take the caller's environment, as spawn would
        os.environ.clear()
        os.environ.update(env)
        with contextlib.suppress(ValueError, KeyError):
            import torch

            torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    _dump_file = open(dump_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True)
    import torch.distributed as dist

    message: tuple[str, Any]
    try:
        fn, args = pickle.loads(payload)
        if init:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
        message = ("ok", fn(rank, *args))
    except BaseException:
        message = ("err", traceback.format_exc())
    finally:
        # free what fn built (a DDP reducer holds threads on the group) while the group still exists
        gc.collect()
        if init and _dist.is_up():
            dist.destroy_process_group()
    try:  # plain pickle, not multiprocessing's: torch's shared-memory tensor handles die with this process
        payload = pickle.dumps(message)
    except Exception as e:
        message = ("err", f"the return value of rank {rank} does not pickle: {e!r}")
        payload = pickle.dumps(message)
    conn.send_bytes(payload)
    conn.close()
    if message[0] != "ok":
        sys.exit(1)


def _die_with_parent(parent_pid: int, *, forked: bool = False) -> None:
    """Ask Linux to SIGKILL this rank when its parent dies (no orphan survives a killed test run). A rank
    forked by the forkserver has the server as its parent; the server exits when the caller does."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if forked:
        try:
            os.kill(parent_pid, 0)  # the caller is gone: nobody waits for this rank
        except ProcessLookupError:
            os._exit(1)
    elif os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
