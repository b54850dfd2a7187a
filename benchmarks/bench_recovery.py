"""P9: goodput under failures: plain torch.save vs robustdist's durable tier vs durable + in-memory tier.

Two nodes of the lab (``robustdist.testing.nodelab``: network namespaces, one torchrun agent each, a private tmpfs per
node as its local disk; two torchrun agents on this host where the lab cannot run, and the record says so)
run ``_recovery_job.py``: DDP over gloo, a 2.1M-parameter MLP with Adam (25 MB of model and optimizer state),
~50 ms steps (~30 ms of host compute and all-reduce, then a fixed 20 ms sleep standing in for accelerator
time). Each variant trains the same steps under the same failure schedule, counted from its first step: a
failure every 21 to 28 s (the intervals below, in order), a rank SIGKILLed (alternately rank 1 and rank 0),
except the second failure, which kills node 1 (its agent and worker), empties its local disk and starts a
fresh agent there (a replaced node). Failures continue until the job ends, so every variant sees the same
failure rate. Variants: (a) ``plain``: rank 0 ``torch.save`` of model and optimizer every N steps, ``torch.load``
at start (the pytorch/examples DDP tutorial); (b) ``durable``: ``harden()`` with ``checkpoint.every_n_steps``
= N; (c) ``memory``: (b) plus ``checkpoint.local_every_n_steps`` = the local cadence. In the same run: a
baseline without checkpoints or failures before each variant, and the restart floor (torchrun restarting a
script that only imports torch and initialises a gloo group, killed the same way). Then, directly: the same
state (same step, same size) restored by ``LocalTier.load`` and by ``AtomicCheckpointer.load``, 2 ranks on this
host, warm (durable files in the page cache) and cold (after ``drop_caches``, where allowed), beside the floor of
any restore that copies the bytes once (the tier's file mapped and copied into memory in use, nothing checked),
at the job's state and at 100 MB and 1 GB of state.
The job's length (``--ideal-seconds`` of training) and N (``--durable-seconds`` of training) are converted to
steps with the first baseline's step time. Goodput = steps x the step time of a baseline run (no checkpoint,
no failure) taken right before the variant / wall time from the first step to the last; its ceiling =
(mean failure interval - restart floor) / mean failure interval, the interval being the variant's wall time / the
failures it saw (a variant that ends sooner sees fewer; the ceiling is over the same window as the goodput).

Everything is computed afterwards from the JSON lines each rank wrote (see ``_recovery_job.py``).
Run: .venv/bin/python benchmarks/bench_recovery.py [--ideal-seconds 62] [--durable-seconds 12.5] [--local-every 10]
[--variants plain,durable,memory] [--host] [--keep]; ``make bench BENCH=bench_recovery`` (about 7 minutes here).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
from robustdist.testing import nodelab

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "_recovery_job.py")
VARIANTS = ("plain", "durable", "memory")
INTERVALS = (24.0, 21.0, 27.0, 23.0, 28.0, 22.0, 26.0, 25.0)
"""Seconds from one failure to the next (the first counted from the first step): the same for every variant."""


def failure(n: int) -> tuple[str, int]:
    """The n-th failure of the schedule: the second replaces node 1 (once); the others SIGKILL rank 1, rank 0,
    rank 1, ... (rank 1 first)."""
    return ("node", 1) if n == 1 else ("rank", 1 if n == 0 or n % 2 else 0)


# torch 2.13 needs an unshared rendezvous store for a replaced agent to rejoin; quick failure detection as in the lab
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
RDZV = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2, "join_timeout": 60}
MAX_RESTARTS = 30


# ---------------------------------------------------------------------- two nodes
def _children(root: int) -> list[int]:
    """Every live descendant of ``root`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    found, stack = [], [root]
    while stack:
        for pid in kids.get(stack.pop(), []):
            found.append(pid)
            stack.append(pid)
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Nodes:
    """Two nodes, each running one torchrun agent: lab namespaces (a private tmpfs per node at ``local``) or,
    where the lab cannot run, two agents on this host with a local directory each."""

    def __init__(self, work: Path, use_lab: bool):
        self.work = work
        self.local = work / "node-local"
        self.lab = nodelab.NodeLab(2, local_disk=self.local, disk_size="1g", log_dir=work / "logs") if use_lab \
            else None
        self.ports: dict[str, int] = {}  # host mode: a rendezvous port of its own for each job
        self.address, self.interface = ("", "") if use_lab else _host_interface()
        self.procs: list[subprocess.Popen[bytes]] = []

    def local_dir(self, sub: str) -> str:
        """The in-memory tier's directory: the same path on every node (it is part of the job's config); in the
        lab a private tmpfs per node, on one host one directory both share."""
        return str(self.local / sub)

    def agent(self, node: int, args: list[str], *, rdzv_id: str, name: str, sub: str,
              launcher: tuple[str, ...] = ("torch.distributed.run",),
              base_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Node ``node``'s agent, by ``python -m <launcher>`` (torchrun; ``("robustdist", "run", ...)``: P11), with
        ``base_env`` in place of :data:`ENV` where given."""
        (self.work / "tmp").mkdir(exist_ok=True)  # torchrun's log directories (torchelastic_*), removed with the rest
        env = {**(ENV if base_env is None else base_env), "P9_LOCAL_DIR": self.local_dir(sub),
               "TMPDIR": str(self.work / "tmp")}
        if self.lab is not None:
            proc = self.lab.torchrun(node, JOB, args, nproc=1, max_restarts=MAX_RESTARTS, env=env, name=name,
                                     rdzv_id=rdzv_id, rdzv_conf=RDZV, launcher=launcher)
        else:
            conf = ",".join(f"{k}={v}" for k, v in {"is_host": int(node == 0), **RDZV}.items())
            port = self.ports.setdefault(rdzv_id, _free_port())
            argv = [sys.executable, "-m", *launcher, "--nnodes=2", "--nproc_per_node=1",
                    "--rdzv_backend=c10d", f"--rdzv_endpoint={self.address}:{port}", f"--rdzv_id={rdzv_id}",
                    f"--max-restarts={MAX_RESTARTS}", "--monitor-interval=0.5", f"--local_addr={self.address}",
                    f"--rdzv_conf={conf}", JOB, *args]
            (self.work / "logs").mkdir(parents=True, exist_ok=True)
            with open(self.work / "logs" / f"{name}.log", "ab") as out:
                proc = subprocess.Popen(argv, env={**os.environ, "GLOO_SOCKET_IFNAME": self.interface, **env},
                                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        self.procs.append(proc)
        return proc

    def kill_node(self, node: int, agent: subprocess.Popen[bytes]) -> None:
        if self.lab is not None:
            self.lab.kill_node(node)
        else:
            _kill([agent.pid, *_children(agent.pid)])
        agent.wait(timeout=15)

    def wipe(self, node: int, sub: str) -> None:
        """Empty the node's local disk (a replaced node starts with none of it). On one host there is no disk
        of the node's own to empty: the "replaced" agent finds the shared directory as it was."""
        if self.lab is not None:
            self.lab.exec(node, ["rm", "-rf", self.local_dir(sub)])

    def close(self) -> None:
        try:
            for proc in self.procs:
                if proc.poll() is None:
                    _kill([proc.pid, *_children(proc.pid)])
                    proc.wait(timeout=15)
        finally:
            if self.lab is not None:
                self.lab.close()
                left = nodelab.leftover_namespaces(owner=os.getpid())
                if left:
                    raise RuntimeError(f"P9 left lab namespaces behind: {left}")


def _host_interface() -> tuple[str, str]:
    """This host's non-loopback IPv4 address and its interface (robustdist refuses a loopback MASTER_ADDR for a
    job that spans nodes, rightly: two agents on one host stand in for two nodes here)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 9))  # no packet is sent: the kernel picks the source address
        address = str(s.getsockname()[0])
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return address, name
    raise RuntimeError(f"P9: no interface holds {address}; the host mode needs a non-loopback address")


def _free_port() -> int:
    from robustdist.testing.ranks import free_port

    return free_port()


# ---------------------------------------------------------------------- events
def read_events(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return sorted(out, key=lambda e: e["t"])


def live_pid(directory: Path, rank: int) -> int | None:
    """The running process of ``rank``, from the event files' names."""
    for path in sorted(directory.glob(f"rank{rank}-pid*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True):
        pid = int(path.stem.split("pid")[1])
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return pid
        except OSError:
            continue
    return None


def _tail_has(directory: Path, pattern: str, needle: str) -> bool:
    for path in directory.glob(pattern):
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 400))
            if needle.encode() in f.read():
                return True
    return False


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, agents: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        if any(a.poll() not in (None, 0) for a in agents):
            raise RuntimeError(f"P9: an agent failed (exit {[a.poll() for a in agents]}) while waiting for {what}")
        time.sleep(0.1)
    raise RuntimeError(f"P9: timed out after {timeout:g} s waiting for {what}")


def finish(agents: list[subprocess.Popen[bytes]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    for agent in agents:
        try:
            code = agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"P9: {what} did not finish within {timeout:g} s") from None
        if code != 0:
            raise RuntimeError(f"P9: {what}: an agent exited {code} (see the lab logs)")


@dataclass
class Proc:
    """One worker process, from its events."""

    rank: int
    marks: dict[str, float] = field(default_factory=dict)
    resumed: dict[str, Any] | None = None
    steps: list[tuple[float, int]] = field(default_factory=list)
    saves: list[tuple[float, int, dict[str, Any]]] = field(default_factory=list)


def processes(events: list[dict[str, Any]]) -> dict[int, Proc]:
    procs: dict[int, Proc] = {}
    for e in events:
        p = procs.setdefault(e["pid"], Proc(e["rank"]))
        if e["event"] == "proc":
            p.marks.update(exec=e["exec"], script=e["script"])
        elif e["event"] in ("imported", "ready", "done", "failed", "exiting"):
            p.marks[e["event"]] = e["t"]
        elif e["event"] == "resumed":
            p.resumed = e
        elif e["event"] == "step":
            p.steps.append((e["t"], e["step"]))
        elif e["event"] == "save":
            p.saves.append((e["t"], e["step"], e))
    return procs


@dataclass
class Kill:
    t: float
    kind: str
    target: int


# ---------------------------------------------------------------------- the runs
def floor_run(nodes: Nodes, work: Path, reps: int) -> list[dict[str, float]]:
    """The restart floor: kill a rank of a job that only imports torch and initialises a group, ``reps`` times."""
    ev, stop = work / "floor-events", work / "floor-stop"
    args = ["--variant", "floor", "--events", str(ev), "--stop", str(stop)]
    agents = [nodes.agent(i, args, rdzv_id="p9-floor", name=f"floor-n{i}", sub="floor") for i in range(2)]
    kills: list[float] = []

    def ready_since(t: float) -> bool:
        procs = processes(read_events(ev)).values()
        return {p.rank for p in procs if p.marks.get("exec", 0) > t and "ready" in p.marks} == {0, 1}

    for k in range(reps):
        wait_until(lambda: ready_since(kills[-1] if kills else 0.0), 90, "the floor job's group", agents)
        time.sleep(1.0)
        pid = live_pid(ev, (1, 0)[k % 2])
        assert pid is not None
        kills.append(time.time())
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: ready_since(kills[-1]), 90, "the floor job's last restart", agents)
    stop.touch()
    finish(agents, 60, "the floor job")
    procs = list(processes(read_events(ev)).values())
    out = []
    for t in kills:
        new = [min((p for p in procs if p.rank == r and p.marks["exec"] > t), key=lambda p: p.marks["exec"])
               for r in (0, 1)]
        m = {k: max(p.marks[k] for p in new) for k in ("exec", "script", "imported", "ready")}
        out.append({"floor": m["ready"] - t, "respawn": m["exec"] - t, "interpreter": m["script"] - m["exec"],
                    "import_torch": m["imported"] - m["script"], "init_group": m["ready"] - m["imported"]})
    return out


def job_args(variant: str, ev: Path, ckpt: Path, a: Any, steps: int, every: int) -> list[str]:
    return ["--variant", variant, "--events", str(ev), "--ckpt", str(ckpt), "--steps", str(steps), "--every",
            str(every), "--local-every", str(a.local_every), "--sleep", str(a.sleep)]


def baseline_run(nodes: Nodes, work: Path, a: Any, tag: str) -> list[float]:
    """Step intervals (rank 0) of the plain job with no checkpoint and no failure: the ideal step time, measured
    right before each variant (the machine is shared: its speed drifts between variants)."""
    ev = work / f"baseline-{tag}-events"
    agents = [nodes.agent(i, job_args("plain", ev, work / "baseline-ckpt", a, a.baseline_steps, 0),
                          rdzv_id=f"p9-baseline-{tag}", name=f"baseline-{tag}-n{i}", sub="baseline") for i in range(2)]
    finish(agents, 120, "the baseline job")
    (proc,) = [p for p in processes(read_events(ev)).values() if p.rank == 0]
    return intervals(proc)


def intervals(proc: Proc, skip: int = 5) -> list[float]:
    """Rank 0's step-to-step times, past the first ``skip`` steps of the process (warm-up)."""
    times = [t for t, _ in proc.steps][skip:]
    return [b - a for a, b in itertools.pairwise(times)]


def variant_run(nodes: Nodes, work: Path, variant: str, a: Any) -> tuple[list[dict[str, Any]], list[Kill]]:
    """Train ``variant`` under the failure schedule; returns its events and the failures injected."""
    ev, ckpt = work / f"{variant}-events", work / f"{variant}-ckpt"
    ckpt.mkdir(parents=True)
    args = job_args(variant, ev, ckpt, a, a.steps, a.every)
    agents = [nodes.agent(i, args, rdzv_id=f"p9-{variant}", name=f"{variant}-n{i}", sub=variant) for i in range(2)]
    wait_until(lambda: _tail_has(ev, "rank0-*.jsonl", '"event": "step"'), 120, f"{variant}'s first step", agents)
    first = min(t for p in processes(read_events(ev)).values() for t, _ in p.steps)
    kills: list[Kill] = []
    due = first + INTERVALS[0]
    deadline = time.monotonic() + a.variant_timeout
    while any(agent.poll() is None for agent in agents):
        if time.monotonic() > deadline:
            raise RuntimeError(f"P9: {variant} did not finish within {a.variant_timeout:g} s")
        if any(agent.poll() not in (None, 0) for agent in agents):
            raise RuntimeError(f"P9: {variant}: an agent failed (exit {[x.poll() for x in agents]}); see the logs")
        if time.time() >= due and not _tail_has(ev, "rank*.jsonl", '"event": "done"'):
            kind, target = failure(len(kills))
            kill: Kill | None = Kill(time.time(), kind, target)
            if kind == "node":
                nodes.kill_node(target, agents[target])
                nodes.wipe(target, variant)
                agents[target] = nodes.agent(target, args, rdzv_id=f"p9-{variant}", name=f"{variant}-n{target}-new",
                                             sub=variant)
            elif (pid := live_pid(ev, target)) is not None:
                os.kill(pid, signal.SIGKILL)
            else:  # the rank is between attempts: kill it once it is back
                kill = None
            if kill is not None:
                kills.append(kill)
                due += INTERVALS[len(kills) % len(INTERVALS)]
        time.sleep(0.05)
    finish(agents, 10, variant)
    return read_events(ev), kills


# ---------------------------------------------------------------------- analysis
def failures(events: list[dict[str, Any]], kills: list[Kill]) -> list[dict[str, Any]]:
    """Per failure: steps lost, and kill -> first new step split into restart, restore and replay."""
    procs = processes(events)
    out = []
    for i, k in enumerate(kills):
        current = {}
        for pid, p in procs.items():  # each rank's process that was running at the kill
            if p.marks.get("exec", 1e18) < k.t and (p.rank not in current or p.marks["exec"] > procs[current[p.rank]]
                                                    .marks["exec"]):
                current[p.rank] = pid
        before = max((s for pid in current.values() for _, s in procs[pid].steps), default=0)
        new: dict[int, tuple[float, int]] = {}
        for pid, p in procs.items():
            for t, s in p.steps:
                if t > k.t and s > before and (p.rank not in new or t < new[p.rank][0]):
                    new[p.rank] = (t, pid)
        if set(new) != {0, 1}:
            continue  # the job ended before any new step
        ps = [procs[pid] for _, pid in new.values()]
        if any(p.resumed is None for p in ps):
            continue
        first = max(t for t, _ in new.values())
        marks = {m: max(p.marks[m] for p in ps) for m in ("exec", "script", "imported", "ready")}
        r0, r1 = max(p.resumed["t0"] for p in ps), max(p.resumed["t1"] for p in ps)
        resumed = min(p.resumed["step"] for p in ps)
        overlapped = i + 1 < len(kills) and kills[i + 1].t < first
        survivors = [procs[pid] for pid in current.values() if "failed" in procs[pid].marks]
        tries = len({pid for pid, p in procs.items() if p.rank == 0 and k.t < p.marks.get("exec", 0) <= first})
        out.append({"kind": k.kind, "lost": before - resumed, "recovery": first - k.t, "restart": r0 - k.t,
                    "restore": r1 - r0, "replay": first - r1, "respawn": marks["exec"] - k.t,
                    "imports": marks["imported"] - marks["exec"], "init": r0 - marks["imported"],
                    "sources": sorted(str(p.resumed["source"]) for p in ps), "overlapped": overlapped, "tries": tries,
                    # the rank that lived: kill -> its error, and its error -> the process leaving the script
                    "detect": max((p.marks["failed"] - k.t for p in survivors), default=float("nan")),
                    "exit": max((p.marks.get("exiting", math.nan) - p.marks["failed"] for p in survivors),
                                default=float("nan"))})
    return out


def summarise(variant: str, events: list[dict[str, Any]], kills: list[Kill], ideal: float, steps: int,
              a: Any) -> dict[str, Any]:
    procs = processes(events)
    rank0 = [p for p in procs.values() if p.rank == 0]
    all_steps = sorted(t for p in rank0 for t, _ in p.steps)
    wall = all_steps[-1] - all_steps[0] + ideal  # from the start of the first step to the end of the last
    per_failure = failures(events, kills)
    lone = [f for f in per_failure if not f["overlapped"]]
    saves: dict[str, list[float]] = {"local": [], "durable": [], "local_info": [], "commit": []}
    others: dict[int, list[tuple[float, dict[str, Any]]]] = {}
    for p in procs.values():
        if p.rank != 0:
            for t, s, e in p.saves:
                others.setdefault(s, []).append((t, e))
    for p in rank0:
        for t, s, e in p.saves:  # with the other rank's event of the same save (the nearest in time)
            pair = [e, *[o for u, o in others.get(s, []) if abs(u - t) < 1.0][:1]]
            worst = max(x["save_s"] for x in pair)  # the step waits for the slowest rank
            if a.every and s % a.every == 0:
                saves["durable"].append(worst)
            elif variant == "memory" and s % a.local_every == 0:
                saves["local"].append(worst)
                saves["local_info"] += [x["blocking_s"] for x in pair if x["blocking_s"] is not None]
                saves["commit"] += [x["prev_commit_s"] for x in pair if x["prev_commit_s"] is not None]
    steady = [x for p in rank0 for x in intervals(p)]
    return {"goodput": steps * ideal / wall, "wall": wall, "failures": per_failure, "lone": lone,
            "mean_interval": wall / len(kills) if kills else float("nan"),
            "step_mean": statistics.mean(steady), "saves": saves, "kills": kills}


# ---------------------------------------------------------------------- restore: memory vs durable, directly
def _copy_floor(rank: int, path: str, nbytes: int, live: Any) -> float:
    """The floor of any restore that copies the bytes once: a tier file's bytes, mapped, copied into memory already
    in use (no checks, no deserialising), on every rank at once."""
    import mmap
    import warnings

    import torch

    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        mapping = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # torch's notice that the buffer is read-only: it is only read
            warnings.simplefilter("ignore")
            live.copy_(torch.frombuffer(mapping, dtype=torch.uint8))
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    del mapping
    return elapsed


def _restore_rank(rank: int, base: str, shm: str, lineage: str, width: int, layers: int,
                  reps: int) -> dict[str, list[float]]:
    import warnings

    import torch
    import torch.distributed as dist

    from robustdist.checkpoint import AtomicCheckpointer, LocalTier

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(8, width)).square().mean().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    durable = AtomicCheckpointer(os.path.join(base, "durable"), keep_last=1)
    tier = LocalTier(shm, lineage=lineage)
    durable.save(1, state)
    tier.save(1, state)
    tier.wait()
    biggest = max(Path(tier.directory).glob("owner_*/own/step_*/*.pt"), key=lambda p: p.stat().st_size, default=None)
    box = [str(biggest) if rank == 0 and biggest is not None else None]
    dist.broadcast_object_list(box, src=0)  # rank 0's replicated entries: the file every rank restores here
    floor_path = box[0]
    floor_bytes = os.path.getsize(floor_path) if floor_path else 0
    floor_live = torch.ones(floor_bytes, dtype=torch.uint8)

    def drop() -> bool:
        dist.barrier()
        ok = True
        if rank == 0:
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3")
            except OSError:
                ok = False
        box = [ok]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    loads = {"memory": lambda: tier.load(state=state), "durable warm": lambda: durable.load(state=state),
             "durable cold": lambda: durable.load(state=state)}
    times: dict[str, list[float]] = {k: [] for k in (*loads, "copy floor")}
    # the warm loads and the floor interleaved, in turn first; the cold ones last (a cache drop slows whatever
    # follows it: code pages too)
    order = [["memory", "durable warm"], ["durable warm", "memory"]]
    for name in [n for rep in range(reps) for n in (*order[rep % 2], "copy floor")] + ["durable cold"] * reps:
        if name == "durable cold" and not drop():
            break
        dist.barrier()
        if name == "copy floor":
            if floor_path:
                times[name].append(_copy_floor(rank, floor_path, floor_bytes, floor_live))
            continue
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = loads[name]()
        times[name].append(time.perf_counter() - start)
        assert loaded is not None and loaded.step == 1
        assert name != "memory" or loaded.source == "memory", loaded.source
    tier.close(clean=True)
    durable.close()
    return times


def _state_mb(width: int, layers: int) -> float:
    """Model and Adam state of the benchmark's MLP, in MB: what each rank restores."""
    return 3 * (layers * (width * width + width)) * 4 / 1e6


def restore_run(a: Any, width: int, layers: int) -> dict[str, list[float]]:
    from robustdist.testing.ranks import run_ranks

    base = tempfile.mkdtemp(prefix="rd-bench-restore-")
    shm = tempfile.mkdtemp(prefix="rd-bench-restore-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        out = run_ranks(_restore_rank, 2, args=(base, shm, f"p9-{uuid.uuid4().hex}", width, layers,
                                                a.restore_reps), init=True, timeout=600)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    # a collective restore is done when its slowest rank is
    return {k: [max(r) for r in zip(*(o[k] for o in out))] for k in out[0]}


RESTORE_STATES = {"100mb": (2048, 2), "1gb": (4096, 5)}
"""The larger states the in-memory restore is also measured at: name -> (width, layers), 101 MB and 1007 MB."""


# ---------------------------------------------------------------------- main
def main() -> None:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--ideal-seconds", type=float, default=62.0,
                   help="the job's length: steps = this / the baseline step time (measured first, in the same run)")
    p.add_argument("--durable-seconds", type=float, default=12.5,
                   help="durable (and plain) checkpoint spacing in seconds of training, rounded to local cadences")
    p.add_argument("--steps", type=int, default=None, help="override --ideal-seconds")
    p.add_argument("--every", type=int, default=None, help="override --durable-seconds (steps)")
    p.add_argument("--local-every", type=int, default=10, help="in-memory cadence, steps")
    p.add_argument("--sleep", type=float, default=0.02, help="seconds of 'accelerator time' per step")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--baseline-steps", type=int, default=130, help="steps of each baseline (one before each variant)")
    p.add_argument("--floor-reps", type=int, default=3)
    p.add_argument("--restore-reps", type=int, default=5)
    p.add_argument("--variant-timeout", type=float, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--host", action="store_true", help="two agents on this host even where the lab can run")
    p.add_argument("--keep", action="store_true", help="keep the work directory (events, logs)")
    args = p.parse_args()
    why = nodelab.unavailable()
    use_lab = why is None and not args.host
    work = Path(tempfile.mkdtemp(prefix="rd-bench-recovery-"))
    variants = [v for v in args.variants.split(",") if v]
    started, load0 = time.time(), os.getloadavg()[0]
    try:
        nodes = Nodes(work, use_lab)
        try:
            floor = floor_run(nodes, work, args.floor_reps)
            print(f"  floor: {[round(f['floor'], 2) for f in floor]}", flush=True)
            ideal_steps: dict[str, list[float]] = {}
            runs = {}
            for variant in variants:
                ideal_steps[variant] = baseline_run(nodes, work, args, variant)
                ideal = statistics.mean(ideal_steps[variant])
                if args.steps is None:  # the job's length and durable cadence, from the first baseline
                    args.steps = round(args.ideal_seconds / ideal)
                if args.every is None:
                    args.every = args.local_every * max(1, round(args.durable_seconds / ideal / args.local_every))
                print(f"  baseline step: mean {ideal * 1e3:.1f} ms; {args.steps} steps, durable every {args.every}",
                      flush=True)
                events, kills = variant_run(nodes, work, variant, args)
                runs[variant] = summarise(variant, events, kills, ideal, args.steps, args)
                print(f"  {variant}: goodput {runs[variant]['goodput']:.3f}, {len(kills)} failures, "
                      f"{runs[variant]['failures']}", flush=True)
        finally:
            nodes.close()
        restore = restore_run(args, args.width, args.layers)
        larger = {name: restore_run(args, *shape) for name, shape in RESTORE_STATES.items()}
    except BaseException:
        dump_logs(work)
        raise
    finally:
        tidy(work, args.keep)
    report(args, use_lab, why, floor, ideal_steps, runs, restore, larger, time.time() - started,
           (load0, os.getloadavg()[0]))


def dump_logs(work: Path) -> None:
    """What the agents and ranks said, for a failed run."""
    for log in sorted((work / "logs").glob("*.log")):
        print(f"----- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)


def tidy(work: Path, keep: bool) -> None:
    if keep:
        print(f"  work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def _med(values: list[float]) -> float:
    """The median of what was measured (NaN: not measured for that failure); NaN when nothing was."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else float("nan")


def report(args: Any, use_lab: bool, why: str | None, floor: list[dict[str, float]],
           ideal_steps: dict[str, list[float]],
           runs: dict[str, dict[str, Any]], restore: dict[str, list[float]],
           larger: dict[str, dict[str, list[float]]], seconds: float, load: tuple[float, float]) -> None:
    floor_s = _med([f["floor"] for f in floor])
    times: dict[str, list[float]] = {"restart floor: kill to group ready (torch + init_process_group)":
                                     [f["floor"] for f in floor]}
    metrics: dict[str, float] = {"lab": float(use_lab), "floor_seconds": floor_s}
    for part in ("respawn", "interpreter", "import_torch", "init_group"):
        metrics[f"floor_{part}_seconds"] = _med([f[part] for f in floor])
    for v, r in runs.items():
        ideal = statistics.mean(ideal_steps[v])
        times[f"{v}: baseline step right before (no checkpoint, no failure)"] = ideal_steps[v]
        metrics[f"ideal_step_seconds_{v}"] = ideal
        metrics[f"goodput_{v}"] = r["goodput"]
        metrics[f"ceiling_{v}"] = (r["mean_interval"] - floor_s) / r["mean_interval"]
        metrics[f"mean_failure_interval_seconds_{v}"] = r["mean_interval"]
        rank_kills = [f for f in r["lone"] if f["kind"] == "rank"]
        node_kills = [f for f in r["lone"] if f["kind"] == "node"]
        lost = [f["lost"] for f in r["failures"]]
        times[f"{v}: kill to first new step (rank kills)"] = [f["recovery"] for f in rank_kills]
        times[f"{v}: restore (resume() / torch.load)"] = [f["restore"] for f in r["lone"]]
        metrics[f"failures_{v}"] = float(len(r["kills"]))
        metrics[f"wall_seconds_{v}"] = r["wall"]
        metrics[f"steps_lost_mean_{v}"] = statistics.mean(lost) if lost else float("nan")
        metrics[f"steps_lost_max_{v}"] = float(max(lost)) if lost else float("nan")
        for part in ("recovery", "restart", "restore", "replay", "respawn", "imports", "init", "detect", "exit"):
            metrics[f"{part}_seconds_{v}"] = _med([f[part] for f in rank_kills])
        metrics[f"node_kill_recovery_seconds_{v}"] = _med([f["recovery"] for f in node_kills])
        metrics[f"step_time_ratio_{v}"] = r["step_mean"] / ideal
        if r["saves"]["durable"]:
            metrics[f"durable_save_blocking_seconds_{v}"] = _med(r["saves"]["durable"])
    if "memory" in runs:
        m = runs["memory"]
        local = m["saves"]["local"]
        times["memory: h.save() at a local-only step (slowest rank)"] = local
        metrics["local_save_call_mean_seconds"] = statistics.mean(local)
        metrics["local_save_blocking_info_median_seconds"] = _med(m["saves"]["local_info"])
        metrics["local_commit_seconds_median"] = _med(m["saves"]["commit"])
        metrics["local_commit_seconds_max"] = max(m["saves"]["commit"], default=float("nan"))
        cadence_seconds = args.local_every * metrics["ideal_step_seconds_memory"]
        metrics["local_blocking_fraction"] = statistics.mean(local) / cadence_seconds
        metrics["steps_lost_max_per_local_cadence"] = metrics["steps_lost_max_memory"] / args.local_every
        metrics["recovery_minus_floor_seconds"] = metrics["recovery_seconds_memory"] - floor_s
        metrics["goodput_gap_to_ceiling"] = metrics["ceiling_memory"] - m["goodput"]
        others = [runs[v]["goodput"] for v in runs if v != "memory"]
        if others:
            metrics["goodput_margin_over_others"] = m["goodput"] - max(others)
            metrics["goodput_ratio_over_others"] = m["goodput"] / max(others)
    times["restore, same state: LocalTier.load (memory)"] = restore["memory"]
    times["restore, same state: AtomicCheckpointer.load, page cache warm"] = restore["durable warm"]
    metrics["restore_memory_vs_durable_warm"] = _med(restore["memory"]) / _med(restore["durable warm"])
    if restore["durable cold"]:
        times["restore, same state: AtomicCheckpointer.load, cold (drop_caches)"] = restore["durable cold"]
        metrics["restore_memory_vs_durable_cold"] = _med(restore["memory"]) / _med(restore["durable cold"])
    metrics["restore_copy_floor_vs_durable_warm"] = _med(restore["copy floor"]) / _med(restore["durable warm"])
    times["restore, same state: the copy floor (the file's bytes mapped and copied once into memory in use)"] = \
        restore["copy floor"]
    for name, r in larger.items():
        mb = _state_mb(*RESTORE_STATES[name])
        times[f"restore, {mb:.0f} MB: LocalTier.load (memory)"] = r["memory"]
        times[f"restore, {mb:.0f} MB: AtomicCheckpointer.load, page cache warm"] = r["durable warm"]
        times[f"restore, {mb:.0f} MB: the copy floor"] = r["copy floor"]
        metrics[f"restore_gbps_{name}"] = mb / 1e3 / _med(r["memory"])
        metrics[f"restore_memory_vs_durable_warm_{name}"] = _med(r["memory"]) / _med(r["durable warm"])
        metrics[f"restore_copy_floor_vs_durable_warm_{name}"] = _med(r["copy floor"]) / _med(r["durable warm"])
    where = "2 lab nodes (network namespaces, one torchrun agent and one rank each, a private tmpfs local disk)" \
        if use_lab else (f"2 torchrun agents on one host, 1 rank each (NOT the lab: {why or '--host'}; the node kill "
                         "restarts node 1's agent with the shared local directory intact, not a replaced node)")
    state_mb = _state_mb(args.width, args.layers)
    step_ms = statistics.mean(metrics[f"ideal_step_seconds_{v}"] for v in runs) * 1e3
    setup = (f"{where}; DDP/gloo MLP {args.layers}x{args.width} + Adam ({state_mb:.0f} MB of state), "
             f"{args.steps} steps of ~{step_ms:.0f} ms ({args.sleep * 1e3:.0f} ms of it a fixed sleep; the ideal step "
             "time is measured right before each variant); durable "
             f"(plain: torch.save) every {args.every} steps, in-memory every {args.local_every}; failures "
             f"{min(INTERVALS):g} to {max(INTERVALS):g} s apart from the first step on (rank SIGKILLs, the 2nd a node "
             "replacement), the same schedule for every variant, until the job ends; ceiling = (mean failure "
             "interval - floor) / mean failure interval, the interval being the variant's wall time / its failures; "
             f"restores measured directly at {state_mb:.0f} MB and at "
             f"{', '.join(f'{_state_mb(*shape):.0f} MB' for shape in RESTORE_STATES.values())} of state (2 ranks, "
             f"{args.restore_reps} of each, interleaved); {seconds:.0f} s in all")
    notes = [(f"machine load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
              f"{os.cpu_count()} CPUs: other work on the machine stretches steps and restarts alike")]
    notes += [f"{v}, per failure (kind, steps lost, kill to first new step = restart + restore + replay s, sources): "
              + "; ".join(f"{f['kind']} {f['lost']} {f['recovery']:.2f} = {f['restart']:.2f} + {f['restore']:.2f} + "
                          f"{f['replay']:.2f} {'/'.join(f['sources'])}{' (overlapped)' if f['overlapped'] else ''}"
                          for f in r["failures"]) for v, r in runs.items()]
    metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}  # NaN: no such failure in the run
    h.emit(args, "P9", "goodput under failures: torch.save vs durable tier vs + in-memory tier", times, metrics,
           setup=setup, notes=notes)


if __name__ == "__main__":
    main()
