"""P2: checkpoint save: robustdist (sync and async) vs torch.save + fsync vs torch.distributed.checkpoint.save.

Same ~1 GiB state (fp32 tensors of 64 MiB), same disk, repetitions interleaved in one run (A B C D, then
B C D A, ...). Prints median/min/max seconds and throughput per method, and the ratios the project's targets use.
Run: .venv/bin/python benchmarks/bench_checkpoint.py [--size-mib 1024] [--reps 6] [--dir PATH]
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

import _harness as h
from robustdist.checkpoint import AtomicCheckpointer


def _state(size_mib: int) -> dict[str, torch.Tensor]:
    per = 16 * 1024 * 1024  # 64 MiB of float32
    n = max(1, size_mib // 64)
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per) for i in range(n)}


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def main() -> None:
    parser = h.parser(__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the default disk)")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="rd-bench-ckpt-", dir=args.dir)
    state = _state(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {"robustdist sync": [], "torch.save+fsync": [], "dcp.save": [],
                                     "robustdist async (blocking)": [], "robustdist async (total)": []}
    sync = AtomicCheckpointer(os.path.join(base, "rd-sync"), keep_last=1)
    async_ = AtomicCheckpointer(os.path.join(base, "rd-async"), keep_last=1, async_save=True)
    def robustdist_sync(rep: int) -> None:
        t = time.perf_counter()
        sync.save(rep, state)
        times["robustdist sync"].append(time.perf_counter() - t)

    def torch_save(rep: int) -> None:
        path = os.path.join(base, "plain.pt")
        t = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        times["torch.save+fsync"].append(time.perf_counter() - t)
        os.remove(path)

    def dcp_save(rep: int) -> None:
        path = os.path.join(base, "dcp")
        t = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        times["dcp.save"].append(time.perf_counter() - t)
        shutil.rmtree(path)

    def robustdist_async(rep: int) -> None:
        t = time.perf_counter()
        info = async_.save(rep, state)
        times["robustdist async (blocking)"].append(time.perf_counter() - t)
        async_.wait()
        times["robustdist async (total)"].append(time.perf_counter() - t)
        assert info.done.is_set()

    methods = [robustdist_sync, torch_save, dcp_save, robustdist_async]
    try:
        for rep in range(args.reps):  # interleaved; the order rotates every repetition
            for method in methods[rep % 4:] + methods[:rep % 4]:
                method(rep)
    finally:
        sync.close()
        async_.close()
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    metrics = {"throughput_vs_torch_save": med["torch.save+fsync"] / med["robustdist sync"],
               "time_vs_dcp": med["robustdist sync"] / med["dcp.save"],
               "async_blocking_fraction": med["robustdist async (blocking)"] / med["robustdist sync"],
               "robustdist_sync_gib_per_s": nbytes / med["robustdist sync"] / 2**30}
    h.emit(args, "P2", "checkpoint save: robustdist vs torch.save+fsync vs dcp.save", times, metrics,
           setup=f"{nbytes / 2**30:.2f} GiB in {len(state)} float32 tensors, one process, {args.reps} interleaved "
                 "repetitions, the default temp dir's disk")

if __name__ == "__main__":
    main()
