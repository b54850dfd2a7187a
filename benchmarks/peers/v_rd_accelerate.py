"""The peer job with robustdist inside Accelerate: ``accelerator.prepare`` wraps the model, ``harden`` composes.

The composition docs/porting.md "(d) Accelerate" documents: ``robustdist.safe_init_process_group()`` before
``Accelerator(cpu=True)`` (which uses that group, so a torchrun restart can rendezvous again),
``accelerator.prepare(model, optimizer)`` (Accelerate's DDP), then ``harden(model, loader, cfg,
optimizer=optimizer)`` with the plain ``DataLoader(shuffle=True)``, not prepared: harden keeps Accelerate's DDP,
shards the loader itself and checkpoints its position with ``h.save`` (``robustdist.frameworks.accelerate.
save_state`` is the other way, with Accelerate's own files). ``accelerator.backward(loss)``; the rest is
``v_robustdist.py``'s loop, with the same config.

``--sync-bn``: as for Accelerate, ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` before ``prepare`` (Accelerate
owns the wrapping); on CPU DDP rejects it: recorded, not worked around.

Run: ``torchrun --standalone --nproc_per_node=2 [--max-restarts=R] v_rd_accelerate.py --workdir DIR [flags]``.
"""

from __future__ import annotations

import sys
from typing import Any

import _common as C
import v_robustdist
from accelerate import Accelerator
from torch import nn

import robustdist

OPTIONS = {  # literals: the runner reads them from the source
    "timeout": "health.hang_timeout=T (the watchdog; default 600 s); distributed.timeout left at its default",
    "save": "h.save(step, optimizer=...) with checkpoint.every_n_steps; synchronous (async_save off by default)",
    "resume": "h.resume(optimizer=...): model, optimizer, RNG and loader position",
    "nan": "h.step_guard(loss, step) with the default health.nan_policy='raise'",
    "stuck": "the default watchdog (health.hang_timeout 600 s, hang_action 'dump': report, keep waiting)",
    "launch": "safe_init_process_group(), then Accelerator(cpu=True)",
    "wrap": "accelerator.prepare(model, optimizer): Accelerate's DDP, kept by harden",
    "data": "the plain DataLoader(shuffle=True) given to harden (not prepared), which shards it and checkpoints "
            "its position",
    "sync_bn": "Accelerate's route: torch.nn.SyncBatchNorm.convert_sync_batchnorm before prepare() (robustdist's "
               "CPU SyncBatchNorm applies only where harden wraps the model)",
}
STUCK_DEFAULT_SECONDS = 600.0  # health.hang_timeout's default, as in v_robustdist.py


def setup(sync_bn: bool) -> tuple[Any, Any, Any]:
    robustdist.safe_init_process_group()
    accelerator = Accelerator(cpu=True)
    net: nn.Module = C.model()
    if sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model, opt = accelerator.prepare(net, C.optimizer(net.parameters()))
    return model, opt, accelerator.backward


if __name__ == "__main__":
    raise SystemExit(v_robustdist.main(__doc__, lambda: setup("--sync-bn" in sys.argv)))
