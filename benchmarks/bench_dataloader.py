"""P8: iterating a `safe_dataloader` vs the plain `DataLoader` with the same settings, one process.

Same dataset, batch size, shuffle and worker count; whole epochs, interleaved. The safe loader's extras
on this path: the epoch bookkeeping, the worker seeder, and the position-tracking index sampler.
Run: .venv/bin/python benchmarks/bench_dataloader.py [--reps 21]
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import _harness as h
from robustdist.data.dataloader import safe_dataloader


def main() -> None:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=21)
    args = p.parse_args()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(20000, 32), torch.randint(0, 10, (20000,)))
    times: dict[str, list[float]] = {}
    metrics = {}
    for workers in (0, 2):
        kw = {"batch_size": 64, "shuffle": True, "num_workers": workers}
        if workers:
            kw["persistent_workers"] = True
        plain = DataLoader(data, **kw)
        safe = safe_dataloader(DataLoader(data, **kw))

        def epoch(loader):
            def run() -> None:
                for _ in loader:
                    pass
            return run

        epoch(plain)()
        epoch(safe)()
        pair = h.interleave({f"DataLoader, {workers} workers": epoch(plain),
                             f"safe_dataloader, {workers} workers": epoch(safe)}, args.reps)
        times.update(pair)
        safe_name, plain_name = f"safe_dataloader, {workers} workers", f"DataLoader, {workers} workers"
        metrics[f"loader_time_ratio_{workers}_workers"] = h.paired_ratio(pair, safe_name, plain_name)
    metrics["loader_time_ratio"] = max(metrics.values())  # the worse of the two, each a median of paired ratios
    h.emit(args, "P8", "safe_dataloader vs DataLoader iteration, same settings", times, metrics, unit="ms",
           setup=f"20000 samples of 32 floats, batch 64, shuffle, 0 and 2 (persistent) workers; {args.reps} "
                 "interleaved epochs each; loader_time_ratio is the worse of the two")


if __name__ == "__main__":
    main()
