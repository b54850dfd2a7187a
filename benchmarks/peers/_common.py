"""The contract every peer variant follows (``benchmarks/peers/v_*.py``): one job, written idiomatically once
per framework, driven by the same flags and reporting the same events.

The job: DDP over 2 gloo ranks on CPU, a small convnet with BatchNorm (:func:`model`), a seeded synthetic
image set (:func:`dataset`) behind a ``DistributedSampler`` (seed 0, ``set_epoch`` every epoch), SGD with
momentum, ``--steps`` optimizer steps that run across epochs. Each variant uses its framework's own way to
set up, save and load (plain torch: ``torch.save`` by rank 0; Accelerate: ``prepare`` and
``save_state``/``load_state``; Fabric: ``setup`` and ``save``/``load``; Ray Train: ``prepare_model``,
``prepare_data_loader`` and ``ray.train.report`` with a checkpoint; robustdist: ``harden``), and resumes from
its newest checkpoint when one exists. Where a framework documents an option for what a column measures
(a process-group timeout, SyncBatchNorm, skipping the batches already seen), the variant uses it when the
runner asks (``--timeout``, ``--sync-bn``) and says so in ``OPTIONS``.

Flags (:func:`parser`), the same for every variant:

* ``--workdir DIR``: everything goes here; checkpoints in ``DIR/ckpt``; it survives restarts.
* ``--steps N`` (total), ``--save-every K`` (0: never), ``--batch B`` (per rank).
* faults, each once per workdir (a marker file, :func:`once`), always on rank 1 unless said otherwise:
  ``--kill-at S`` (SIGKILL itself when about to run step S), ``--nan-at S`` (its loss at step S is NaN: the
  batch is multiplied by NaN), ``--stuck-at S`` (sleeps for an hour before step S's forward),
  ``--kill-in-save`` (rank 0, the writer, SIGKILLs itself at a random moment of a save, see
  :class:`SaveKiller`; ``--kill-saves M``: for the first M attempts, one such kill each).
* ``--timeout SECONDS``: the framework's process-group (or hang) timeout option; unset: its default.
* ``--sync-bn``: the framework's way to synchronise BatchNorm statistics, when it has one.
* ``--restarts R``: Ray Train's ``FailureConfig(max_failures=R)``; the torchrun variants get torchrun's
  ``--max-restarts`` instead.

Launch: every variant but Ray Train is ``torchrun --standalone --nproc_per_node=2 v_<name>.py <flags>``; the
Ray Train variant is a driver, ``python v_ray_train.py <flags>``, that connects to the local Ray head the runner
started for the run (or, outside the runner, starts its own: ``ray.init(num_cpus=2)``), runs a ``TorchTrainer``
with 2 workers, and disconnects.

Events (:class:`Events`): JSON lines in ``DIR/events-rank<r>.jsonl``, each with ``event``, ``rank``, ``pid``
and ``t`` (``time.time()``):

* ``start``: ``resumed`` (the step resumed from, 0 when fresh), ``verify`` (only after a restart: whether the
  newest checkpoint loaded, ``ok``, ``step``, ``params`` and ``error``);
* ``step``: ``step`` (the step just finished, 1-based), ``seconds`` (its wall time: data, forward, backward,
  optimizer), ``loss``;
* ``save_begin``: ``step``, ``params`` (:func:`params_digest` of the state being saved);
* ``save``: ``step``, ``seconds`` (until the checkpoint is durable), ``blocking`` (how long the training loop
  was held);
* ``stuck``: rank 1, right before it sleeps;
* ``error``: ``type``, ``message`` (then the exception propagates);
* ``done``: ``step``, ``params`` (digest), ``finite`` (every parameter finite), ``bn_means`` (the first
  BatchNorm's running mean, as a list, to compare across ranks).

Rank 0 also writes the final parameters to ``DIR/final.pt``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

IMAGES, CLASSES, SIZE = 512, 10, 16
LR, MOMENTUM = 0.05, 0.9


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--nan-at", type=int, default=None)
    p.add_argument("--stuck-at", type=int, default=None)
    p.add_argument("--kill-in-save", action="store_true")
    p.add_argument("--kill-saves", type=int, default=1)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--restarts", type=int, default=0, help="Ray Train only (FailureConfig.max_failures); under "
                   "torchrun the runner passes --max-restarts to torchrun")
    return p


def model() -> nn.Module:
    """The same initial weights in every variant and on every rank. With ``PEERS_STATE_PAD_MB`` set (the runner
    sets it for the save-survives-a-kill column only) the model carries a zero buffer of that many MiB, so that
    a save lasts long enough for a kill to land inside it, in every variant alike."""
    torch.manual_seed(0)
    net = _net()
    pad_mib = float(os.environ.get("PEERS_STATE_PAD_MB", "0") or 0)
    if pad_mib > 0:
        net.register_buffer("pad", torch.zeros(int(pad_mib * 2**20) // 4))
    return net


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES))


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(IMAGES, 3, SIZE, SIZE, generator=g)
    y = torch.randint(0, CLASSES, (IMAGES,), generator=g)
    return TensorDataset(x, y)


def params_digest(module: nn.Module) -> str:
    """SHA-256 over every parameter and buffer (names and bytes), ``module.``/``_orig_mod.`` prefixes dropped,
    so the digest is the same whichever wrapper holds the model."""
    h = hashlib.sha256()
    for name, t in sorted(_plain_state(module).items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _plain_state(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in module.state_dict().items():
        for prefix in ("module.", "_orig_mod.", "_forward_module."):
            while name.startswith(prefix):
                name = name[len(prefix):]
        out[name] = t
    return out


def final_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _plain_state(module).items()}


def all_finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def bn_means(module: nn.Module) -> list[float]:
    bn = next(m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return [float(v) for v in bn.running_mean]


class Events:
    """Append-only JSON lines for this rank; every line is flushed (a SIGKILL loses nothing written)."""

    def __init__(self, workdir: str, rank: int) -> None:
        self.rank = rank
        self._fh = open(os.path.join(workdir, f"events-rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def __call__(self, event: str, **fields: Any) -> None:
        self._fh.write(json.dumps({"event": event, "rank": self.rank, "pid": os.getpid(), "t": time.time(),
                                   **fields}) + "\n")
        self._fh.flush()


def once(workdir: str, name: str) -> bool:
    """True the first time ``name`` is asked for in this workdir (across restarts), False after."""
    try:
        fd = os.open(os.path.join(workdir, f"fault-{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def before_step(args: argparse.Namespace, rank: int, step: int, x: torch.Tensor, events: Events) -> torch.Tensor:
    """Faults that fire before step ``step`` (1-based) on rank 1; returns the batch to use."""
    if rank != 1:
        return x
    if args.kill_at == step and once(args.workdir, "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if args.stuck_at == step and once(args.workdir, "stuck"):
        events("stuck", step=step)
        time.sleep(3600)
    if args.nan_at == step and once(args.workdir, "nan"):
        return x * float("nan")
    return x


class SaveKiller:
    """``--kill-in-save``: on rank 0, one save of this attempt (the third, so older good ones exist) is cut by
    SIGKILL at a random moment within the median length of this attempt's earlier saves. A thread timer, so
    the kill lands wherever the save is (serialising, writing, renaming, uploading)."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.armed = bool(args.kill_in_save) and rank == 0 and _attempt_kills(args) < args.kill_saves
        self.args = args
        self.durations: list[float] = []
        self._rng = random.Random(os.getpid())
        self._timer: threading.Timer | None = None

    def begin(self) -> None:
        if self.armed and len(self.durations) >= 2:
            self.armed = False
            once(self.args.workdir, f"save-kill-{_attempt_kills(self.args)}")
            window = sorted(self.durations)[len(self.durations) // 2]
            import sys

            sys.setswitchinterval(0.0005)  # the timer thread must get the GIL inside a save of a few ms
            self._timer = threading.Timer(self._rng.uniform(0, window), os.kill, (os.getpid(), signal.SIGKILL))
            self._timer.daemon = True
            self._timer.start()

    def end(self, seconds: float) -> None:
        self.durations.append(seconds)


def _attempt_kills(args: argparse.Namespace) -> int:
    return sum(1 for n in os.listdir(args.workdir) if n.startswith("fault-save-kill-"))


def batches(loader: Any, sampler: Any, start_step: int, steps_per_epoch: int) -> Iterator[tuple[int, Any]]:
    """``(step, batch)`` from ``start_step + 1`` on, epoch by epoch, calling ``sampler.set_epoch``; a resumed
    run skips the batches of the current epoch it already saw (by iterating past them: the plain way)."""
    step = start_step
    epoch, skip = divmod(start_step, steps_per_epoch)
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            step += 1
            yield step, batch
        skip = 0
        epoch += 1


def finish(module: nn.Module, args: argparse.Namespace, rank: int, step: int, events: Events) -> None:
    events("done", step=step, params=params_digest(module), finite=all_finite(module), bn_means=bn_means(module))
    if rank == 0:
        torch.save(final_state(module), os.path.join(args.workdir, "final.pt"))
