"""Shared by every ``benchmarks/bench_*.py``: interleaved repetitions, summaries, and the result record.

Each benchmark runs the robustdist way and the plain way on the same data, interleaving repetitions
(A B A B ...; the order alternates each round so neither side always runs first), and reports the median,
min and max of each and the ratio of medians. ``emit`` prints the table and, when the script was given
``--json PATH`` (``benchmarks/run.py`` does that), writes the record ``run.py`` merges into
``benchmarks/results.json`` and renders into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


def interleave(methods: Mapping[str, Callable[[], Any]], reps: int, *, inner: int = 1,
               before: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each method: ``reps`` rounds, each running every method once (the order rotates
    every round), each timing ``inner`` calls and dividing. ``before`` runs untimed before each timing."""
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            if before is not None:
                before()
            start = time.perf_counter()
            for _ in range(inner):
                methods[name]()
            times[name].append((time.perf_counter() - start) / inner)
    return times


def pin_rank(rank: int) -> None:
    """Pin this rank (and the threads it starts later) to one core of its own, when there are enough cores:
    less scheduler migration, less noise. Both sides of a comparison run in the same pinned processes."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def paired_ratio(times: Mapping[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of numerator/denominator measured in the same round (adjacent in time).

    Pairing cancels what drifts between rounds (other load on a shared machine), so it resolves a small
    overhead far better than the ratio of the two medians; both are reported."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator], strict=True))


def paired_ratio_ci(times: Mapping[str, list[float]], numerator: str, denominator: str, *, level: float = 0.95,
                    resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of :func:`paired_ratio` (rounds resampled with replacement): how far the
    median could move on this machine, so a verdict within it is read as unresolved rather than as a result."""
    import numpy as np

    ratios = np.asarray(times[numerator]) / np.asarray(times[denominator])
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(ratios, size=(resamples, ratios.size), replace=True), axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def parser(description: str, *, reps: int | None = None, inner: int | None = None) -> argparse.ArgumentParser:
    """The common options: ``--json``, and ``--reps``/``--inner`` with these defaults when given."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", default=None, help="write the result record here (benchmarks/run.py passes it)")
    if reps is not None:
        p.add_argument("--reps", type=int, default=reps, help="interleaved rounds")
    if inner is not None:
        p.add_argument("--inner", type=int, default=inner, help="calls timed together in each round")
    return p


def emit(args: argparse.Namespace, bench_id: str, title: str, times: Mapping[str, list[float]],
         metrics: Mapping[str, float], *, unit: str = "s", setup: str = "", notes: list[str] | None = None) -> None:
    """Print the table and the metrics; write the record to ``args.json`` when given.

    ``times``: seconds per method; ``metrics``: the derived numbers the targets are checked against
    (ratios, extra seconds), keyed by the names in ``benchmarks/targets.py``."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    print(f"{bench_id}: {title}" + (f" ({setup})" if setup else ""))
    for name, values in times.items():
        s = summary(values)
        print(f"  {name:40s} median {s['median'] * scale:10.3f} {unit}  min {s['min'] * scale:10.3f}  "
              f"max {s['max'] * scale:10.3f}  (n={s['n']})")
    for key, value in metrics.items():
        print(f"  {key:40s} {value:.4g}")
    for note in notes or []:
        print(f"  note: {note}")
    if args.json:
        record = {"id": bench_id, "title": title, "setup": setup, "unit": unit,
                  "times": {name: summary(values) for name, values in times.items()},
                  "metrics": dict(metrics), "notes": list(notes or [])}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
