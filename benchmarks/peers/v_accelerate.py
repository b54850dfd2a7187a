"""The contract's job (``_common.py``) written the way Hugging Face Accelerate 1.15 documents it.

Idiomatic pieces, each from Accelerate's own docs ("Checkpointing" usage guide, ``Accelerator`` reference):

* ``Accelerator(cpu=True)`` picks up torchrun's environment and uses gloo. ``cpu=True`` is needed: on a host
  without GPUs a plain ``Accelerator()`` under torchrun chooses ``DistributedType.NO`` (``AcceleratorState.
  _prepare_backend`` only picks MULTI_CPU when ``cpu`` is set, as ``accelerate launch --cpu`` /
  ``ACCELERATE_USE_CPU`` do), so each rank silently trains alone. ``accelerator.prepare(model, optimizer,
  loader)`` wraps the model in DDP and shards a plain ``DataLoader(shuffle=True)``. Accelerate shards with its
  own ``BatchSamplerShard`` (a ``DistributedSampler`` in the loader would be sharded twice), so the order comes from
  ``DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0)``: the same seeded permutation
  (``randperm`` seeded ``0 + epoch``) as the job's ``DistributedSampler``, and each step covers the same 2*B
  samples; the split of those samples between the two ranks differs (contiguous halves here, interleaved with a
  ``DistributedSampler``). ``loader.set_epoch(epoch)`` as the docs show.
* ``accelerator.backward(loss)``.
* ``save_state()`` / ``load_state()`` under ``ProjectConfiguration(project_dir=DIR/ckpt,
  automatic_checkpoint_naming=True, total_limit=3)``: checkpoints are ``DIR/ckpt/checkpoints/checkpoint_<i>``
  (model, optimizer, every rank's RNG, plus the step through ``register_for_checkpointing``); ``load_state()``
  with no path loads the newest. ``load_state`` does not restore the save counter, so the script sets
  ``project_configuration.iteration`` past the newest folder, as ``save_state``'s own error message asks.
* mid-epoch resume: ``accelerator.skip_first_batches(loader, n)`` for the first epoch after a resume.
* ``--timeout``: ``InitProcessGroupKwargs(timeout=timedelta(seconds=...))`` in ``kwargs_handlers``.
* ``--sync-bn``: Accelerate has no SyncBatchNorm switch for plain DDP (no ``SyncBatchNorm`` anywhere in
  ``accelerate/``); the user's route is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` before ``prepare``.
  On CPU ``prepare`` (DDP's constructor) raises ``ValueError: SyncBatchNorm layers only work with GPU
  modules``: recorded, not worked around.

Launch: ``torchrun --standalone --nproc_per_node=2 [--max-restarts=R] v_accelerate.py --workdir DIR ...``.
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
from datetime import timedelta
from typing import Any

import _common as C
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader

TOTAL_LIMIT = 3
OPTIONS: dict[str, str] = {
    "launch": "torchrun + Accelerator(cpu=True) (without cpu=True: DistributedType.NO, one rank per process)",
    "timeout": "InitProcessGroupKwargs(timeout=timedelta(seconds=...))",
    "sync_bn": "none in Accelerate; torch.nn.SyncBatchNorm.convert_sync_batchnorm before prepare()",
    "checkpoint": f"save_state()/load_state(), ProjectConfiguration(automatic_checkpoint_naming=True, "
                  f"total_limit={TOTAL_LIMIT}), step via register_for_checkpointing",
    "resume": "load_state() (newest) + skip_first_batches",
    "data": "DataLoader(shuffle=True) + DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0)",
    "load_failure": "load_state() raises; the harness records it, deletes ckpt/ and restarts from step 0",
    "nan": "no check (none in Accelerate)",
    "stuck": "nothing but the process-group timeout",
}
# Without --timeout Accelerate calls init_process_group(backend="gloo") with no timeout, so torch's default
# applies: torch/distributed/constants.py `default_pg_timeout = _DEFAULT_PG_TIMEOUT` (30 min). Accelerate's
# own InitProcessGroupKwargs says the same for non-nccl backends: accelerate/utils/dataclasses.py,
# InitProcessGroupKwargs.__post_init__ (`seconds = 1800 if self.backend != "nccl" else 600`).
STUCK_DEFAULT_SECONDS = 1800.0


class Progress:
    """The optimizer step reached, saved and loaded with the rest through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def _newest_index(folder: str) -> int:
    return max((int(n.rsplit("_", 1)[1]) for n in os.listdir(folder) if n.startswith("checkpoint_")), default=-1)


def resume(acc: Accelerator, model: nn.Module, opt: Any, progress: Progress, ckpt: str) -> dict[str, Any] | None:
    """Load the newest checkpoint when one exists; returns the ``verify`` field (None on a first start without
    one; after a torchrun restart without one, ok=False).

    Harness behaviour, not Accelerate's: when any rank fails to load, every rank puts back the fresh state it
    had before trying, rank 0 deletes ``DIR/ckpt`` and the run starts over from step 0, so it can go on."""
    folder = os.path.join(ckpt, "checkpoints")
    if not os.path.isdir(folder) or _newest_index(folder) < 0:
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # a restart with nothing to resume from
            return {"ok": False, "step": None, "params": None, "error": f"no checkpoint in {folder}"}
        return None
    fresh = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())
    error = None
    try:
        acc.load_state()  # no path + automatic_checkpoint_naming: the newest checkpoint_<i>
    except Exception as e:  # noqa: BLE001 - any failure to load is the measurement
        error = f"{type(e).__name__}: {e}"
    all_ok = bool(acc.gather(torch.tensor([int(error is None)])).min())
    if all_ok:
        acc.project_configuration.iteration = _newest_index(folder) + 1
        return {"ok": True, "step": progress.step, "params": C.params_digest(model), "error": None}
    model.load_state_dict(fresh[0])
    opt.load_state_dict(fresh[1])
    torch.set_rng_state(fresh[2])
    progress.step = 0
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(ckpt, ignore_errors=True)
    acc.wait_for_everyone()
    acc.project_configuration.iteration = 0
    return {"ok": False, "step": None, "params": None, "error": error or "another rank failed to load"}


def main() -> None:
    args = C.parser(__doc__.splitlines()[0]).parse_args()
    ckpt = os.path.join(args.workdir, "ckpt")
    os.makedirs(args.workdir, exist_ok=True)
    rank = int(os.environ["RANK"])  # torchrun's; the events file exists before the group does
    events = C.Events(args.workdir, rank)
    try:
        handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))] if args.timeout else []
        acc = Accelerator(
            cpu=True,
            kwargs_handlers=handlers,
            project_config=ProjectConfiguration(project_dir=ckpt, automatic_checkpoint_naming=True,
                                                total_limit=TOTAL_LIMIT),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
        )
        assert acc.process_index == rank
        model: nn.Module = C.model()
        if args.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        opt = C.optimizer(model.parameters())
        loader = DataLoader(C.dataset(), batch_size=args.batch, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        progress = Progress()
        acc.register_for_checkpointing(progress)
        verify = resume(acc, model, opt, progress, ckpt)
        start = progress.step
        events("start", resumed=start, **({"verify": verify} if verify is not None else {}))
        killer = C.SaveKiller(args, rank)

        def save(step: int) -> None:  # every rank calls save_state; rank 0 (the writer) records the events
            progress.step = step
            if rank == 0:
                events("save_begin", step=step, params=C.params_digest(model))
            killer.begin()
            t = time.perf_counter()
            acc.save_state()  # synchronous: durable (written) when it returns
            seconds = time.perf_counter() - t
            killer.end(seconds)
            if rank == 0:
                events("save", step=step, seconds=seconds, blocking=seconds)

        model.train()
        step, steps_per_epoch = start, len(loader)
        epoch, skip = divmod(start, steps_per_epoch)
        t0 = time.perf_counter()
        while step < args.steps:
            loader.set_epoch(epoch)
            # the docs' mid-epoch resume: skip what the checkpoint already saw, in the first epoch only
            epoch_loader = acc.skip_first_batches(loader, skip) if skip else loader
            for x, y in epoch_loader:
                step += 1
                x = C.before_step(args, rank, step, x, events)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                events("step", step=step, seconds=time.perf_counter() - t0, loss=loss.item())
                if args.save_every and step % args.save_every == 0:
                    save(step)
                if step >= args.steps:
                    break
                t0 = time.perf_counter()
            skip, epoch = 0, epoch + 1
        C.finish(model, args, rank, step, events)
        acc.end_training()
    except Exception as e:
        events("error", type=type(e).__name__, message=str(e))
        raise


if __name__ == "__main__":
    main()
