"""P3: pickle dumps+loads of a 128 MiB bf16 tensor: robustdist's patch vs torch's default vs the float32 route,
against the real floors measured in the same run: the pickle round trip of the same bytes as a plain numpy
uint16 array (what any in-band pickle must cost: dumps and loads each copy the bytes into fresh memory), and
one memcpy (``tensor.clone()``) for the out-of-band route (protocol 5 buffers, as Ray uses). Interleaved
repetitions in one run; medians and ratios.
Run: .venv/bin/python benchmarks/bench_bf16.py [--mib 128] [--reps 7]
"""

from __future__ import annotations

import pickle
import statistics
import time

import numpy as np
import torch

import _harness as h
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


def _numpy_uint16(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The floor for an in-band pickle: the same bytes as a plain numpy array (no torch on either side)."""
    raw = t.view(torch.int16).numpy().view(np.uint16)
    data = pickle.dumps(raw, protocol=5)
    return torch.from_numpy(pickle.loads(data).view(np.int16)).view(torch.bfloat16), len(data)


def _clone(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t.clone(), t.numel() * t.element_size()


def main() -> None:
    parser = h.parser(__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    t = torch.randn(args.mib * 2**20 // 2).to(torch.bfloat16)
    methods = {"robustdist patched": _patched, "patched, out-of-band": _patched_out_of_band,
               "torch default": _default, "float32 route": _float32_route, "numpy uint16 (in-band floor)": _numpy_uint16,
               "clone (memcpy)": _clone}
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
    p = med["robustdist patched"]
    metrics = {"speedup_vs_default": med["torch default"] / p, "speedup_vs_float32_route": med["float32 route"] / p,
               "vs_numpy_uint16": p / med["numpy uint16 (in-band floor)"],
               "vs_memcpy": p / med["clone (memcpy)"],
               "out_of_band_vs_memcpy": med["patched, out-of-band"] / med["clone (memcpy)"],
               "bytes_over_2_per_element": sizes["robustdist patched"] - 2 * t.numel()}
    h.emit(args, "P3", "bf16 pickle: robustdist vs torch default vs the float32 route vs memcpy", times, metrics,
           unit="ms", setup=f"pickle.dumps + pickle.loads (protocol 5) of a {args.mib} MiB bf16 tensor "
                            f"({t.numel()} elements), {args.reps} interleaved repetitions, bit-exactness checked")

if __name__ == "__main__":
    main()
