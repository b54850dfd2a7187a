"""P10: faults that kill no process: in-process recovery vs torchrun's restart, on the P9 job.

The job and the two nodes are P9's (``bench_recovery.py``, ``_recovery_job.py``): DDP over gloo, a 2.1M-parameter MLP
with Adam, ~50 ms steps (a fixed 20 ms of it a sleep standing in for accelerator time), two lab nodes (network
namespaces, one torchrun agent and one rank each; two agents on this host where the lab cannot run, and the record
says so). Both variants keep durable and in-memory checkpoints (P9's ``memory``); they differ in what a fault costs:

* ``restart``: the fault's exception ends the process (``with harden(...)`` records it) and torchrun restarts every
  worker: respawn, ``import torch``, rendezvous, restore from the in-memory tier, replay.
* ``inprocess``: ``recovery.in_process: true`` and ``h.run``: every rank tears the generation down and runs the loop
  again in the same process, from the in-memory tier.

The faults: a rank raises at its next step (SIGUSR1, after the forward, before the backward, so its peer waits in
DDP's all-reduce), alternately rank 1 and rank 0, ``INTERVALS`` apart (P9's failure schedule, 21 to 28 s) from the
first step on, the same schedule for both variants, until the job ends. Two more kinds of fault that kill no
process run on the same schedule (``--kinds``), with ``health.hang_timeout`` ``--hang-timeout`` (3 s) and
``hang_action: abort`` in both variants: ``stop``, the rank SIGSTOPped and continued ``--heal-seconds`` (5 s) later (a
hang that ends); ``partition``, the rank's node cut off from the other (its switch port leaves the bridge) and linked
again ``--heal-seconds`` later (lab only). For those the fault's time is when the benchmark sent it; the restart
variant restarts once the watchdog's verdict ends a process, the in-process one recovers once every rank can.

Per fault: fault -> first new step (a step beyond the last one done before the fault, on every rank), split into
fault -> the loop running again (respawn, init and restore; for ``inprocess`` teardown, rebuild and restore) and
replay. Goodput = steps x the baseline step time (P9's plain job, no checkpoint, no fault, right before each
variant) / wall time from the first step to the last. Then, without faults, the step time of ``inprocess`` over
``restart`` (the recovery machinery costs nothing per step): both jobs run fault-free, alternately, ``--pairs``
times, and the ratio of their mean step times is taken per pair (median reported).

Run: .venv/bin/python benchmarks/bench_inprocess.py [--ideal-seconds 62] [--host] [--keep];
``make bench BENCH=bench_inprocess`` (about 15 minutes here with the three kinds).
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import bench_recovery as p9
from robustdist.testing import nodelab

VARIANTS = ("restart", "inprocess")
KINDS = ("exception", "stop", "partition")
PHASES = ("detect", "decide", "teardown", "rebuild", "restore")  # of an in-process recovery (robustdist.recovery)
JOB_VARIANT = {"restart": "memory", "inprocess": "inprocess"}
INTERVALS = p9.INTERVALS
"""Seconds from one fault to the next (the first counted from the first step): P9's schedule, for both variants."""


def fault_run(nodes: p9.Nodes, work: Path, variant: str, a: Any, *, faults: bool, tag: str,
              kind: str = "exception") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Run ``variant`` (``faults``: under the schedule, faults of ``kind``); returns its events, and the faults the
    benchmark injected itself (``stop``, ``partition``: time and rank; None for ``exception``, which the job logs)."""
    ev, ckpt = work / f"{tag}-events", work / f"{tag}-ckpt"
    ckpt.mkdir(parents=True)
    args = p9.job_args(JOB_VARIANT[variant], ev, ckpt, a, a.steps if faults else a.quiet_steps, a.every)
    if faults and kind != "exception":
        args += ["--hang-timeout", str(a.hang_timeout)]
    agents = [nodes.agent(i, args, rdzv_id=f"p10-{tag}", name=f"{tag}-n{i}", sub=tag) for i in range(2)]
    p9.wait_until(lambda: p9._tail_has(ev, "rank0-*.jsonl", '"event": "step"'), 120, f"{tag}'s first step", agents)
    first = min(t for p in p9.processes(p9.read_events(ev)).values() for t, _ in p.steps)
    due, sent = first + INTERVALS[0], 0
    injected: list[dict[str, Any]] = []
    heal: list[tuple[float, Any]] = []  # (when, what ends the fault)
    deadline = time.monotonic() + a.variant_timeout
    try:
        while any(agent.poll() is None for agent in agents):
            if time.monotonic() > deadline:
                raise RuntimeError(f"P10: {tag} did not finish within {a.variant_timeout:g} s")
            if any(agent.poll() not in (None, 0) for agent in agents):
                raise RuntimeError(f"P10: {tag}: an agent failed (exit {[x.poll() for x in agents]}); see the logs")
            for item in [h for h in heal if h[0] <= time.time()]:
                heal.remove(item)
                item[1]()
            if faults and not heal and time.time() >= due and not p9._tail_has(ev, "rank*.jsonl", '"event": "done"'):
                rank = 1 if sent % 2 == 0 else 0
                pid = p9.live_pid(ev, rank)
                if pid is not None:  # between two processes (a restart): the fault waits for the new one
                    heal += inject(nodes, kind, rank, pid, a.heal_seconds)
                    injected.append({"t": time.time(), "rank": rank})
                    sent += 1
                    due += INTERVALS[sent % len(INTERVALS)]
            time.sleep(0.05)
    finally:
        for _, end in heal:  # never leave a process stopped or a node cut off
            end()
    p9.finish(agents, 10, tag)
    return p9.read_events(ev), (injected if kind != "exception" else None)


def inject(nodes: p9.Nodes, kind: str, rank: int, pid: int, heal_s: float) -> list[tuple[float, Any]]:
    """Inject one fault of ``kind`` into ``rank`` (process ``pid``, the only rank on node ``rank``); returns what
    ends it, and when."""
    if kind == "exception":
        os.kill(pid, signal.SIGUSR1)
        return []
    if kind == "stop":
        os.kill(pid, signal.SIGSTOP)

        def cont() -> None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # ended while stopped (the launcher's SIGKILL)
                pass
        return [(time.time() + heal_s, cont)]
    assert kind == "partition" and nodes.lab is not None
    nodes.lab.link_down(rank)
    return [(time.time() + heal_s, lambda: nodes.lab.link_up(rank))]


def per_fault(events: list[dict[str, Any]], injected: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per fault: steps lost, fault -> first new step = to the loop running again + replay, and the peer's detection
    (fault -> its error reaching the script). ``injected``: the faults' times and ranks, where the job did not log
    them (SIGSTOP, partitions). Only what happened before the next fault counts for a fault. The first new step
    is a step beyond the last one any rank had done before the fault, on every rank, taken after the loop ran
    again (a step that completed as a stop or a cut began is not its recovery); a fault after which no loop ran
    again (a cut that began inside a save and was waited out) is "ridden out": its recovery is the stall, with no
    loop and replay parts."""
    procs = p9.processes(events)
    faults = injected if injected is not None else [e for e in events if e["event"] == "fault"]
    failed = [e for e in events if e["event"] == "failed"]
    resumed = [e for e in events if e["event"] == "resumed"]
    out = []
    for i, f in enumerate(faults):
        nxt = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
        before = max((s for p in procs.values() for t, s in p.steps if t <= f["t"]), default=0)
        again: dict[int, dict[str, Any]] = {}
        for e in resumed:
            if f["t"] < e["t1"] < nxt and e["rank"] not in again:
                again[e["rank"]] = e
        recovered = set(again) == {0, 1}
        back = max(e["t1"] for e in again.values()) if recovered else f["t"]
        new: dict[int, float] = {}
        for p in procs.values():
            for t, s in p.steps:
                if t > back and s > before and (p.rank not in new or t < new[p.rank]):
                    new[p.rank] = t
        if set(new) != {0, 1}:
            continue  # the job ended before any new step
        first = max(new.values())
        peer = [e["t"] - f["t"] for e in failed if e["rank"] != f["rank"] and f["t"] <= e["t"] <= first]
        nan = float("nan")
        phases = {k: max(e.get("phases", {}).get(f"{k}_s", nan) for e in again.values()) if recovered else nan
                  for k in PHASES}  # the slowest rank's (the job waits for it); the rank's own detection is 0
        seen = [e.get("phases", {}).get("detect_s") for e in again.values() if e["rank"] != f["rank"]]
        phases["detect"] = max((d for d in seen if d is not None), default=nan) if recovered else nan
        out.append({**phases, "from_process": recovered and all(e.get("phases", {}).get("from_process")
                                                                for e in again.values()),
                    "rank": f["rank"], "t": f["t"],
                    "lost": before - min(e["step"] for e in again.values()) if recovered else 0,
                    "recovery": first - f["t"], "to_loop": back - f["t"] if recovered else nan,
                    "replay": first - back if recovered else nan, "error_seen": min(peer) if peer else nan,
                    "overlapped": nxt < first, "ridden_out": not recovered,
                    "sources": sorted(str(e["source"]) for e in again.values()) if recovered else ["ridden out"]})
    return out


def step_mean(events: list[dict[str, Any]]) -> float:
    """Rank 0's mean step interval, over its processes, past each one's warm-up."""
    gaps = [g for p in p9.processes(events).values() if p.rank == 0 for g in p9.intervals(p)]
    return statistics.mean(gaps)


def main() -> None:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--ideal-seconds", type=float, default=62.0, help="the job's length in seconds of training (P9's)")
    p.add_argument("--durable-seconds", type=float, default=12.5, help="durable checkpoint spacing, as in P9")
    p.add_argument("--local-every", type=int, default=10, help="in-memory cadence, steps")
    p.add_argument("--sleep", type=float, default=0.02, help="seconds of 'accelerator time' per step")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--baseline-steps", type=int, default=130)
    p.add_argument("--quiet-steps", type=int, default=200, help="steps of each fault-free run")
    p.add_argument("--pairs", type=int, default=3, help="fault-free restart/inprocess pairs")
    p.add_argument("--variant-timeout", type=float, default=300)
    p.add_argument("--host", action="store_true", help="two agents on this host even where the lab can run")
    p.add_argument("--kinds", default=",".join(KINDS), help="the kinds of fault, each on the schedule: "
                   "exception (always), stop (SIGSTOP, SIGCONT later), partition (a node's link down, up later)")
    p.add_argument("--hang-timeout", type=float, default=3.0, help="health.hang_timeout for stop and partition")
    p.add_argument("--heal-seconds", type=float, default=5.0, help="how long a stop or a partition lasts")
    p.add_argument("--keep", action="store_true", help="keep the work directory (events, logs)")
    a = p.parse_args()
    a.steps = a.every = None
    why = nodelab.unavailable()
    use_lab = why is None and not a.host
    kinds = [k for k in a.kinds.split(",") if k]
    if set(kinds) - set(KINDS) or "exception" not in kinds:
        raise SystemExit(f"--kinds {a.kinds!r}: expected a comma-separated subset of {','.join(KINDS)} with exception")
    if not use_lab and "partition" in kinds:
        kinds.remove("partition")  # a partition needs the lab's links; said in the record's setup
    work = Path(tempfile.mkdtemp(prefix="rd-bench-inprocess-"))
    started, load0 = time.time(), os.getloadavg()[0]
    ideal: dict[str, list[float]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    walls: dict[str, float] = {}
    ratios: list[float] = []
    try:
        nodes = p9.Nodes(work, use_lab)
        try:
            for kind in kinds:
                for variant in VARIANTS:
                    key = variant if kind == "exception" else f"{variant}_{kind}"  # the run's name in the record
                    ideal[key] = p9.baseline_run(nodes, work, a, key)
                    step = statistics.mean(ideal[key])
                    if a.steps is None:
                        a.steps = round(a.ideal_seconds / step)
                        a.every = a.local_every * max(1, round(a.durable_seconds / step / a.local_every))
                    events, injected = fault_run(nodes, work, variant, a, faults=True, tag=key, kind=kind)
                    rank0 = sorted(t for pr in p9.processes(events).values() if pr.rank == 0 for t, _ in pr.steps)
                    walls[key] = rank0[-1] - rank0[0] + step
                    runs[key] = per_fault(events, injected)
                    print(f"  {key}: goodput {a.steps * step / walls[key]:.3f}, faults {runs[key]}", flush=True)
            for i in range(a.pairs):
                order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
                means = {v: step_mean(fault_run(nodes, work, v, a, faults=False, tag=f"quiet-{v}-{i}")[0])
                         for v in order}
                ratios.append(means["inprocess"] / means["restart"])
        finally:
            nodes.close()
    except BaseException:
        p9.dump_logs(work)
        raise
    finally:
        p9.tidy(work, a.keep)
    report(a, use_lab, why, ideal, runs, walls, ratios, time.time() - started, (load0, os.getloadavg()[0]))


def report(a: Any, use_lab: bool, why: str | None, ideal: dict[str, list[float]], runs: dict[str, list[dict[str, Any]]],
           walls: dict[str, float], ratios: list[float], seconds: float, load: tuple[float, float]) -> None:
    """Metrics per run: ``<metric>_<variant>`` for exceptions (P10's targets), ``<metric>_<variant>_<kind>`` for
    SIGSTOP hangs and partitions."""
    times: dict[str, list[float]] = {}
    metrics: dict[str, float] = {"lab": float(use_lab)}
    for v, faults in runs.items():
        step = statistics.mean(ideal[v])
        lone = [f for f in faults if not f["overlapped"]]
        label = v.replace("_", ", ")
        times[f"{label}: baseline step right before (no checkpoint, no fault)"] = ideal[v]
        times[f"{label}: fault to first new step"] = [f["recovery"] for f in lone]
        variant, _, kind = v.partition("_")
        suffix = f"{variant}_{kind}" if kind else variant
        metrics[f"goodput_{suffix}"] = a.steps * step / walls[v]
        metrics[f"faults_{suffix}"] = float(len(faults))
        for part in ("recovery", "to_loop", "replay", "error_seen", *PHASES):
            metrics[f"{part}_seconds_{suffix}"] = p9._med([f[part] for f in lone])
        metrics[f"steps_lost_max_{suffix}"] = float(max((f["lost"] for f in faults), default=float("nan")))
    times["no faults: inprocess step / restart step (per pair)"] = ratios
    metrics["step_time_ratio_no_faults"] = statistics.median(ratios)
    if "restart" in runs and "inprocess" in runs:
        metrics["recovery_speedup"] = metrics["recovery_seconds_restart"] / metrics["recovery_seconds_inprocess"]
    kinds = [k for k in KINDS if k != "exception" and any(v.endswith(f"_{k}") for v in runs)]
    where = "2 lab nodes (network namespaces, one torchrun agent and one rank each, a private tmpfs local disk)" \
        if use_lab else f"2 torchrun agents on one host, 1 rank each (NOT the lab: {why or '--host'}; no partitions)"
    setup = (f"{where}; P9's job: DDP/gloo MLP {a.layers}x{a.width} + Adam, {a.steps} steps "
             f"({a.sleep * 1e3:.0f} ms of each a fixed sleep), durable every {a.every} steps, in-memory every "
             f"{a.local_every}; faults (an exception before the backward, rank 1 then rank 0, ...) "
             f"{min(INTERVALS):g} to {max(INTERVALS):g} s apart from the first step on, the same for both variants"
             + (f"; then the same schedule of {' and '.join(kinds)} faults ({a.heal_seconds:g} s each; "
                f"health.hang_timeout {a.hang_timeout:g} s with hang_action abort in both variants)" if kinds else "")
             + f"; no-fault step ratio from {len(ratios)} alternating pairs of {a.quiet_steps}-step runs; "
             f"{seconds:.0f} s in all")
    notes = [f"machine load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
             f"{os.cpu_count()} CPUs"]
    notes += [f"{v.replace('_', ', ')}, per fault (rank, steps lost, fault to first new step = to the loop again + "
              "replay s, the peer's error reaching the script s, sources" + (
                  "; phases, the slowest rank's: detection (the peer's watch), decisions, teardown, rebuild, restore "
                  "s, own state from process memory" if v.startswith("inprocess") else "") + "): " + "; ".join(
                  f"{f['rank']} {f['lost']} {f['recovery']:.2f} = {f['to_loop']:.2f} + {f['replay']:.2f} "
                  f"{f['error_seen']:.2f} {'/'.join(f['sources'])}{' (overlapped)' if f['overlapped'] else ''}"
                  + (f"; {f['detect']:.3f} {f['decide']:.3f} {f['teardown']:.3f} {f['rebuild']:.3f} "
                     f"{f['restore']:.3f} {'yes' if f['from_process'] else 'no'}"
                     if v.startswith("inprocess") and not f["ridden_out"] else "")
                  for f in faults) for v, faults in runs.items()]
    metrics = {k: v for k, v in metrics.items() if v == v}  # NaN: not measured
    h.emit(a, "P10", "faults that kill no process: in-process recovery vs torchrun's restart", times, metrics,
           setup=setup, notes=notes)


if __name__ == "__main__":
    main()
