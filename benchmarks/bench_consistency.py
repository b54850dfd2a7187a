"""P7: check_consistency vs the plain way (broadcast rank 0's parameters and compare), 2 gloo ranks, ~100M params.

Interleaved A/B repetitions in one run; prints median, min and max per method and the ratio of medians.
Run: .venv/bin/python benchmarks/bench_consistency.py [--params-millions 100] [--reps 5]
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import _harness as h
from robustdist.parallel.consistency import check_consistency
from robustdist.testing.ranks import run_ranks


def _model(millions: float) -> nn.Module:
    width = 4096
    layers = max(1, round(millions * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _plain_check(model: nn.Module) -> bool:
    """What people hand-roll: broadcast rank 0's tensors and compare locally, then agree on the verdict."""
    same = True
    for t in [*model.parameters(), *model.buffers()]:
        ref = t.detach().clone()
        dist.broadcast(ref, src=0)
        same &= torch.equal(ref, t.detach())
    flag = torch.tensor([0.0 if same else 1.0])
    dist.all_reduce(flag)
    return flag.item() == 0


def _bench(rank: int, millions: float, reps: int) -> dict:
    torch.set_num_threads(1)
    model = _model(millions)
    params = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {"robustdist.check_consistency": [], "broadcast+compare": []}
    for _ in range(reps):
        for name, fn in (("robustdist.check_consistency", lambda: check_consistency(model)),
                         ("broadcast+compare", lambda: _plain_check(model))):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {"params": params, "times": times}


def main() -> None:
    parser = h.parser(__doc__.splitlines()[0], reps=5)
    parser.add_argument("--params-millions", type=float, default=100)
    args = parser.parse_args()
    result = run_ranks(_bench, 2, args=(args.params_millions, args.reps), timeout=1800)[0]
    med = {name: statistics.median(values) for name, values in result["times"].items()}
    h.emit(args, "P7", "check_consistency per call vs broadcast-and-compare", result["times"],
           {"seconds_per_call": med["robustdist.check_consistency"],
            "ratio_vs_broadcast_compare": med["robustdist.check_consistency"] / med["broadcast+compare"]},
           setup=f"2 gloo ranks, 1 thread each, {result['params'] / 1e6:.1f}M float32 parameters, {args.reps} "
                 "interleaved repetitions")

if __name__ == "__main__":
    main()
