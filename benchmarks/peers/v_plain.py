"""The peer job in plain torch, the way pytorch/examples' DDP scripts write it (``ddp-tutorial-series``'
``multigpu_torchrun.py``): ``init_process_group`` from torchrun's environment, ``DistributedDataParallel``, a
``DistributedSampler`` with ``set_epoch``, rank 0 ``torch.save``-ing one snapshot to a fixed path, and every rank
``torch.load``-ing it on start when it exists.

Run: ``torchrun --standalone --nproc_per_node=2 [--max-restarts=R] v_plain.py --workdir DIR [flags]`` (the flags
and events are :mod:`_common`'s contract).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (SaveKiller, Events, batches, before_step, dataset, finish, model, optimizer, params_digest,
                     parser)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

OPTIONS = {
    "timeout": "init_process_group(timeout=timedelta(seconds=T)); unset: torch's default_pg_timeout",
    "sync_bn": "nn.SyncBatchNorm.convert_sync_batchnorm before DDP (torch's, whose forward needs a GPU)",
    "save": "rank 0 torch.save of {model, optimizer, step, rng} to ckpt/checkpoint.pt, one fixed path",
    "resume": "torch.load of ckpt/checkpoint.pt on start; mid-epoch by iterating past the batches already seen",
    "load_failure": "plain torch dies on a checkpoint that does not load; the harness records it and restarts "
                    "from step 0 so later kills are measured",
    "nan": "no check (none in plain torch)",
    "stuck": "nothing but the process-group timeout",
}
# Without --timeout, init_process_group uses torch's default for gloo: torch/distributed/constants.py
# `default_pg_timeout` (30 min).
STUCK_DEFAULT_SECONDS = 1800.0


def _resume(path: str, net: nn.Module, opt: torch.optim.Optimizer, events: Events) -> int:
    """Every rank ``torch.load``-s the snapshot when it exists, as pytorch/examples does.

    Harness behaviour, not plain torch's: where the file does not load (pytorch/examples' script would die
    with the error, and every torchrun restart with it), the failure is recorded in ``verify`` and every rank
    starts over from step 0, so the run goes on to the next measured kill."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not os.path.exists(path):
        missing = {"ok": False, "step": None, "params": None, "error": f"{path} does not exist"}
        events("start", resumed=0, **({"verify": missing} if restarted else {}))
        return 0
    snapshot, error = None, None
    try:
        snapshot = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a checkpoint that does not load is the measurement
        error = f"{type(e).__name__}: {e}"
    ok = torch.tensor([int(snapshot is not None)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if snapshot is None or not int(ok):
        events("start", resumed=0, verify={"ok": False, "step": None, "params": None,
                                           "error": error or "another rank could not load it"})
        return 0
    net.load_state_dict(snapshot["model"])
    opt.load_state_dict(snapshot["optimizer"])
    torch.set_rng_state(snapshot["rng"])
    step = int(snapshot["step"])
    events("start", resumed=step, **({"verify": {"ok": True, "step": step, "params": params_digest(net),
                                                  "error": None}} if restarted else {}))
    return step


def _save(path: str, step: int, net: nn.Module, opt: torch.optim.Optimizer, events: Events,
          killer: SaveKiller) -> None:
    events("save_begin", step=step, params=params_digest(net))
    t0 = time.perf_counter()
    killer.begin()
    snapshot = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}
    torch.save(snapshot, path)
    seconds = time.perf_counter() - t0
    killer.end(seconds)
    events("save", step=step, seconds=seconds, blocking=seconds)


def train(args: argparse.Namespace, rank: int, events: Events) -> None:
    net = model()
    if args.sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    ddp = DDP(net)
    data = dataset()
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = optimizer(ddp.parameters())
    path = os.path.join(args.workdir, "ckpt", "checkpoint.pt")
    start = _resume(path, net, opt, events)
    killer = SaveKiller(args, rank)
    step = start
    t0 = time.perf_counter()
    for step, (x, y) in batches(loader, sampler, start, len(loader)) if start < args.steps else ():
        x = before_step(args, rank, step, x, events)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        events("step", step=step, seconds=time.perf_counter() - t0, loss=float(loss.detach()))
        if args.save_every and step % args.save_every == 0 and rank == 0:
            _save(path, step, net, opt, events, killer)
        if step >= args.steps:
            break
        t0 = time.perf_counter()
    finish(net, args, rank, step, events)


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rank = int(os.environ["RANK"])
    os.makedirs(os.path.join(args.workdir, "ckpt"), exist_ok=True)
    events = Events(args.workdir, rank)
    kwargs = {"timeout": timedelta(seconds=args.timeout)} if args.timeout is not None else {}
    try:
        dist.init_process_group("gloo", **kwargs)
        train(args, rank, events)
    except Exception as e:
        events("error", type=type(e).__name__, message=str(e))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
