"""``safe_init_process_group``: make init the place where a misconfigured job is caught and named.

``torch.distributed.init_process_group`` is no longer a barrier (torch PR #103033) and NCCL builds its
communicators lazily, so a broken job "starts fine" and hangs minutes later. The init sequence, run by
every rank:

1. **Topology and backend.** Detect the topology. A single process with no launcher gets a report saying it
   is not distributed, and no group (pass ``init_single=True`` to get a 1-rank group anyway). ``"auto"``
   picks nccl when CUDA is available, else gloo; nccl without CUDA is an :class:`InitError`.
2. **Environment, before anything waits.** ``MASTER_ADDR`` resolves (bounded), ``MASTER_PORT`` is a port
   (checked by the topology), ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` name interfaces that exist. On
   CUDA, ``torch.cuda.set_device`` runs *before* init, and ``device_id`` is passed where torch supports it.
3. **Rendezvous, bounded by** ``distributed.init_timeout`` (default 300 s; :mod:`robustdist.init.store`, on a
   thread joined at the deadline, since store clients ignore their timeout when a server freezes): on a
   multi-node job a loopback ``MASTER_ADDR`` is refused before any connection; the store is reached (or, on
   rank 0, served), and a port answered by no store, or by something that is not a c10d store, is named
   (:mod:`robustdist.init.rendezvous`); every rank records its arrival and a rank that never started is named;
   one rank per node connects to where gloo will listen on every other node, and an interface that reaches
   no peer is named (:mod:`robustdist.init.reach`). Under torchrun with restarts enabled, the group gets a store
   of its own for each attempt (see :mod:`robustdist.init.elastic_store`: torch 2.13 reuses the agent's store
   across restarts and re-init fails on stale keys), and rank 0 counts the attempt in the agent's store
   (:attr:`InitReport.attempt`).
4. **Init** with the connected store and an explicit collective timeout (``distributed.timeout``, default
   1800 s). If a group already exists (Ray Train creates one; ``harden`` with ``recovery.in_process`` gives a
   gloo one of Ray's up first: :mod:`robustdist.ray.group`), it is not re-initialised: it is validated by
   the steps below, and a warning says that this call's settings did not take effect. :func:`adopt_group` is
   the explicit form for a group the script created itself: it validates it the same way and says loudly what
   robustdist cannot protect in it (restart safety under torchrun ``--max-restarts``, see
   :mod:`robustdist.init.elastic_store`).
5. **Named barrier**, bounded by ``distributed.barrier_timeout``: ``monitored_barrier(wait_all_ranks=True)``
   on gloo, on a gloo side group for NCCL. Each rank first records its arrival in the c10d store, so every
   rank that arrived, not only rank 0, raises an :class:`InitError` naming the ranks that did not.
6. **Smoke test.** One all_reduce on the backend's device in which rank ``r`` contributes ``r + 1`` at
   position ``r`` (so the sum of ranks, ``ws*(ws-1)/2``, is checked and a wrong slot names its rank).
7. **Agreement.** One ``all_gather_object`` of each rank's fingerprint (see :mod:`robustdist.runtime.agreement`);
   a mismatch raises the same :class:`InitError` on every rank.

If any step fails after this call created the group, the group is destroyed before the error propagates.
No step waits without a bound.

**The attempt number** (:attr:`InitReport.attempt`, ``Hardened.attempt``) is the same on every rank. It comes
from the job's store wherever torchrun gives the workers one, and never from one rank's
``TORCHELASTIC_RESTART_COUNT``: torchrun counts that per agent, so after a restart it is 1 on the node whose
worker failed and 0 on the others (torch #108158), and a script can overwrite it. Where it comes from:

* under torchrun with ``--max-restarts`` > 0: rank 0's count in the agent's job-lifetime store, read by the other
  ranks from this attempt's own store (see :mod:`robustdist.init.elastic_store`);
* under torchrun with the agent's store but no restarts, and for a group robustdist adopted under torchrun:
  rank 0's count in the group's store (which is the agent's when the group came from ``env://``), shared
  after the named barrier;
* under torchrun without a shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which torch 2.13 needs for
  a restarted agent to rejoin): no store outlives an attempt, so the largest ``TORCHELASTIC_RESTART_COUNT`` of
  any rank, shared after the named barrier (equal everywhere; a restart no agent counted is missed);
* anywhere else (no torchrun, one process, Ray Train, SLURM without torchrun): 0. Their stores live for one
  attempt, so nothing could count restarts; to the processes, a Ray Train or SLURM restart is a new job.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from robustdist.config.schema import DistributedConfig, HardenConfig, resolve_config
from robustdist.config.validate import seconds
from robustdist.init import elastic_store as _elastic_store
from robustdist.init import rendezvous as _rendezvous
from robustdist.init import store as _init_store
from robustdist.runtime import dist as _dist
from robustdist.runtime import exit_drain, group_teardown
from robustdist.runtime import netenv
from robustdist.runtime.agreement import check_agreement, local_fingerprint
from robustdist.runtime.dist import default_store
from robustdist.runtime.errors import InitError
from robustdist.runtime.log import get_logger, user_stacklevel, warn
from robustdist.runtime.topology import Topology, detect_topology

__all__ = ["InitReport", "adopt_group", "destroy_process_group_if_owned", "distributed", "safe_init_process_group"]

log = get_logger(__name__)
_barrier_generation = 0  # same sequence on every rank, so store keys of repeated calls never collide
_created: weakref.WeakSet[Any] = weakref.WeakSet()  # default groups safe_init_process_group created
_attempts: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # default group -> its attempt


@dataclass
class InitReport:
    """What ``safe_init_process_group`` found and did. ``fingerprints`` holds every rank's, on every rank.

    ``attempt`` is this job's attempt number, the same on every rank: 0 on the first run, 1 after the first
    torchrun restart, and so on (see the module docstring for where it comes from, and why one rank's
    ``TORCHELASTIC_RESTART_COUNT`` cannot say it)."""

    distributed: bool
    created: bool
    backend: str | None
    rank: int
    world_size: int
    topology: Topology
    attempt: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    fingerprints: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    side_group: Any = field(default=None, repr=False)


def _supports_device_id() -> bool:
    return Version(torch.__version__).release >= (2, 3)


def choose_backend(requested: str, rank: int) -> str:
    """Resolve ``"auto"``; refuse nccl without CUDA."""
    cuda = torch.cuda.is_available()
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not cuda:
        raise InitError(
            "backend 'nccl' was requested but CUDA is not available in this process; expected a GPU for NCCL. "
            "Fix: use backend 'gloo' (or 'auto') on CPU, or check CUDA_VISIBLE_DEVICES and the driver.",
            rank=rank,
        )
    return requested


def _check_env(backend: str, dcfg: DistributedConfig, topo: Topology) -> None:
    problems = []
    if dcfg.init_method.startswith("env://"):
        if not topo.master_addr:
            problems.append("MASTER_ADDR is not set; expected the master node's address for env://. "
                            "Fix: launch with torchrun, or export MASTER_ADDR and MASTER_PORT.")
        elif (reason := netenv.resolve_host(topo.master_addr, min(10.0, dcfg.init_timeout))) is not None:
            problems.append(f"MASTER_ADDR={topo.master_addr!r} does not resolve ({reason}); expected a hostname or "
                            "IP address every rank can reach. Fix: use the master node's IP or a resolvable name.")
        if topo.master_port is None:
            problems.append("MASTER_PORT is not set; expected a free TCP port on the master node. "
                            "Fix: export MASTER_PORT=29500 (torchrun sets it).")
    ifname_vars = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if backend == "nccl" else [])
    for var in ifname_vars:
        problem = netenv.check_socket_ifname(var, os.environ.get(var))
        if problem:
            problems.append(problem)
    if problems:
        raise InitError(" | ".join(problems), rank=topo.rank)


def _init(backend: str, dcfg: DistributedConfig, timeout_s: float, topo: Topology, single: bool) -> tuple[int, bool]:
    """Create the default group. Returns ``(attempt, share)``: with ``share``, ``attempt`` is this rank's part of
    the number, reduced with MAX across ranks once the group is up."""
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if topo.device.type == "cuda":
        torch.cuda.set_device(topo.device)
        if _supports_device_id() and backend == "nccl":
            kwargs["device_id"] = topo.device
    attempt, share = 0, False
    if single:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    else:
        store, attempt, share = _init_store.rendezvous_store(dcfg, topo)
        kwargs.update(store=_rendezvous.for_group(store, timeout_s), rank=topo.rank, world_size=topo.world_size)
    try:
        dist.init_process_group(**kwargs)
    except Exception as e:
        raise InitError(
            f"init_process_group(backend={backend!r}, init_method={'HashStore' if single else dcfg.init_method!r}) "
            f"failed after up to {timeout_s:g} s: {e}. Expected all {topo.world_size} ranks to rendezvous at "
            f"{topo.master_addr}:{topo.master_port}. Fix: check that every rank was started, that MASTER_ADDR/PORT "
            "are the same everywhere and reachable, and raise distributed.timeout if nodes start slowly.",
            rank=topo.rank,
        ) from e
    return attempt, share


def named_barrier(name: str, timeout_s: float, *, group: Any = None) -> float:
    """A bounded barrier that names the ranks that did not arrive, on every rank that did. Returns seconds."""
    global _barrier_generation
    _barrier_generation += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"robustdist/barrier/{name}/{_barrier_generation}"
    store = default_store()
    if store is not None:
        try:
            store.set(f"{prefix}/{rank}", "1")
        except Exception as e:  # only the naming of absent ranks needs it: the barrier still bounds the wait
            log.warning("could not record this rank's arrival at barrier '%s' in the store (%s: %s); absent ranks "
                        "will be named from the barrier's own error only", name, type(e).__name__, str(e)[:200])
            store = None
    start = time.perf_counter()
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except Exception as e:
        missing = _missing_ranks(store, prefix, world, str(e))
        who = (f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))} did not reach"
               if missing else "not every rank reached")
        raise InitError(
            f"{who} the barrier '{name}' within {timeout_s:g} s; expected all {world} ranks. "
            "Fix: look at the named ranks' logs and stacks (a crash, a slow data load or a collective only some "
            f"ranks enter), or raise distributed.barrier_timeout if they are just slow. ({e})",
            rank=rank, ranks=missing,
        ) from e
    return time.perf_counter() - start


def _missing_ranks(store: Any, prefix: str, world: int, error: str) -> list[int]:
    if store is not None:
        with contextlib.suppress(Exception):
            missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
            if missing:
                return missing
    match = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", error)
    return [int(x) for x in match.group(1).split(",") if x.strip()] if match else []


def smoke_test(backend: str) -> float:
    """All-reduce on the backend's device and check every rank's contribution. Returns seconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _dist.collective_device(backend)
    start = time.perf_counter()
    t = torch.zeros(world, dtype=torch.float64, device=device)
    t[rank] = rank + 1
    try:
        dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:
        raise InitError(
            f"the smoke-test all_reduce on {device} failed: {e}. Expected it to complete on all {world} ranks. "
            "Fix: check the named peers in the message; with NCCL, set NCCL_DEBUG=INFO for the transport chosen.",
            rank=rank,
        ) from e
    got = t.cpu().tolist()
    bad = [r for r, value in enumerate(got) if value != r + 1]
    if bad:
        raise InitError(
            f"the smoke-test all_reduce returned {got}; expected [1, 2, ..., {world}] (sum of ranks "
            f"{world * (world - 1) // 2}). Wrong contributions from ranks {bad}. Fix: the collective transport "
            "is corrupting or dropping data; check those ranks' devices and network (NCCL_DEBUG=INFO).",
            rank=rank, ranks=bad,
        )
    return time.perf_counter() - start


def agree(config_fingerprint: str, backend: str, device: torch.device, *,
          group: Any = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Gather every rank's fingerprint and check them; raise the same InitError on every rank on a mismatch."""
    rank = dist.get_rank()
    mine = local_fingerprint(rank=rank, backend=backend, device=device, config_fingerprint=config_fingerprint)
    gathered = _dist.gather_objects(mine, group)
    errors, warnings = check_agreement(gathered)
    if errors:
        named = sorted(set().union(*(ranks for _, ranks in errors)))
        raise InitError("ranks disagree: " + " | ".join(msg for msg, _ in errors), rank=rank, ranks=named)
    return gathered, warnings


def _typed(cfg: HardenConfig | DistributedConfig | None, caller: str) -> tuple[DistributedConfig, str]:
    """The ``distributed`` section and the fingerprint ranks compare (of the whole config when given one)."""
    if isinstance(cfg, DistributedConfig):
        return cfg, HardenConfig(distributed=cfg).fingerprint()
    if cfg is not None and not isinstance(cfg, HardenConfig):
        warnings.warn(f"{caller}(cfg=<{type(cfg).__name__}>): pass a HardenConfig or a DistributedConfig; a dict or "
                      "YAML path is resolved on every call. Resolve it once with robustdist.resolve_config(cfg).",
                      DeprecationWarning, stacklevel=user_stacklevel())
    config = resolve_config(cfg)
    return config.distributed, config.fingerprint()


def safe_init_process_group(cfg: HardenConfig | DistributedConfig | None = None, *, backend: str | None = None,
                            timeout: float | timedelta | None = None, topology: Topology | None = None,
                            init_single: bool = False) -> InitReport:
    """Initialise (or validate) the default process group; see the module docstring for the sequence.

    Args:
        cfg: a :class:`HardenConfig` (its ``distributed`` section is used, and its fingerprint compared across
            ranks) or a :class:`DistributedConfig`; a dict or YAML path still works, with a DeprecationWarning.
        backend: overrides ``distributed.backend``.
        timeout: overrides ``distributed.timeout`` (seconds or a timedelta).
        topology: a pre-computed topology (default: :func:`detect_topology`).
        init_single: create a 1-rank group even for a single process with no launcher.
    """
    dcfg, fingerprint = _typed(cfg, "safe_init_process_group")
    timeout_s = dcfg.timeout if timeout is None else seconds().check("timeout", timeout)
    topo = topology or detect_topology()
    existing = _dist.is_up()
    if not existing and topo.world_size == 1 and topo.launcher == "single" and not init_single:
        log.debug("single process with no launcher: no process group created")
        return InitReport(distributed=False, created=False, backend=None, rank=0, world_size=1, topology=topo)
    if not dist.is_available():
        raise InitError("torch.distributed is not available in this torch build; expected a build with "
                        "distributed support. Fix: install a standard torch wheel.", rank=topo.rank)
    if existing:
        report = _adopt(dcfg, fingerprint, topo)
        _note(report, f"a process group already exists (backend {report.backend}, world size "
                      f"{report.world_size}, launcher {topo.launcher}); robustdist did not re-initialise it, "
                      "so this call's backend/timeout/init_method settings do not take effect. It validated the "
                      "existing group instead.", once="existing-group")
        return report
    report = InitReport(distributed=True, created=True, backend=None, rank=topo.rank, world_size=topo.world_size,
                        topology=topo)
    report.backend = choose_backend(backend or dcfg.backend, topo.rank)
    if topo.world_size > 1:
        _check_env(report.backend, dcfg, topo)
    start = time.perf_counter()
    report.attempt, share = _init(report.backend, dcfg, timeout_s, topo,
                                  single=topo.world_size == 1 and topo.launcher == "single")
    group = dist.group.WORLD
    _created.add(group)
    exit_drain.install()  # a collective just before the script exits must not abort it (see exit_drain)
    report.timings["init"] = time.perf_counter() - start
    try:
        _validate(report, dcfg, fingerprint, share_attempt=share)
    except BaseException:
        group_teardown.destroy_default_group()
        raise
    _attempts[group] = report.attempt
    log.info("process group ready: backend %s, world size %d, attempt %d, timings %s", report.backend,
             report.world_size, report.attempt, {k: round(v, 3) for k, v in report.timings.items()})
    return report


def adopt_group(cfg: HardenConfig | DistributedConfig | None = None, *,
                topology: Topology | None = None) -> InitReport:
    """Validate a default group the script (or Ray Train) created, like :func:`safe_init_process_group` validates
    its own: the named barrier, the smoke test and the cross-rank agreement. ``created`` is False, so
    :func:`destroy_process_group_if_owned` leaves the group to its creator.

    What robustdist cannot protect in such a group is said loudly (a :class:`RobustDistWarning` and a log
    WARNING, on every rank): under torchrun with ``--max-restarts``, a group made by a plain
    ``init_process_group`` reads the previous attempt's keys after a restart and the restarted job fails to
    rendezvous (see :mod:`robustdist.init.elastic_store`).
    """
    if not _dist.is_up():
        raise InitError("adopt_group() found no process group; expected one created by the script or the launcher. "
                        "Fix: call safe_init_process_group() (or harden()) to create it instead.",
                        rank=(topology or detect_topology()).rank)
    dcfg, fingerprint = _typed(cfg, "adopt_group")
    return _adopt(dcfg, fingerprint, topology or detect_topology())


def _adopt(dcfg: DistributedConfig, fingerprint: str, topo: Topology) -> InitReport:
    report = InitReport(distributed=True, created=False, backend=_dist.backend_kind(), rank=dist.get_rank(),
                        world_size=dist.get_world_size(), topology=topo)
    exit_drain.install()
    owned = dist.group.WORLD in _created
    if not owned and _elastic_store.needed(os.environ, "env://"):
        message = (f"the process group was created outside robustdist under torchrun with restarts enabled "
                   f"(TORCHELASTIC_MAX_RESTARTS={os.environ.get('TORCHELASTIC_MAX_RESTARTS')}): torch reuses the "
                   "agent's store across restarts, so after a worker fails the restarted dist.init_process_group "
                   "finds the previous attempt's keys and the job does not recover. robustdist cannot protect a group "
                   "it did not create. Fix: remove dist.init_process_group(...) and let harden() create the group, "
                   "or call robustdist.safe_init_process_group() in its place (it gives each attempt a fresh store); with "
                   "Accelerate, call robustdist.safe_init_process_group() before Accelerator(), which then uses that "
                   "group.")
        report.warnings.append(message)
        log.warning("%s", message, all_ranks=True)
        warn(message, once="adopted-group-restarts", stacklevel=user_stacklevel())
    group = dist.group.WORLD
    mode = _elastic_store.attempt_mode(os.environ, "env://")
    mode = "agent-store" if mode == "fresh-store" else mode  # no store of its own: count in the group's
    share = group not in _attempts and mode in ("agent-store", "restart-count")
    if group in _attempts:  # robustdist created it, or adopted it before: the attempt is known
        report.attempt = _attempts[group]
    elif share:
        report.attempt = _elastic_store.contribution(mode, report.rank, default_store(), os.environ)
    _validate(report, dcfg, fingerprint, share_attempt=share)
    _attempts[group] = report.attempt
    log.info("adopted the existing process group: backend %s, world size %d, attempt %d", report.backend,
             report.world_size, report.attempt)
    return report


def _share_attempt(part: int, group: Any) -> int:
    """The attempt number from every rank's part: one int64 all_reduce(MAX) after the named barrier."""
    value = torch.tensor([part], dtype=torch.int64)
    if dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return max(0, int(value.item()))


def _validate(report: InitReport, dcfg: DistributedConfig, fingerprint: str, *, share_attempt: bool = False) -> None:
    report.rank, report.world_size = dist.get_rank(), dist.get_world_size()
    if report.backend != "gloo":  # monitored_barrier exists only on gloo (a 1-rank NCCL group too: the GPU run)
        report.side_group = dist.new_group(backend="gloo")
    report.timings["barrier"] = named_barrier("init", dcfg.barrier_timeout, group=report.side_group)
    if share_attempt:
        report.attempt = _share_attempt(report.attempt, report.side_group)
    report.timings["smoke"] = smoke_test(str(report.backend)) if dcfg.smoke_test else 0.0
    start = time.perf_counter()
    device = _dist.collective_device(report.backend)
    report.fingerprints, warnings = agree(fingerprint, str(report.backend), device, group=report.side_group)
    report.timings["agreement"] = time.perf_counter() - start
    for message in warnings:
        _note(report, message)


def _note(report: InitReport, message: str, *, once: Any = None) -> None:
    report.warnings.append(message)
    warn(message, once=once, stacklevel=user_stacklevel())


def destroy_process_group_if_owned(report: InitReport) -> bool:
    """Destroy the default group only if ``report`` says this process created it. Returns whether it did.

    A group robustdist only adopted is left to its creator; the gloo side group robustdist made to validate
    it (for a non-gloo backend) is destroyed, so repeated adopt/close cycles leak nothing."""
    if report.created and _dist.is_up():
        group_teardown.destroy_default_group()  # a DDP module freed later must not own the group last
        report.side_group = None
        return True
    group, report.side_group = report.side_group, None
    _dist.destroy_group(group, "the gloo side group")
    return False


@contextlib.contextmanager
def distributed(cfg: HardenConfig | DistributedConfig | None = None, **kwargs: Any) -> Iterator[InitReport]:
    """``with distributed(cfg) as report:`` init (or validate) on entry; destroy on exit only if created here."""
    report = safe_init_process_group(cfg, **kwargs)
    try:
        yield report
    finally:
        destroy_process_group_if_owned(report)
