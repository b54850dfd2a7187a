"""The peer job with robustdist inside Lightning Fabric: Fabric sets the model up, ``harden`` composes with it.

The composition docs/porting.md "(f) Lightning Fabric" documents: ``robustdist.safe_init_process_group()`` before
``Fabric(accelerator="cpu", devices=2, strategy="ddp").launch()`` (Fabric uses that group, so a torchrun restart
can rendezvous again), ``fabric.setup(model, optimizer)`` (Fabric's DDP), then ``harden(model, loader, cfg,
optimizer=optimizer)`` with the plain ``DataLoader(shuffle=True)``: harden keeps Fabric's DDP, shards the loader
itself and checkpoints its position. ``fabric.backward(loss)``; the rest is ``v_robustdist.py``'s loop
(``h.resume``, ``h.step_guard``, ``h.save``), with the same config.

``--sync-bn``: as for Fabric, ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` before ``setup`` (Fabric owns the
wrapping, so robustdist's CPU SyncBatchNorm does not apply); on CPU DDP rejects it: recorded, not worked around.

Run: ``torchrun --standalone --nproc_per_node=2 [--max-restarts=R] v_rd_fabric.py --workdir DIR [flags]``.
"""

from __future__ import annotations

import sys
from typing import Any

import _common as C
import v_robustdist
from lightning.fabric import Fabric
from torch import nn

import robustdist

OPTIONS = {  # literals: the runner reads them from the source
    "timeout": "health.hang_timeout=T (the watchdog; default 600 s); distributed.timeout left at its default",
    "save": "h.save(step, optimizer=...) with checkpoint.every_n_steps; synchronous (async_save off by default)",
    "resume": "h.resume(optimizer=...): model, optimizer, RNG and loader position",
    "nan": "h.step_guard(loss, step) with the default health.nan_policy='raise'",
    "stuck": "the default watchdog (health.hang_timeout 600 s, hang_action 'dump': report, keep waiting)",
    "launch": "safe_init_process_group(), then Fabric(accelerator='cpu', devices=2, strategy='ddp').launch()",
    "wrap": "fabric.setup(model, optimizer): Fabric's DDP, kept by harden",
    "data": "the plain DataLoader(shuffle=True) given to harden, which shards it and checkpoints its position",
    "sync_bn": "Fabric's route: torch.nn.SyncBatchNorm.convert_sync_batchnorm before setup() (robustdist's CPU "
               "SyncBatchNorm applies only where harden wraps the model)",
}
STUCK_DEFAULT_SECONDS = 600.0  # health.hang_timeout's default, as in v_robustdist.py


def setup(sync_bn: bool) -> tuple[Any, Any, Any]:
    robustdist.safe_init_process_group()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    net: nn.Module = C.model()
    if sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model, opt = fabric.setup(net, C.optimizer(net.parameters()))
    return model, opt, fabric.backward


if __name__ == "__main__":
    raise SystemExit(v_robustdist.main(__doc__, lambda: setup("--sync-bn" in sys.argv)))
