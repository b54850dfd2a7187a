"""Pickle dumps+loads of a 128 MiB bf16 tensor: robustdist's patch vs torch's default vs the float32 route,
with ``tensor.clone()`` as the memcpy limit. Interleaved repetitions in one run; medians and ratios.
Run: .venv/bin/python benchmarks/bench_bf16.py [--mib 128] [--reps 7]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np
import torch

from robustdist.bf16 import patch_bf16_pickle, unpatch_bf16_pickle


def _patched(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    patch_bf16_pickle()
    try:
        data = pickle.dumps(t, protocol=5)
        return pickle.loads(data), len(data)
    finally:
        unpatch_bf16_pickle()


def _patched_out_of_band(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What protocol-5 consumers such as Ray do: the data travels beside the pickle, not inside it."""
    patch_bf16_pickle()
    try:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(t, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=buffers), len(data) + sum(b.raw().nbytes for b in buffers)
    finally:
        unpatch_bf16_pickle()


def _default(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    data = pickle.dumps(t, protocol=5)
    return pickle.loads(data), len(data)


def _float32_route(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    data = pickle.dumps(t.float().numpy(), protocol=5)
    return torch.from_numpy(pickle.loads(data)).to(torch.bfloat16), len(data)


def _clone(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t.clone(), t.numel() * t.element_size()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    t = torch.randn(args.mib * 2**20 // 2).to(torch.bfloat16)
    methods = {"robustdist patched": _patched, "patched, out-of-band": _patched_out_of_band,
               "torch default": _default, "float32 route": _float32_route, "clone (memcpy)": _clone}
    times: dict[str, list[float]] = {k: [] for k in methods}
    sizes: dict[str, int] = {}
    for _ in range(args.reps):
        for name, fn in methods.items():
            start = time.perf_counter()
            out, size = fn(t)
            times[name].append(time.perf_counter() - start)
            sizes[name] = size
            assert np.array_equal(out.view(torch.int16).numpy(), t.view(torch.int16).numpy())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"pickle dumps+loads of a {args.mib} MiB bf16 tensor ({t.numel()} elements), {args.reps} interleaved reps")
    for name in methods:
        print(f"  {name:22s} median {med[name] * 1e3:8.1f} ms  min {min(times[name]) * 1e3:8.1f}  "
              f"max {max(times[name]) * 1e3:8.1f}  bytes {sizes[name]} ({sizes[name] / t.numel():.3f}/element)")
    p = med["robustdist patched"]
    print(f"  speed-up vs torch default: {med['torch default'] / p:.2f}x (target >= 2)")
    print(f"  speed-up vs float32 route: {med['float32 route'] / p:.2f}x (target >= 3.5)")
    print(f"  patched / memcpy:          {p / med['clone (memcpy)']:.2f}x (target <= 1.5)")
    print(f"  bytes: {sizes['robustdist patched'] - 2 * t.numel()} over 2 bytes/element (target <= 1024)")


if __name__ == "__main__":
    main()
