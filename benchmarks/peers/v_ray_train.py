"""The contract's job (``_common.py``) written the way Ray Train (V2, the default in Ray 2.60) documents it.

A driver: ``python v_ray_train.py --workdir DIR ...`` connects to the Ray cluster ``RAY_ADDRESS`` names (the
runner starts one local head per run for its Ray Train launches, as jobs share a long-lived cluster) or, with
``RAY_ADDRESS`` unset or ``local``, starts its own (``ray.init(num_cpus=2, address="local")``); runs a
``TorchTrainer`` with 2 CPU workers, and disconnects (or shuts its own Ray down); it exits non-zero when the fit
ends in error. Idiomatic pieces, each from Ray Train's docs ("Get started with
PyTorch", "Saving and loading checkpoints", "Handling failures"):

* ``ray.train.torch.prepare_model`` (DDP over the gloo group Ray sets up) and ``prepare_data_loader`` on a
  ``DataLoader(shuffle=True)``: it swaps in ``DistributedSampler(dataset, shuffle=True)`` (seed 0, rank and world
  from the group: the job's sampler) and, as its docstring asks, ``loader.sampler.set_epoch(epoch)`` each epoch.
* checkpoints: rank 0 ``torch.save``s ``{model, optimizer, step, rng}`` into a temporary directory and every rank
  calls ``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp) or None)`` (synchronous upload, the
  default); Ray persists it to ``RunConfig(storage_path=DIR, name="ckpt")``, i.e. ``DIR/ckpt/checkpoint_<time>``,
  before ``report`` returns, and the controller registers it when it next polls the workers;
  ``ray.train.get_checkpoint()`` is the newest registered one. Measured here: a worker death soon after a
  ``report`` returned (the next step or the next save) resumed from the checkpoint before it, every time.
* resume: every rank loads ``get_checkpoint()``; mid-epoch, the batches already seen are iterated past
  (``_common.batches``; Ray documents no skip helper for torch DataLoaders).
* failures: ``FailureConfig(max_failures=--restarts)``: a dead or failed worker makes Ray restart the whole group,
  which resumes from the newest registered checkpoint.
* ``--timeout``: ``TorchTrainer(torch_config=TorchConfig(timeout_s=...))``.
* ``--sync-bn``: Ray Train has no SyncBatchNorm option (``prepare_model`` takes only DDP kwargs); the user's
  route is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` before ``prepare_model``. On CPU DDP rejects it
  ("SyncBatchNorm layers only work with GPU modules"): recorded, not worked around.

Workers import ``_common`` through ``runtime_env={"env_vars": {"PYTHONPATH": <this folder>}}``; the same
``env_vars`` carry the runner's launch marker (``ROBUSTDIST_PEERS_LAUNCH``, passed on as
``ROBUSTDIST_PEERS_RAY_JOB``) when set, so that the runner can find and stop this launch's worker processes on a
shared cluster.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import _common as C  # noqa: E402
import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

OPTIONS: dict[str, str] = {
    "timeout": "TorchConfig(timeout_s=...)",
    "sync_bn": "none in Ray Train; torch.nn.SyncBatchNorm.convert_sync_batchnorm before prepare_model()",
    "checkpoint": "rank 0 torch.save into a tmpdir + ray.train.report(checkpoint=Checkpoint.from_directory), "
                  "RunConfig(storage_path=DIR, name='ckpt'), all kept",
    "resume": "ray.train.get_checkpoint(); seen batches iterated past",
    "restarts": "FailureConfig(max_failures=--restarts)",
    "data": "prepare_data_loader(DataLoader(shuffle=True)): DistributedSampler(seed=0), sampler.set_epoch",
    "load_failure": "torch.load raises; the harness records it, deletes that checkpoint folder, restarts at 0",
    "nan": "no check (none in Ray Train)",
    "stuck": "the process-group timeout; Ray Train's hang detection (NCCL RAS) is NCCL-only",
}
# TorchConfig's default: ray/train/torch/config.py, `class TorchConfig`: `timeout_s: int = 1800`, passed to
# init_process_group as `timeout=timedelta(seconds=timeout_s)` (`_setup_torch_process_group`).
STUCK_DEFAULT_SECONDS = 1800.0
FILE = "checkpoint.pt"
MARKER = "ROBUSTDIST_PEERS_LAUNCH"  # the runner's launch marker (_launch.MARKER), passed on to the workers
JOB_MARKER = "ROBUSTDIST_PEERS_RAY_JOB"  # as this (_launch.JOB_MARKER)


def _load(ckpt: Checkpoint, rank: int, net: nn.Module, model: nn.Module, opt: Any) -> tuple[int, dict[str, Any]]:
    """Load ``ckpt`` on every rank; returns ``(step, verify)``.

    Harness behaviour, not Ray's: when any rank fails to load, every rank puts back the fresh state it had
    before trying, rank 0 deletes that checkpoint's folder and the run starts over from step 0, so it can go on."""
    fresh = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())
    error, step = None, 0
    try:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, FILE))
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step = int(state["step"])
    except Exception as e:  # noqa: BLE001 - any failure to load is the measurement
        error = f"{type(e).__name__}: {e}"
    ok = torch.tensor([int(error is None)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if bool(ok.item()):
        return step, {"ok": True, "step": step, "params": C.params_digest(model), "error": None}
    model.load_state_dict(fresh[0])
    opt.load_state_dict(fresh[1])
    torch.set_rng_state(fresh[2])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt.path, ignore_errors=True)
    dist.barrier()
    return 0, {"ok": False, "step": None, "params": None, "error": error or "another rank failed to load"}


def train_fn(config: dict[str, Any]) -> None:
    args = argparse.Namespace(**config)
    rank = ray.train.get_context().get_world_rank()
    log = os.path.join(args.workdir, f"events-rank{rank}.jsonl")
    restarted = os.path.exists(log) and os.path.getsize(log) > 0  # Ray's context has no attempt number
    events = C.Events(args.workdir, rank)
    try:
        net: nn.Module = C.model()
        if args.sync_bn:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        model = ray.train.torch.prepare_model(net)  # DDP(net); net is model.module
        opt = C.optimizer(model.parameters())
        loader = ray.train.torch.prepare_data_loader(DataLoader(C.dataset(), batch_size=args.batch, shuffle=True))
        start = 0
        verify: dict[str, Any] | None = None
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            start, verify = _load(checkpoint, rank, net, model, opt)
        elif restarted:  # a restart with nothing registered to resume from
            verify = {"ok": False, "step": None, "params": None, "error": "ray.train.get_checkpoint() is None"}
        events("start", resumed=start, **({"verify": verify} if verify is not None else {}))
        killer = C.SaveKiller(args, rank)

        def save(step: int, loss: float) -> None:  # every rank reports; rank 0 (the writer) records the events
            if rank == 0:
                events("save_begin", step=step, params=C.params_digest(model))
            killer.begin()
            t = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = None
                if rank == 0:
                    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                "rng": torch.get_rng_state()}, os.path.join(tmp, FILE))
                    checkpoint = Checkpoint.from_directory(tmp)
                ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint)  # persisted on return
            seconds = time.perf_counter() - t
            killer.end(seconds)
            if rank == 0:
                events("save", step=step, seconds=seconds, blocking=seconds)

        model.train()
        step, sampler = start, loader.sampler
        t0 = time.perf_counter()
        steps = C.batches(loader, sampler, start, len(loader)) if start < args.steps else iter(())
        for step, (x, y) in steps:  # noqa: B007 - step is used after the loop
            x = C.before_step(args, rank, step, x, events)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            events("step", step=step, seconds=time.perf_counter() - t0, loss=loss.item())
            if args.save_every and step % args.save_every == 0:
                save(step, loss.item())
            if step >= args.steps:
                break
            t0 = time.perf_counter()
        C.finish(model, args, rank, step, events)
    except Exception as e:
        events("error", type=type(e).__name__, message=str(e))
        raise


def main() -> int:
    args = C.parser(__doc__.splitlines()[0]).parse_args()
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env_vars = {"PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}
    if MARKER in os.environ:  # under another name: the workers keep the shared head's own marker too
        env_vars[JOB_MARKER] = os.environ[MARKER]
    address = os.environ.get("RAY_ADDRESS") or "local"
    own = {"num_cpus": 2, "include_dashboard": False} if address == "local" else {}
    ray.init(address=address, **own, log_to_driver=True, runtime_env={"env_vars": env_vars})
    try:
        trainer = TorchTrainer(
            train_fn,
            train_loop_config=vars(args),
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            torch_config=TorchConfig(timeout_s=int(args.timeout)) if args.timeout else TorchConfig(),
            run_config=RunConfig(storage_path=args.workdir, name="ckpt",
                                 failure_config=FailureConfig(max_failures=args.restarts)),
        )
        trainer.fit()  # V2: raises TrainingFailedError when the run ends in error
        return 0
    except Exception:  # noqa: BLE001 - report and exit non-zero
        traceback.print_exc()
        return 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
