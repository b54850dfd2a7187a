"""P1: the step time of a `harden`ed DDP loop (every default guard on) vs the plain DDP loop, 2 gloo ranks.

Same model weights, same batch, same optimizer on both sides, in the same two processes; blocks of steps
interleaved (A B B A ...). The hardened side runs `harden()`'s model (DDP, SyncBatchNorm for the convnet),
`step_guard` every step (nan_policy "raise", divergence check every 300 steps) and the watchdog's beats.
Run: .venv/bin/python benchmarks/bench_step.py [--reps 300] [--inner 5]
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _harness as h
from robustdist import harden
from robustdist.testing import run_ranks


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _pair(make, x, y, reps: int, inner: int) -> dict[str, list[float]]:
    hardened = harden(make(), None, {"distributed": {"barrier_timeout": 60}})  # the defaults, on the group
    plain = DDP(make())
    opt_h = torch.optim.SGD(hardened.model.parameters(), lr=0.01, momentum=0.9)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    step = [0]

    def hardened_step() -> None:
        loss = nn.functional.cross_entropy(hardened.model(x), y)
        loss.backward()
        if hardened.step_guard(loss, step[0]):
            opt_h.step()
        opt_h.zero_grad()
        step[0] += 1

    def plain_step() -> None:
        loss = nn.functional.cross_entropy(plain(x), y)
        loss.backward()
        opt_p.step()
        opt_p.zero_grad()

    for _ in range(10):
        hardened_step()
        plain_step()
    times = h.interleave({"plain DDP": plain_step, "harden()": hardened_step}, reps, inner=inner)
    hardened.close()
    return times


def _bench(rank: int, reps: int, inner: int) -> dict:
    h.pin_rank(rank)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    out = {"mlp": _pair(mlp, torch.randn(64, 256), torch.randint(0, 10, (64,)), reps, inner)}
    out["convnet"] = _pair(convnet, torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)), reps, inner)
    return out


def main() -> None:
    args = h.parser(__doc__.splitlines()[0], reps=300, inner=5).parse_args()
    result = run_ranks(_bench, 2, args=(args.reps, args.inner), timeout=1800)[0]
    times = {f"{model}: {name}": values for model, pair in result.items() for name, values in pair.items()}
    med = {k: h.summary(v)["median"] for k, v in times.items()}
    metrics = {}
    for model in ("mlp", "convnet"):
        metrics[f"{model}_step_ratio"] = h.paired_ratio(times, f"{model}: harden()", f"{model}: plain DDP")
        low, high = h.paired_ratio_ci(times, f"{model}: harden()", f"{model}: plain DDP")
        metrics[f"{model}_step_ratio_ci95_low"], metrics[f"{model}_step_ratio_ci95_high"] = low, high
        metrics[f"{model}_step_ratio_of_medians"] = med[f"{model}: harden()"] / med[f"{model}: plain DDP"]
    h.emit(args, "P1", "harden()ed DDP step vs plain DDP step", times, metrics, unit="ms",
           setup="2 gloo ranks, 1 thread each, each pinned to its own core; MLP 256-512-512-10 on 64x256, "
                 "convnet (2 conv+BN) on 16x3x32x32; "
                 f"{args.reps} interleaved blocks of {args.inner} steps; rank 0's timings",
           notes=["*_step_ratio is the median over rounds of the two sides' times in the same round (pairing "
                  "cancels drift in the machine's load); *_ratio_of_medians is the plain ratio of the medians; "
                  "*_ci95_low/high bound the paired ratio (bootstrap over rounds).",
                  "The convnet's hardened side uses SyncBatchNorm (sync_batchnorm='auto') and the plain side "
                  "BatchNorm: its ratio includes SyncBN's cost, which P5 isolates."])


if __name__ == "__main__":
    main()
