"""`make bench-peers`: every peer variant through every column, in one run, then ``results.json`` and the
"Side by side with the peers" section of ``benchmarks/RESULTS.md``.

Order: the timed columns (step, save) first, variant by variant, one launch at a time; then every other launch
in lanes, a few at a time (see :func:`measure`): those columns measure outcomes, not speed.

Naming variants (``run.py plain robustdist``) re-runs only those and keeps the others' records in
``results.json`` (each record carries its date; the table says when a row comes from another run).
``--smoke`` runs the step and save columns only, tiny (:data:`_columns.SMOKE`), and touches neither
``results.json`` nor ``RESULTS.md`` unless ``--out`` names a file.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import _columns as col
from _launch import DRIVERS, PEERS, VARIANTS, ray_cluster, script

BENCH = PEERS.parent
RESULTS = PEERS / "results.json"
COLUMNS = ("step", "resume", "save_kill", "stuck", "nan", "sync_bn")  # "step" also measures "save"
DRIVER_LANES = 2  # Ray Train launches at once (on one Ray head with 2 CPUs per lane)
TORCHRUN_LANES = 3  # torchrun launches at once


def variant_constants(variant: str) -> tuple[dict[str, str], float | None]:
    """``OPTIONS`` and ``STUCK_DEFAULT_SECONDS`` from the variant's source, read, not imported (importing would
    import its framework): module-level literals, f-strings over earlier module-level literals included."""
    known: dict[str, Any] = {}
    for node in ast.parse(script(variant).read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and value is not None:
            try:
                known[target.id] = _literal(value, known)
            except ValueError:
                continue
    options = known.get("OPTIONS")
    default = known.get("STUCK_DEFAULT_SECONDS")
    return ({str(k): str(v) for k, v in options.items()} if isinstance(options, dict) else {},
            float(default) if isinstance(default, (int, float)) else None)


def _literal(node: ast.expr, known: dict[str, Any]) -> Any:
    """A literal, a name bound to one earlier, a dict of them, an f-string or a ``+`` of them; else ValueError."""
    if isinstance(node, ast.Name) and node.id in known:
        return known[node.id]
    if isinstance(node, ast.JoinedStr):
        return "".join(str(_literal(v.value if isinstance(v, ast.FormattedValue) else v, known))
                       for v in node.values)
    if isinstance(node, ast.Dict):
        return {_literal(k, known): _literal(v, known) for k, v in zip(node.keys, node.values) if k is not None}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal(node.left, known) + _literal(node.right, known)
    return ast.literal_eval(node)


def measure(variants: list[str], root: Path, size: col.Size, columns: tuple[str, ...] = COLUMNS,
            log: Any = print) -> dict[str, dict[str, Any]]:
    """Run ``columns`` for ``variants`` under ``root``; returns the per-variant records.

    The timed columns (step, save) run first, one launch at a time. The others measure outcomes, not speed
    (a bitwise comparison, a count of intact checkpoints, a timeout's seconds), so they run in lanes: up to
    :data:`DRIVER_LANES` Ray Train launches and :data:`TORCHRUN_LANES` torchrun launches at once. Every Ray Train
    launch connects to one local Ray head started for the run (:func:`_launch.ray_cluster`), once the torchrun
    variants' timed launches are done (so that no Ray runs beside them). Each record's
    ``launches`` lists its launches' seconds (and, for the lanes, when each began, from the first launch)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    records: dict[str, dict[str, Any]] = {}
    present = []
    for v in variants:
        if not script(v).exists():
            records[v] = {"available": False, "missing": f"{script(v).name} does not exist", "date": now}
            continue
        options, default = variant_constants(v)
        records[v] = {"available": True, "date": now, "options": options, "stuck_default_s": default}
        present.append(v)
    references: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        head: list[Any] = []

        def ensure_head() -> None:  # the Ray Train launches share one head, started when the first one needs it
            if not head:
                head.append(stack.enter_context(ray_cluster(cpus=2 * DRIVER_LANES)))

        _columns_of(present, root, size, columns, records, references, log, ensure_head)
    return records


def _columns_of(present: list[str], root: Path, size: col.Size, columns: tuple[str, ...],
                records: dict[str, dict[str, Any]], references: dict[str, Any], log: Any,
                ensure_head: Callable[[], None]) -> None:
    t_run = time.monotonic()
    if "step" in columns:  # the torchrun variants first: no Ray runs beside their timed launches
        for v in sorted(present, key=lambda v: v in DRIVERS):
            if v in DRIVERS:
                ensure_head()
            log(f"== {v}: step and save")
            (records[v]["step"], records[v]["save"], references[v]), seconds = _timed(
                partial(col.baseline, v, root / v / "baseline", size))
            records[v]["launches"] = [{"label": "step and save", "seconds": round(seconds, 1)}]
            log(f"   {v}: step and save done ({seconds:.0f} s)")
    jobs = _jobs(present, root, size, columns, references, records)
    if any(v in DRIVERS for v, *_ in jobs):
        ensure_head()
    if jobs:
        log(f"== {len(jobs)} launches for the other columns, in lanes")
        drivers = ThreadPoolExecutor(DRIVER_LANES, thread_name_prefix="peers-ray")
        others = ThreadPoolExecutor(TORCHRUN_LANES, thread_name_prefix="peers-torchrun")
        with drivers, others:
            futures = [((drivers if v in DRIVERS else others).submit(_timed, fn, t_run), v, key, label)
                       for v, key, label, fn in jobs]
            points: dict[str, list[dict[str, Any]]] = {}
            try:
                for future, v, key, label in futures:
                    value, seconds, began = future.result()
                    records[v].setdefault("launches", []).append(
                        {"label": label, "seconds": round(seconds, 1), "began_s": round(began, 1)})
                    log(f"   {v}: {label} done ({seconds:.0f} s)")
                    if key == "resume":
                        points.setdefault(v, []).append(value)
                    else:
                        records[v][key] = value
            except BaseException:  # Ctrl-C or a failed launch: do not start the queued ones
                for pool in (drivers, others):
                    pool.shutdown(wait=False, cancel_futures=True)
                raise
        for v, pts in points.items():
            records[v]["resume"] = col.resume_exact(pts, size, references[v])


def _timed(fn: Callable[[], Any], t_run: float | None = None) -> Any:
    """``(fn(), seconds)``; with ``t_run``, ``(fn(), seconds, began)``, ``began`` counted from ``t_run``."""
    t0 = time.monotonic()
    value = fn()
    seconds = time.monotonic() - t0
    return (value, seconds) if t_run is None else (value, seconds, t0 - t_run)


def _jobs(present: list[str], root: Path, size: col.Size, columns: tuple[str, ...], references: dict[str, Any],
          records: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, Callable[[], Any]]]:
    """``(variant, record key, label, thunk)`` for every launch after the timed columns, longest first: by column
    (a kill in a save restarts most, then resume exact, the stuck rank, NaN and SyncBN), variants interleaved."""
    jobs: list[tuple[str, str, str, Callable[[], Any]]] = []
    for v in present:
        default = records[v]["stuck_default_s"]
        if "stuck" in columns:
            jobs.append((v, "stuck_default", "stuck rank, defaults",
                         partial(col.stuck, v, root / v / "stuck-default", size, None, default)))
            jobs.append((v, "stuck_timeout", "stuck rank, timeout option",
                         partial(col.stuck, v, root / v / "stuck-timeout", size, size.timeout, default)))
        if "save_kill" in columns:
            jobs.append((v, "save_kill", "save survives a kill",
                         partial(col.save_kill, v, root / v / "save-kill", size)))
        if "resume" in columns and v in references:
            jobs += [(v, "resume", f"resume exact, kill at {k}",
                      partial(col.resume_point, v, root / v / "resume", size, k, references[v].final))
                     for k in size.kill_points]
        if "nan" in columns:
            jobs.append((v, "nan", "NaN", partial(col.nan, v, root / v / "nan", size)))
        if "sync_bn" in columns:
            jobs.append((v, "sync_bn", "CPU SyncBN", partial(col.sync_bn, v, root / v / "sync-bn", size)))
    order = ("save_kill", "resume", "stuck_timeout", "stuck_default", "nan", "sync_bn")
    return sorted(jobs, key=lambda job: order.index(job[1]))  # stable: variants keep their order within a column


def machine() -> dict[str, str]:
    import platform
    from importlib import metadata

    info = {"python": platform.python_version(), "cpus": str(os.cpu_count())}
    for dist in ("torch", "accelerate", "lightning", "ray", "robustdist"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "not installed"
    return info


def write_page(peers: dict[str, Any]) -> Path:
    """Re-render ``benchmarks/RESULTS.md`` from ``benchmarks/results.json`` and ``peers`` (benchmarks/run.py
    renders the same page from the same two files, so neither run clobbers the other's section)."""
    bench_run = _bench_run()
    bench = BENCH / "results.json"
    results = json.loads(bench.read_text()) if bench.exists() else {
        "date": "-", "command": "-", "machine": {}, "benchmarks": {}}
    page = bench_run.render(results, peers=peers)
    return bench_run.write_atomically(BENCH / "RESULTS.md", page)


def _bench_run() -> Any:
    """``benchmarks/run.py``, loaded by path under a name of its own (this directory has a ``run.py`` too)."""
    spec = importlib.util.spec_from_file_location("robustdist_bench_run", BENCH / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="make bench-peers: the peer table")
    p.add_argument("variants", nargs="*", help=f"a subset of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny: the step and save columns only")
    p.add_argument("--shared-store", action="store_true", help="run the restart columns (resume exact, save "
                   "survives a kill) under torchrun's default shared store instead of "
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch 2.13: restarts then often fail or hang at init)")
    p.add_argument("--out", type=Path, default=None, help="results file (default: benchmarks/peers/results.json; "
                   "with --smoke, none unless given)")
    p.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a fresh temporary "
                   "directory, removed after a run where every launch finished)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        print(f"make bench-peers: unknown variant(s) {unknown}; expected some of {list(VARIANTS)}")
        return 2
    variants = [v for v in VARIANTS if v in args.variants] if args.variants else list(VARIANTS)
    size, columns = (col.SMOKE, ("step",)) if args.smoke else (col.Size(), COLUMNS)
    if args.shared_store:
        size = dataclasses.replace(size, fresh_store=False)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="robustdist-peers-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"make bench-peers: {', '.join(variants)}; runs in {root}", flush=True)
    t0 = time.monotonic()
    records = measure(variants, root, size, columns, log=lambda m: print(m, flush=True))
    wall = time.monotonic() - t0
    out = args.out or (None if args.smoke else RESULTS)
    if out is not None:
        previous = json.loads(out.read_text()) if out.exists() and args.variants else {}
        results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "command": " ".join(["python", "benchmarks/peers/run.py", *map(shlex.quote, argv)]),
                   "wall_seconds": wall, "machine": machine(), "size": size.record(),
                   "variants": {**previous.get("variants", {}), **records}}
        out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out}")
        if out == RESULTS:
            print(f"wrote {write_page(json.loads(out.read_text()))}")
    print(f"make bench-peers: {wall:.0f} s")
    if args.workdir is None and all(_finished(r) for r in records.values()):
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _finished(record: dict[str, Any]) -> bool:
    return record.get("available", False) and bool((record.get("step") or {}).get("ok"))
