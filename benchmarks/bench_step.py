"""P1: the step time of a `harden`ed DDP loop (every default guard on) vs the plain DDP loop, 2 gloo ranks.

Two step sizes. "small" is an MLP step of about 5 ms, where the hardened step's fixed cost shows: reported as
microseconds added per step. "typical" is a small transformer step of about 50 ms, a more usual size, which
the ratio target is about. Each runs three sides in the same two processes, on the same weights, batch and
optimizer: plain DDP; `harden()` with the defaults (`step_guard` reads DDP's all-reduced gradients); and
`harden()` with `health.check_gradients: false` (the ranks agree on their losses by one all-reduce per step).
The hardened sides run `harden()`'s model (DDP), `step_guard` every step (nan_policy "raise", divergence
check every 300 steps) and the watchdog's beats. Blocks of steps are interleaved (the order rotates every
round). The convnet (BatchNorm, so SyncBatchNorm when hardened) is reported as before.
Run: .venv/bin/python benchmarks/bench_step.py [--reps 300] [--inner 5] [--typical-reps 200] [--typical-inner 1]
(the convnet runs --reps / 2 rounds).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _harness as h
from robustdist import harden
from robustdist.testing.ranks import run_ranks

PLAIN, HARDENED, LOSS_ONLY = "plain DDP", "harden()", "harden(check_gradients=False)"
TYPICAL = {"d_model": 128, "layers": 4, "ff": 512, "heads": 4, "vocab": 1000, "batch": 4, "seq": 64}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


class Encoder(nn.Module):
    """A small transformer encoder classifier: embedding, ``layers`` pre-norm blocks, mean pool, linear head."""

    def __init__(self, d_model: int, layers: int, ff: int, heads: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


def encoder() -> nn.Module:
    torch.manual_seed(0)
    t = TYPICAL
    return Encoder(t["d_model"], t["layers"], t["ff"], t["heads"], t["vocab"])


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, guard: Callable | None) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = [0]

    def one_step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if guard is None or guard(loss, step[0]):
            opt.step()
        opt.zero_grad()
        step[0] += 1

    return one_step


def _sides(make, x, y, reps: int, inner: int, loss_only: bool) -> dict[str, list[float]]:
    base = {"distributed": {"barrier_timeout": 60}}  # the defaults, on the group run_ranks made
    hardened = [harden(make(), None, base)]
    steps = {PLAIN: _step_fn(DDP(make()), x, y, None)}
    steps[HARDENED] = _step_fn(hardened[0].model, x, y, hardened[0].step_guard)
    if loss_only:
        hardened.append(harden(make(), None, {**base, "health": {"check_gradients": False}}))
        steps[LOSS_ONLY] = _step_fn(hardened[1].model, x, y, hardened[1].step_guard)
    for _ in range(10):
        for one_step in steps.values():
            one_step()
    times = h.interleave(steps, reps, inner=inner)
    for each in hardened:
        each.close()
    return times


def _bench(rank: int, reps: int, inner: int, typical_reps: int, typical_inner: int) -> dict:
    h.pin_rank(rank)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    t = TYPICAL
    return {
        "small": _sides(mlp, torch.randn(64, 256), torch.randint(0, 10, (64,)), reps, inner, True),
        "typical": _sides(encoder, torch.randint(0, t["vocab"], (t["batch"], t["seq"])),
                          torch.randint(0, 10, (t["batch"],)), typical_reps, typical_inner, True),
        "convnet": _sides(convnet, torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)), reps // 2, inner, False),
    }


def _added_us(times: dict[str, list[float]], hardened: str, plain: str) -> float:
    """Median over rounds of the two sides' difference in the same round, in microseconds per step."""
    return statistics.median(a - b for a, b in zip(times[hardened], times[plain], strict=True)) * 1e6


def _metrics(times: dict[str, list[float]]) -> dict[str, float]:
    m: dict[str, float] = {}
    for side, suffix in ((HARDENED, ""), (LOSS_ONLY, "_loss_only")):
        m[f"small_added_us{suffix}"] = _added_us(times, f"small: {side}", f"small: {PLAIN}")
        m[f"small_step_ratio{suffix}"] = h.paired_ratio(times, f"small: {side}", f"small: {PLAIN}")
        m[f"typical_step_ratio{suffix}"] = h.paired_ratio(times, f"typical: {side}", f"typical: {PLAIN}")
        low, high = h.paired_ratio_ci(times, f"typical: {side}", f"typical: {PLAIN}")
        m[f"typical_step_ratio{suffix}_ci_low"], m[f"typical_step_ratio{suffix}_ci_high"] = low, high
    m["typical_added_us"] = _added_us(times, f"typical: {HARDENED}", f"typical: {PLAIN}")
    med = {k: h.summary(v)["median"] for k, v in times.items()}
    m["typical_step_ratio_of_medians"] = med[f"typical: {HARDENED}"] / med[f"typical: {PLAIN}"]
    m["convnet_step_ratio"] = h.paired_ratio(times, f"convnet: {HARDENED}", f"convnet: {PLAIN}")
    m["convnet_step_ratio_ci_low"], m["convnet_step_ratio_ci_high"] = h.paired_ratio_ci(
        times, f"convnet: {HARDENED}", f"convnet: {PLAIN}")
    return m


def main() -> None:
    p = h.parser(__doc__.splitlines()[0], reps=300, inner=5)
    p.add_argument("--typical-reps", type=int, default=200, help="interleaved rounds of the ~50 ms step")
    p.add_argument("--typical-inner", type=int, default=1, help="~50 ms steps timed together in each round")
    args = p.parse_args()
    result = run_ranks(_bench, 2, args=(args.reps, args.inner, args.typical_reps, args.typical_inner),
                       timeout=1800)[0]
    times = {f"{size}: {name}": values for size, sides in result.items() for name, values in sides.items()}
    t = TYPICAL
    h.emit(args, "P1", "harden()ed DDP step vs plain DDP step", times, _metrics(times), unit="ms",
           setup="2 gloo ranks, 1 thread each, each pinned to its own core; small: MLP 256-512-512-10 on 64x256, "
                 f"{args.reps} interleaved rounds of {args.inner} steps; typical: transformer encoder "
                 f"(d_model {t['d_model']}, {t['layers']} layers, ff {t['ff']}, {t['heads']} heads) on "
                 f"{t['batch']}x{t['seq']} tokens, {args.typical_reps} rounds of {args.typical_inner} steps; "
                 f"convnet (2 conv+BN) on 16x3x32x32, {args.reps // 2} rounds of {args.inner}; rank 0's timings",
           notes=["*_step_ratio is the median over rounds of the two sides' times in the same round (pairing "
                  "cancels drift in the machine's load); *_ci_low/high bound it (bootstrap 95% over rounds); "
                  "*_added_us is the median over rounds of the paired difference, per step; *_ratio_of_medians "
                  "is the plain ratio of the medians.",
                  "*_loss_only: harden() with health.check_gradients false: the step guard never reads the "
                  "gradients and the ranks agree on their losses by one all-reduce per step (an overflow with a "
                  "finite loss is then not caught).",
                  "The convnet's hardened side uses SyncBatchNorm (sync_batchnorm='auto') and the plain side "
                  "BatchNorm: its ratio includes SyncBN's cost, which P5 isolates."])


if __name__ == "__main__":
    main()
