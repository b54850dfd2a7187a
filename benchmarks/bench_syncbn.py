"""P5: a DDP training step with robustdist's CPU SyncBatchNorm vs with plain BatchNorm, 2 gloo ranks.

The same small convnet, batch and optimizer; the only difference is the BatchNorm layers (torch's
SyncBatchNorm raises on CPU). Blocks of steps interleaved in the same two processes.
Run: .venv/bin/python benchmarks/bench_syncbn.py [--reps 150] [--inner 5]
"""

from __future__ import annotations

import gc

import torch
from torch import nn

import _harness as h
from bench_step import convnet
from robustdist import wrap_ddp
from robustdist.testing.ranks import run_ranks


def _bench(rank: int, reps: int, inner: int) -> dict[str, list[float]]:
    h.pin_rank(rank)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    models = {"BatchNorm (per rank)": wrap_ddp(convnet(), sync_batchnorm=False),
              "robustdist SyncBatchNorm": wrap_ddp(convnet(), sync_batchnorm=True)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}

    def stepper(name):
        def step() -> None:
            loss = nn.functional.cross_entropy(models[name](x), y)
            loss.backward()
            opts[name].step()
            opts[name].zero_grad()
        return step

    steps = {name: stepper(name) for name in models}
    for _ in range(10):
        for step in steps.values():
            step()
    times = h.interleave(steps, reps, inner=inner)
    models.clear()
    gc.collect()
    return times


def main() -> None:
    args = h.parser(__doc__.splitlines()[0], reps=150, inner=5).parse_args()
    times = run_ranks(_bench, 2, args=(args.reps, args.inner), timeout=1800)[0]
    med = {k: h.summary(v)["median"] for k, v in times.items()}
    sides = ("robustdist SyncBatchNorm", "BatchNorm (per rank)")
    low, high = h.paired_ratio_ci(times, *sides)
    h.emit(args, "P5", "DDP step with CPU SyncBatchNorm vs plain BatchNorm", times,
           {"syncbn_step_ratio": h.paired_ratio(times, *sides),
            "syncbn_step_ratio_of_medians": med[sides[0]] / med[sides[1]],
            "syncbn_step_ratio_ci95_low": low, "syncbn_step_ratio_ci95_high": high},
           unit="ms", notes=["syncbn_step_ratio is the median of per-round paired ratios, with a bootstrap 95% "
                             "interval; see P1."],
           setup="2 gloo ranks, 1 thread each, each pinned to its own core; convnet with 2 BatchNorm2d on "
                 f"16x3x32x32; {args.reps} interleaved "
                 f"blocks of {args.inner} steps; rank 0's timings")


if __name__ == "__main__":
    main()
