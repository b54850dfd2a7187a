"""The contract's job (``_common.py``) written the way Lightning Fabric 2.6 documents it.

Idiomatic pieces, each from Fabric's docs ("Launch distributed training", "Saving and loading checkpoints",
``Fabric`` API reference):

* ``Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(...))`` and ``fabric.launch()``: under torchrun
  Fabric finds ``TorchElasticEnvironment`` (``creates_processes_externally``), so ``launch()`` spawns nothing and
  only initialises the gloo group.
* ``fabric.setup(model, optimizer)`` (DDP) and ``fabric.setup_dataloaders(DataLoader(shuffle=True))``: Fabric
  replaces the sampler with ``DistributedSampler(shuffle=True, seed=int(PL_GLOBAL_SEED or 0))`` (the job's:
  seed 0) and calls ``set_epoch`` itself, with the number of times the loader has been iterated.
* ``fabric.backward(loss)``.
* ``fabric.save(path, state)`` / ``fabric.load(path, state)`` with ``state = {"model", "optimizer", "step",
  "rng"}``; one file per save, ``DIR/ckpt/step-000012.ckpt`` (rank 0 writes, through fsspec's transaction, then a
  barrier); the newest is the file with the highest step. Fabric keeps every file (it has no retention option).
* mid-run resume: Fabric has no batch-skipping helper and sets the sampler's epoch from its own iteration
  count, which a new process starts at 0 (so calling ``sampler.set_epoch`` by hand is overridden). The plain
  way that keeps Fabric's own epoch bookkeeping right is to iterate the loader from the start and drop the
  batches already trained on (as litgpt's pretraining script fast-forwarded its data iterator).
* ``--timeout``: ``DDPStrategy(timeout=timedelta(seconds=...))``.
* ``--sync-bn``: Fabric has no ``sync_batchnorm`` option (the Trainer has one; ``lightning/fabric`` has no
  ``SyncBatchNorm`` anywhere); its docs leave it to the user: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
  before ``setup``. On CPU DDP rejects it ("SyncBatchNorm layers only work with GPU modules"): recorded, not
  worked around.

Launch: ``torchrun --standalone --nproc_per_node=2 [--max-restarts=R] v_fabric.py --workdir DIR ...``.
Restarts: with torch 2.13's torchrun as launched above, a restarted attempt often fails ("Gloo connectFullMesh
failed ... Connection refused") or hangs in ``init_process_group`` (gloo can read the dead attempt's peer
addresses from the agent store torchrun shares; see ``robustdist/init/elastic_store.py``) unless the launcher
sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; the variant does not set it (a launch choice, the same for every
torchrun variant).
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import _common as C
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

OPTIONS: dict[str, str] = {
    "timeout": "DDPStrategy(timeout=timedelta(seconds=...))",
    "sync_bn": "none in Fabric; torch.nn.SyncBatchNorm.convert_sync_batchnorm before setup()",
    "checkpoint": "fabric.save/fabric.load of {model, optimizer, step, rng}, ckpt/step-<n>.ckpt, all kept",
    "resume": "newest step-<n>.ckpt; loader iterated from the start, seen batches dropped (no Fabric skip)",
    "data": "setup_dataloaders(DataLoader(shuffle=True)): DistributedSampler(seed=0), set_epoch by Fabric",
    "load_failure": "fabric.load raises; the harness records it, deletes ckpt/ and restarts from step 0",
    "nan": "no check (none in Fabric)",
    "stuck": "nothing but the process-group timeout",
}
# DDPStrategy's default: lightning/fabric/strategies/ddp.py, `timeout: Optional[timedelta] = default_pg_timeout`,
# imported from lightning/fabric/plugins/collectives/torch_collective.py, which re-exports
# torch.distributed.constants.default_pg_timeout (torch/distributed/constants.py: `_DEFAULT_PG_TIMEOUT`, 30 min).
STUCK_DEFAULT_SECONDS = 1800.0


def _checkpoints(ckpt: str) -> list[str]:
    if not os.path.isdir(ckpt):
        return []
    return sorted(n for n in os.listdir(ckpt) if n.startswith("step-") and n.endswith(".ckpt"))


def resume(fabric: Fabric, model: nn.Module, opt: Any, ckpt: str) -> tuple[int, dict[str, Any] | None]:
    """Load the newest checkpoint when one exists; returns ``(step, verify)`` (verify None on a first start
    without one; after a torchrun restart without one, ok=False).

    Harness behaviour, not Fabric's: when any rank fails to load, every rank puts back the fresh state it had
    before trying, rank 0 deletes ``DIR/ckpt`` and the run starts over from step 0, so it can go on. Every rank
    reads the same file, so a bad file fails on all of them alike (``fabric.load`` ends in a barrier)."""
    names = _checkpoints(ckpt)
    if not names:
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # a restart with nothing to resume from
            return 0, {"ok": False, "step": None, "params": None, "error": f"no checkpoint in {ckpt}"}
        return 0, None
    fresh = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0, "rng": torch.get_rng_state()}
    error = None
    try:
        fabric.load(os.path.join(ckpt, names[-1]), state)
        torch.set_rng_state(state["rng"])
    except Exception as e:  # noqa: BLE001 - any failure to load is the measurement
        error = f"{type(e).__name__}: {e}"
    oks = fabric.all_gather(torch.tensor(int(error is None)))
    assert isinstance(oks, torch.Tensor)
    all_ok = bool(oks.min())
    if all_ok:
        return int(state["step"]), {"ok": True, "step": int(state["step"]), "params": C.params_digest(model),
                                    "error": None}
    model.load_state_dict(fresh[0])
    opt.load_state_dict(fresh[1])
    torch.set_rng_state(fresh[2])
    fabric.barrier()
    if fabric.global_rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    fabric.barrier()
    return 0, {"ok": False, "step": None, "params": None, "error": error or "another rank failed to load"}


def batches(loader: Any, start: int) -> Iterator[tuple[int, Any]]:
    """``(step, batch)`` from ``start + 1`` on: the loader from its first epoch, the first ``start`` batches
    dropped, so Fabric's per-iteration ``set_epoch`` stays the job's epoch."""
    seen = 0
    while True:
        for batch in loader:
            seen += 1
            if seen > start:
                yield seen, batch


def main() -> None:
    args = C.parser(__doc__.splitlines()[0]).parse_args()
    ckpt = os.path.join(args.workdir, "ckpt")
    os.makedirs(args.workdir, exist_ok=True)
    rank = int(os.environ["RANK"])  # torchrun's; the events file exists before the group does
    events = C.Events(args.workdir, rank)
    try:
        strategy = DDPStrategy(timeout=timedelta(seconds=args.timeout)) if args.timeout else DDPStrategy()
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        assert fabric.global_rank == rank
        model: nn.Module = C.model()
        if args.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        opt = C.optimizer(model.parameters())
        model, opt = fabric.setup(model, opt)
        loader = fabric.setup_dataloaders(DataLoader(C.dataset(), batch_size=args.batch, shuffle=True))
        start, verify = resume(fabric, model, opt, ckpt)
        events("start", resumed=start, **({"verify": verify} if verify is not None else {}))
        killer = C.SaveKiller(args, rank)

        def save(step: int) -> None:  # every rank calls fabric.save; rank 0 (the writer) records the events
            if rank == 0:
                events("save_begin", step=step, params=C.params_digest(model))
            state = {"model": model, "optimizer": opt, "step": step, "rng": torch.get_rng_state()}
            killer.begin()
            t = time.perf_counter()
            fabric.save(os.path.join(ckpt, f"step-{step:06d}.ckpt"), state)  # rank 0 writes, then a barrier
            seconds = time.perf_counter() - t
            killer.end(seconds)
            if rank == 0:
                events("save", step=step, seconds=seconds, blocking=seconds)

        model.train()
        step = start
        t0 = time.perf_counter()
        for step, (x, y) in batches(loader, start) if start < args.steps else iter(()):  # noqa: B007
            x = C.before_step(args, rank, step, x, events)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            opt.step()
            events("step", step=step, seconds=time.perf_counter() - t0, loss=loss.item())
            if args.save_every and step % args.save_every == 0:
                save(step)
            if step >= args.steps:
                break
            t0 = time.perf_counter()
        C.finish(model, args, rank, step, events)
    except Exception as e:
        events("error", type=type(e).__name__, message=str(e))
        raise


if __name__ == "__main__":
    main()
