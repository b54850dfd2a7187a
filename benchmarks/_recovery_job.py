"""The training job P9 (``bench_recovery.py``) launches under torchrun, in one of four shapes (``--variant``):

* ``floor``: the restart floor: ``import torch``, ``init_process_group``, then tiny all_reduces every 50 ms (as a
  training loop would notice a dead peer) until ``--stop`` exists, ``destroy_process_group``.
* ``plain``: the pytorch/examples DDP tutorial's way: DDP + Adam; rank 0 ``torch.save``s model and optimizer every
  ``--every`` steps (``--every 0``: never); every rank ``torch.load``s that file at start when it exists. The
  save goes to a temporary name and is renamed into place (the tutorial writes in place; a kill mid-save would
  then leave a file no restart can load, and the benchmark would stop there).
* ``durable``: the same model and loop through ``harden()``, ``checkpoint.every_n_steps = --every``.
* ``memory``: ``durable`` plus the in-memory tier, ``checkpoint.local_every_n_steps = --local-every``.
* ``inprocess``: ``memory`` with ``recovery.in_process: true``, the loop run by ``h.run`` (benchmark P10,
  ``bench_inprocess.py``): a fault that kills no process is recovered in the same processes.

``--hang-timeout S`` sets ``health.hang_timeout`` with ``hang_action: abort`` (P10's SIGSTOP hangs and partitions:
the watchdog's verdict ends the process for torchrun's restart, or is a fault the in-process variant recovers from).

A fault that kills no process: SIGUSR1 makes the process raise ``RuntimeError`` at its next step, after the forward
and before the backward (its peer is then in DDP's all-reduce); ``fault`` is logged first. Under ``memory`` the
exception ends the process (``harden``'s block records it) and torchrun restarts the workers.

A step: a batch drawn from the step number (so replayed steps see the same data), forward, backward (DDP
all-reduce), Adam, the variant's save call, then ``--sleep`` seconds standing in for accelerator time the
host does not spend (a fixed sleep, never padding to a deadline, so checkpoint costs are never hidden).
Each process appends JSON lines to ``--events/rank<r>-pid<pid>.jsonl``: ``proc`` (its exec time from /proc,
and when the script began), ``imported``, ``ready`` (group and model built), ``resumed`` (step, source,
``t0``/``t1`` around the restore), ``step`` when a step is done (before its save), ``save`` after a save call
that saved (``save_s``: the call; ``blocking_s``: the in-memory tier's own blocking time; ``prev_commit_s``: how
long the previous in-memory save took to be complete across the job), ``done``; on a peer's death ``failed``
(when the error reached the script) and ``exiting`` (after leaving ``harden``'s block). Under ``inprocess``
``resumed`` is logged when ``h.run`` calls the loop again (``t0`` = ``t1``: the restore is inside the recovery), and
``failed`` each time an error leaves the loop.
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()

import argparse
import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any


def _exec_time() -> float:
    """When this process was created (wall clock): its age from /proc (10 ms resolution; not /proc/stat's btime,
    which is whole seconds)."""
    now = time.time()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class Events:
    """One JSON line per event, flushed at once (a SIGKILL loses nothing already written)."""

    def __init__(self, directory: str):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.rank = int(os.environ.get("RANK", "0"))
        self.file = open(Path(directory) / f"rank{self.rank}-pid{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def __call__(self, event: str, **fields: Any) -> None:
        fields.setdefault("t", time.time())
        self.file.write(json.dumps({"event": event, "rank": self.rank, "pid": os.getpid(), **fields}) + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("floor", "plain", "durable", "memory", "inprocess"), required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--ckpt", default=None, help="durable checkpoint dir (plain: where its snapshot file goes)")
    p.add_argument("--stop", default=None, help="floor: exit cleanly once this file exists")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=250, help="durable (plain: torch.save) cadence in steps; 0: never")
    p.add_argument("--local-every", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="health.hang_timeout, with hang_action abort (P10's hangs and partitions); default: none")
    return p.parse_args()


def floor(args: argparse.Namespace, events: Events) -> None:
    import torch
    import torch.distributed as dist

    events("imported")
    dist.init_process_group("gloo")
    events("ready")
    one = torch.ones(1)
    while not os.path.exists(args.stop):
        dist.all_reduce(one)
        time.sleep(0.05)
    dist.destroy_process_group()
    events("done")


def train(args: argparse.Namespace, events: Events) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    if args.variant != "plain":
        from robustdist import harden
    events("imported")
    # Adam drives this job's activations and moments toward denormal floats, whose arithmetic is slow on a CPU: without
    # this the step time of every variant, plain torch's included, drifts from 46 to 52 ms over an 80 s run (measured
    # 2026-12-05; the compute alone 13 -> 22 ms per 1400 steps), and a baseline taken first understates the run's own.
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    if args.variant == "plain":
        dist.init_process_group("gloo")
        hardened: Any = contextlib.nullcontext()
    else:
        ckpt: dict[str, Any] = {"dir": args.ckpt, "every_n_steps": args.every or None, "keep_last": 2}
        if args.variant in ("memory", "inprocess"):
            ckpt.update(local_every_n_steps=args.local_every, local_dir=os.environ["P9_LOCAL_DIR"])
        health = {"hang_timeout": args.hang_timeout, "hang_action": "abort"} if args.hang_timeout else {}
        hardened = harden(model, None, {"checkpoint": ckpt, "health": health,
                                        "recovery": {"in_process": args.variant == "inprocess"}})
    fault = _arm_faults()
    if args.variant == "inprocess":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        events("ready", attempt=hardened.attempt)

        def again(h: Any, start: int) -> None:
            from robustdist.recovery import generation, history

            # this recovery's phases on this rank (the last record, once one was recovered). A replacement that joined
            # generation N has recovered nothing itself: its history is empty (an IndexError here used to cost every
            # replaced rank of P11 a second recovery, found 2026-12-05)
            done = history()
            phases = {k: getattr(done[-1], k) for k in ("detect_s", "decide_s", "teardown_s", "rebuild_s",
                                                         "restore_s", "from_process")} if generation() and done else {}
            events("resumed", step=start, source=h.last_loaded.source if h.last_loaded is not None else None,
                   t0=time.time(), t1=time.time(), phases=phases)
            try:
                loop(args, events, h.model, optimizer, h, fault, start=start)
            except BaseException as e:
                events("failed", error=f"{type(e).__name__}: {str(e)[:300]}")
                raise

        try:
            hardened.run(again, optimizer=optimizer)
        finally:
            events("exiting")
        return
    try:
        with hardened as h:
            net = h.model if h is not None else nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
            attempt = h.attempt if h is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
            events("ready", attempt=attempt)
            try:
                loop(args, events, net, optimizer, h, fault)
            except BaseException as e:  # a peer died: what follows (leaving harden's block) delays the restart
                events("failed", error=f"{type(e).__name__}: {str(e)[:300]}")
                raise
        if h is None:
            dist.destroy_process_group()
    finally:
        events("exiting")


def _arm_faults() -> list[bool]:
    """SIGUSR1 sets the returned flag; the loop raises at its next step."""
    flag = [False]

    def on_signal(signum: int, frame: Any) -> None:
        flag[0] = True

    signal.signal(signal.SIGUSR1, on_signal)
    return flag


def loop(args: argparse.Namespace, events: Events, net: Any, optimizer: Any, h: Any, fault: list[bool], *,
         start: int | None = None) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    snapshot = os.path.join(args.ckpt, "snapshot.pt") if args.ckpt else ""
    t0, source = time.time(), None
    if start is not None:  # h.run resumed already (and logged it)
        pass
    elif h is not None:
        start = h.resume(optimizer=optimizer) or 0
        source = h.last_loaded.source if h.last_loaded is not None else None
    elif args.every and os.path.exists(snapshot):
        saved = torch.load(snapshot, map_location="cpu")
        net.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start, source = int(saved["step"]), "torch.load"
    else:
        start, source = 0, None
    if args.variant != "inprocess":
        events("resumed", step=start, source=source, t0=t0, t1=time.time())
    assert start is not None
    step, last_local = start, None  # type: tuple[int, Any]
    while step < args.steps:
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        loss = net(x).square().mean()
        if fault[0]:
            fault[0] = False
            events("fault", step=step)
            raise RuntimeError(f"injected fault (SIGUSR1) at step {step + 1} on rank {rank}")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        events("step", step=step)  # the step is done on this rank (logged before its save, which may not end)
        s0 = time.perf_counter()
        saved, blocking, commit = False, None, None
        if h is not None:
            info = h.save(step, optimizer=optimizer)
            saved = info is not None
            if type(info).__name__ == "LocalSaveInfo":  # the previous local save's background part is done by now
                blocking, commit = info.blocking_seconds, getattr(last_local, "total_seconds", None)
                last_local = info
        elif args.every and step % args.every == 0:
            saved = True
            if rank == 0:
                tmp = snapshot + ".tmp"
                torch.save({"model": net.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
                os.replace(tmp, snapshot)
        if saved:
            events("save", step=step, save_s=time.perf_counter() - s0, blocking_s=blocking, prev_commit_s=commit)
        time.sleep(args.sleep)
    events("done", step=step)


def main() -> None:
    args = parse_args()
    events = Events(args.events)
    events("proc", exec=_exec_time(), script=SCRIPT_START)
    if args.variant == "floor":
        floor(args, events)
    else:
        train(args, events)


if __name__ == "__main__":
    main()
