"""The peer job with robustdist, the README's way: ``harden(model, loader, cfg)`` as a context manager,
``h.resume(optimizer=...)``, ``h.step_guard(loss, step)`` after ``backward()``, ``h.save(step, optimizer=...)``
every step (it saves when ``checkpoint.every_n_steps`` divides the step).

The config is robustdist's defaults plus what the job needs: ``checkpoint.dir`` (``DIR/ckpt``) and
``checkpoint.every_n_steps`` (``--save-every``). ``--timeout`` sets ``health.hang_timeout`` (the watchdog that
reports a stalled step and names the rank behind); ``--sync-bn`` changes nothing: ``distributed.sync_batchnorm``
is ``auto``, on whenever the world is larger than 1, so every run of this variant has synchronised BatchNorm.
The loader is a plain ``DataLoader(shuffle=True)``: ``harden`` inserts the ``DistributedSampler`` (seed
``data.seed``, 0), advances its epoch and checkpoints its position, so a resume continues mid-epoch by itself.

Run: ``torchrun --standalone --nproc_per_node=2 [--max-restarts=R] v_robustdist.py --workdir DIR [flags]`` (the
flags and events are :mod:`_common`'s contract).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from _common import Events, SaveKiller, before_step, dataset, finish, model, optimizer, params_digest, parser
from torch.utils.data import DataLoader

from robustdist import harden

OPTIONS = {
    "timeout": "health.hang_timeout=T (the watchdog; default 600 s); distributed.timeout left at its default",
    "sync_bn": "none needed: distributed.sync_batchnorm defaults to auto (on when world > 1), so it is on in "
               "every column, the step and save columns included",
    "save": "h.save(step, optimizer=...) with checkpoint.every_n_steps; synchronous (async_save off by default)",
    "resume": "h.resume(optimizer=...): model, optimizer, RNG and loader position",
    "nan": "h.step_guard(loss, step) with the default health.nan_policy='raise'",
    "stuck": "the default watchdog (health.hang_timeout 600 s, hang_action 'dump': report, keep waiting)",
}
# health.hang_timeout's default (robustdist/config/schema.py HealthConfig, docs/configuration.md): the watchdog reports
# a step that has not finished within it; the process-group timeout (distributed.timeout) is 1800 s.
STUCK_DEFAULT_SECONDS = 600.0
Framework = Callable[[], tuple[Any, Any, Callable[[Any], None]]]


def config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {"checkpoint": {"dir": os.path.join(args.workdir, "ckpt"),
                                          "every_n_steps": args.save_every or None}}
    if args.timeout is not None:
        cfg["health"] = {"hang_timeout": args.timeout}
    return cfg


def train(args: argparse.Namespace, rank: int, events: Events, framework: Framework | None = None) -> None:
    """The job. ``framework``: for robustdist inside another framework (``v_rd_*.py``), a setup that returns the
    model and optimizer that framework prepared, and its ``backward``; harden composes with them."""
    loader = DataLoader(dataset(), batch_size=args.batch, shuffle=True)
    net, opt, backward = framework() if framework is not None else (model(), None, None)
    with harden(net, loader, config(args), optimizer=opt) as h:
        opt = opt if opt is not None else optimizer(h.model.parameters())
        verify: dict[str, Any] | None = None
        try:
            resumed = h.resume(optimizer=opt)
        except Exception as e:
            if h.attempt:
                events("start", resumed=0, verify={"ok": False, "step": None, "params": None,
                                                   "error": f"{type(e).__name__}: {e}"})
            raise
        step = resumed or 0
        if h.attempt:
            verify = {"ok": resumed is not None, "step": resumed, "params": params_digest(h.model),
                      "error": None if resumed is not None else "nothing to resume"}
        events("start", resumed=step, **({"verify": verify} if verify is not None else {}))
        killer = SaveKiller(args, rank)
        while step < args.steps:
            t0 = time.perf_counter()
            for x, y in h.loader:
                x = before_step(args, rank, step + 1, x, events)
                loss = F.cross_entropy(h.model(x), y)
                if backward is None:
                    loss.backward()
                else:
                    backward(loss)
                decision = h.step_guard(loss, step)
                if decision:
                    opt.step()
                opt.zero_grad()
                if decision.rolled_back:
                    step = decision.resume_step or 0
                    break
                step += 1
                events("step", step=step, seconds=time.perf_counter() - t0, loss=float(loss.detach()))
                _save(h, step, opt, args, events, killer)
                if step == args.steps:
                    break
                t0 = time.perf_counter()
        finish(h.model, args, rank, step, events)


def _save(h: Any, step: int, opt: Any, args: argparse.Namespace, events: Events, killer: SaveKiller) -> None:
    if not (args.save_every and step % args.save_every == 0):
        h.save(step, optimizer=opt)  # not a saving step: returns at once, as in the README's loop
        return
    events("save_begin", step=step, params=params_digest(h.model))
    killer.begin()
    t = time.perf_counter()
    info = h.save(step, optimizer=opt)
    blocking = time.perf_counter() - t
    killer.end(blocking)
    total = getattr(info, "total_seconds", None)
    events("save", step=step, seconds=blocking if total is None else max(total, blocking), blocking=blocking)


def main(doc: str = __doc__, framework: Framework | None = None) -> int:
    args = parser(doc.splitlines()[0]).parse_args()
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(args.workdir, exist_ok=True)
    events = Events(args.workdir, rank)
    try:
        train(args, rank, events, framework)
    except Exception as e:
        events("error", type=type(e).__name__, message=str(e))
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
