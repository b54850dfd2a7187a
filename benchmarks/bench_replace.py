"""P11: a killed rank replaced alone (``robustdist run``) vs torchrun's restart of every worker, on the P9 job.

The job and the two nodes are P9's (``bench_recovery.py``, ``_recovery_job.py``): DDP over gloo, a 2.1M-parameter MLP
with Adam, ~50 ms steps, two lab nodes (network namespaces, one agent and one rank each; two agents on this host where
the lab cannot run, and the record says so), durable and in-memory checkpoints. Variants:

* ``restart``: torchrun, P9's ``memory`` job: a SIGKILLed rank makes torchrun restart every worker (respawn,
  ``import torch``, rendezvous, restore from the in-memory tier, replay).
* ``cold``: ``robustdist run --spares 0``, the ``inprocess`` job (``recovery.in_process``, ``h.run``): the dead
  rank's agent starts it again alone, cold (a new Python, ``import torch``, the script from the top); the survivor
  recovers in its own process and takes it in.
* ``spare``: ``robustdist run`` (one warm spare per node): the dead rank's spare forks the worker and stays warm.

The faults: P9's schedule without its replaced node: a rank SIGKILLed at P9's intervals (21 to 28 s apart from the
first step on), rank 1 then rank 0 alternately, the same for every variant, until the job ends. The agents share
torchrun's store with the workers (torchrun's default; P9 turns it off so that a replaced node's new agent can rejoin),
so ``robustdist run``'s agent on node 0 serves each attempt's store and a killed rank 0 is replaced alone too. Per
fault: SIGKILL -> first new step (a step beyond the last done before the kill,
on every rank), split into kill -> the loop running again and replay (``bench_inprocess.per_fault``). Goodput = steps x
the baseline step time (the plain job's, run right before the variant and right after it: the mean of both; their
ratio is reported as the machine's drift over the run) / wall time from the first step to the last, and where the
wall time beyond it went (:func:`breakdown`); also the same against the run's own ordinary step (``goodput_own_step``:
on a host whose speed drifts by several percent between minutes, the steadier of the two). Then, without faults,
the job's start under ``robustdist run`` against torchrun's (the same in-process job, launch -> first step on every
rank), alternating, ``--pairs`` times; the difference is taken per pair (median reported). Then ``--early-runs`` runs
of the spare variant with one kill, of rank 1, :data:`EARLY_S` after the first step (``early_kill_recovery_seconds``);
and from every ``robustdist run`` agent's log, the time from the workers' start to its first spare's "is ready"
(``spare_ready_seconds``).

Run: .venv/bin/python benchmarks/bench_replace.py [--ideal-seconds 62] [--host] [--keep];
``make bench BENCH=bench_replace`` (about 8 minutes here).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import bench_inprocess as p10
import bench_recovery as p9
from robustdist.testing import nodelab

VARIANTS = ("restart", "cold", "spare")
LAUNCHER = {"restart": ("torch.distributed.run",), "cold": ("robustdist", "run", "--spares", "0"),
            "spare": ("robustdist", "run", "--spares", "1")}
JOB_VARIANT = {"restart": "memory", "cold": "inprocess", "spare": "inprocess"}
INTERVALS = p9.INTERVALS
ENV = {k: v for k, v in p9.ENV.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}  # torchrun's store shared


EARLY_S = 2.0  # the early kill: this long after the first step
EARLY_STEPS = 200  # its run: long enough for the kill and the recovery (~50 ms steps)
READY_RE = re.compile(r"the warm spare \(pid \d+\) is ready after [\d.]+ s, ([\d.]+) s after this attempt's "
                      r"workers started \((?:started with the workers|warmed at the workers' priority)")


def spare_ready(work: Path, tags: list[str]) -> list[float]:
    """Each agent's first spare of ``tags``' runs: seconds from the workers' start to the spare's "warm"."""
    out = []
    for tag in tags:
        for log in sorted((work / "logs").glob(f"{tag}-n*.log")):
            if found := READY_RE.search(log.read_text(errors="replace")):
                out.append(float(found.group(1)))
    return out


def target(n: int) -> int:
    """The rank the n-th kill takes: rank 1, rank 0, rank 1, ... (P9's order, without its replaced node)."""
    return 1 if n % 2 == 0 else 0


def kill_run(nodes: p9.Nodes, work: Path, variant: str, a: Any, *, faults: bool, tag: str,
             launcher: tuple[str, ...] | None = None, early: float | None = None
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Run ``variant`` (``faults``: a rank SIGKILLed on the schedule, :func:`target`; ``early``: instead, rank 1 once,
    that many seconds after the first step, in a run of :data:`EARLY_STEPS`); returns its events, the kills, and when
    the agents were started (wall clock)."""
    ev, ckpt = work / f"{tag}-events", work / f"{tag}-ckpt"
    ckpt.mkdir(parents=True)
    steps = EARLY_STEPS if early is not None else a.steps if faults else a.quiet_steps
    args = p9.job_args(JOB_VARIANT[variant], ev, ckpt, a, steps, a.every)
    launched = time.time()
    agents = [nodes.agent(i, args, rdzv_id=f"p11-{tag}", name=f"{tag}-n{i}", sub=tag,
                          launcher=launcher or LAUNCHER[variant], base_env=ENV) for i in range(2)]
    p9.wait_until(lambda: p9._tail_has(ev, "rank0-*.jsonl", '"event": "step"'), 120, f"{tag}'s first step", agents)
    first = min(t for p in p9.processes(p9.read_events(ev)).values() for t, _ in p.steps)
    due, kills = first + (INTERVALS[0] if early is None else early), []
    faults = faults or early is not None
    deadline = time.monotonic() + a.variant_timeout
    while any(agent.poll() is None for agent in agents):
        if time.monotonic() > deadline:
            raise RuntimeError(f"P11: {tag} did not finish within {a.variant_timeout:g} s")
        if any(agent.poll() not in (None, 0) for agent in agents):
            raise RuntimeError(f"P11: {tag}: an agent failed (exit {[x.poll() for x in agents]}); see the logs")
        if faults and time.time() >= due and not p9._tail_has(ev, "rank*.jsonl", '"event": "done"'):
            rank = target(len(kills))
            pid = p9.live_pid(ev, rank)
            if pid is not None:  # between two processes: the kill waits for the new one
                os.kill(pid, signal.SIGKILL)
                kills.append({"t": time.time(), "rank": rank})
                due += INTERVALS[len(kills) % len(INTERVALS)] if early is None else float("inf")
        time.sleep(0.05)
    p9.finish(agents, 10, tag)
    return p9.read_events(ev), kills, launched


def breakdown(events: list[dict[str, Any]], faults: list[dict[str, Any]], step: float) -> dict[str, float]:
    """Where the wall time beyond ``steps x step`` went, on rank 0's clock (its steps over all its processes, in time
    order): the kills' windows (SIGKILL -> first new step, the replay inside), then, for every other step-to-step gap,
    the seconds beyond ``step``: the job's first 6 s (every process starting; with a spare, the first spare warming),
    a new process's first 20 steps, 8 to 16 s after a recovery (with a spare, the next one warming: it starts 10 s
    after a replacement), a step followed by a save, and the rest; and the median of the rest against ``step``."""
    windows = [(f["t"], f["t"] + f["recovery"]) for f in faults]
    timeline = []
    firsts = {}
    for pid, proc in p9.processes(events).items():
        if proc.rank != 0 or not proc.steps:
            continue
        saved = {s for _, s, _ in proc.saves}
        firsts[pid] = proc.steps[0][0]
        timeline += [(t, pid, i, s in saved) for i, (t, s) in enumerate(proc.steps)]
    timeline.sort()
    out = {"recovery": sum(f["recovery"] for f in faults), "job_start": 0.0, "new_process": 0.0, "after_recovery": 0.0,
           "save_steps": 0.0, "other_steps": 0.0}
    rest: list[float] = []
    start, first_pid = timeline[0][0], timeline[0][1]
    for (t0, _, _, saved), (t1, pid, i, _) in zip(timeline, timeline[1:], strict=False):
        if any(a < t1 and t0 < b for a, b in windows):
            continue  # inside a kill's window: counted whole above
        extra = t1 - t0 - step
        if t0 - start < 6.0:
            out["job_start"] += extra
        elif pid != first_pid and i < 20:
            out["new_process"] += extra
        elif any(b + 8.0 <= t0 <= b + 16.0 for _, b in windows):
            out["after_recovery"] += extra
        elif saved:
            out["save_steps"] += extra
        else:
            out["other_steps"] += extra
            rest.append(t1 - t0)
    out["other_step_ratio"] = statistics.median(rest) / step if rest else float("nan")
    return out


def extra_faults(events: list[dict[str, Any]], kills: list[dict[str, Any]]) -> list[str]:
    """Errors that left a rank's training loop beyond the one each kill causes on each surviving rank: each a fault
    of its own (a replacement whose first generation failed costs every rank a second recovery; the job's phases
    logging did so for every replaced rank until 2026-12-05), as ``rank R pid P: error``."""
    world = len({e["rank"] for e in events})
    failed = sorted((e["t"], e["rank"], e["pid"], str(e.get("error", ""))) for e in events if e["event"] == "failed")
    expected = len(kills) * max(world - 1, 0)
    return [f"rank {r} pid {p}: {err[:120]}" for _, r, p, err in failed[expected:]] if len(failed) > expected else []


def started(events: list[dict[str, Any]], launched: float) -> float:
    """Launch -> the first step done on every rank."""
    firsts = {}
    for p in p9.processes(events).values():
        if p.steps:
            firsts[p.rank] = min(firsts.get(p.rank, float("inf")), p.steps[0][0])
    return max(firsts.values()) - launched


def main() -> None:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--ideal-seconds", type=float, default=62.0, help="the job's length in seconds of training (P9's)")
    p.add_argument("--durable-seconds", type=float, default=12.5, help="durable checkpoint spacing, as in P9")
    p.add_argument("--local-every", type=int, default=10, help="in-memory cadence, steps")
    p.add_argument("--sleep", type=float, default=0.02, help="seconds of 'accelerator time' per step")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--baseline-steps", type=int, default=130)
    p.add_argument("--quiet-steps", type=int, default=40, help="steps of each fault-free start run")
    p.add_argument("--pairs", type=int, default=3, help="fault-free torchrun/robustdist run start pairs")
    p.add_argument("--early-runs", type=int, default=3, help=f"runs with one kill {EARLY_S:g} s after the first step")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant-timeout", type=float, default=300)
    p.add_argument("--host", action="store_true", help="two agents on this host even where the lab can run")
    p.add_argument("--keep", action="store_true", help="keep the work directory (events, logs)")
    a = p.parse_args()
    a.steps = a.every = None
    why = nodelab.unavailable()
    use_lab = why is None and not a.host
    work = Path(tempfile.mkdtemp(prefix="rd-bench-replace-"))
    began, load0 = time.time(), os.getloadavg()[0]
    ideal: dict[str, list[float]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    walls: dict[str, float] = {}
    lost: dict[str, dict[str, float]] = {}
    drift: dict[str, float] = {}
    starts: list[float] = []
    early: list[float] = []
    ready: list[float] = []
    extra: dict[str, list[str]] = {}
    try:
        nodes = p9.Nodes(work, use_lab)
        try:
            for variant in [v for v in a.variants.split(",") if v]:
                before = p9.baseline_run(nodes, work, a, variant)
                if a.steps is None:
                    step = statistics.mean(before)
                    a.steps = round(a.ideal_seconds / step)
                    a.every = a.local_every * max(1, round(a.durable_seconds / step / a.local_every))
                events, kills, _ = kill_run(nodes, work, variant, a, faults=True, tag=variant)
                after = p9.baseline_run(nodes, work, a, f"{variant}-after")
                ideal[variant], drift[variant] = before + after, statistics.mean(after) / statistics.mean(before)
                step = statistics.mean(ideal[variant])
                rank0 = sorted(t for pr in p9.processes(events).values() if pr.rank == 0 for t, _ in pr.steps)
                walls[variant] = rank0[-1] - rank0[0] + step
                runs[variant] = p10.per_fault(events, kills)
                lost[variant] = breakdown(events, runs[variant], step)
                extra[variant] = extra_faults(events, kills)
                print(f"  {variant}: goodput {a.steps * step / walls[variant]:.3f}, kills {runs[variant]}", flush=True)
            for i in range(a.pairs):
                order = ("torchrun", "robustdist") if i % 2 == 0 else ("robustdist", "torchrun")
                took = {who: started(*kill_run(nodes, work, "spare", a, faults=False, tag=f"start-{who}-{i}",
                                               launcher=LAUNCHER["restart" if who == "torchrun" else "spare"])[::2])
                        for who in order}
                starts.append(took["robustdist"] - took["torchrun"])
            if "spare" in runs:
                for i in range(a.early_runs):
                    events, kills, _ = kill_run(nodes, work, "spare", a, faults=False, tag=f"early-{i}",
                                                early=EARLY_S)
                    early.extend(f["recovery"] for f in p10.per_fault(events, kills))
                ready = spare_ready(work, ["spare", *(f"start-robustdist-{i}" for i in range(a.pairs)),
                                           *(f"early-{i}" for i in range(a.early_runs))])
        finally:
            nodes.close()
    except BaseException:
        p9.dump_logs(work)
        raise
    finally:
        p9.tidy(work, a.keep)
    report(a, use_lab, why, ideal, runs, walls, lost, drift, starts, time.time() - began,
           (load0, os.getloadavg()[0]), extra, early, ready)


def report(a: Any, use_lab: bool, why: str | None, ideal: dict[str, list[float]], runs: dict[str, list[dict[str, Any]]],
           walls: dict[str, float], lost: dict[str, dict[str, float]], drift: dict[str, float], starts: list[float],
           seconds: float, load: tuple[float, float], extra: dict[str, list[str]], early: list[float],
           ready: list[float]) -> None:
    times: dict[str, list[float]] = {}
    metrics: dict[str, float] = {"lab": float(use_lab)}
    for v, kills in runs.items():
        lone = [f for f in kills if not f["overlapped"]]
        times[f"{v}: baseline step right before and right after (no checkpoint, no fault)"] = ideal[v]
        metrics[f"baseline_drift_{v}"] = drift[v]
        times[f"{v}: SIGKILL to first new step"] = [f["recovery"] for f in lone]
        metrics[f"goodput_{v}"] = a.steps * statistics.mean(ideal[v]) / walls[v]
        metrics[f"kills_{v}"] = float(len(kills))
        metrics[f"extra_faults_{v}"] = float(len(extra.get(v, [])))
        for part in ("recovery", "to_loop", "replay"):
            metrics[f"{part}_seconds_{v}"] = p9._med([f[part] for f in lone])
    if starts:
        times["no faults: robustdist run start - torchrun start, same job (per pair)"] = starts
        metrics["start_delta_seconds"] = statistics.median(starts)
    if ready:
        times["spare: the workers' start -> the first spare warm (each agent, each robustdist run run)"] = ready
        metrics["spare_ready_seconds"] = statistics.median(ready)
    if early:
        times[f"spare: SIGKILL of rank 1 {EARLY_S:g} s after the first step -> first new step"] = early
        metrics["early_kill_recovery_seconds"] = statistics.median(early)
    if "spare" in runs and "cold" in runs:
        metrics["spare_saves_seconds"] = metrics["recovery_seconds_cold"] - metrics["recovery_seconds_spare"]
    if "restart" in runs and "spare" in runs:
        metrics["recovery_speedup"] = metrics["recovery_seconds_restart"] / metrics["recovery_seconds_spare"]
    where = "2 lab nodes (network namespaces, one agent and one rank each, a private tmpfs local disk)" \
        if use_lab else f"2 agents on one host, 1 rank each (NOT the lab: {why or '--host'})"
    setup = (f"{where}; P9's job: DDP/gloo MLP {a.layers}x{a.width} + Adam, {a.steps} steps ({a.sleep * 1e3:.0f} ms "
             f"of each a fixed sleep), durable every {a.every} steps, in-memory every {a.local_every}; ranks 1 and 0 "
             f"SIGKILLed alternately, {min(INTERVALS):g} to {max(INTERVALS):g} s apart from the first step on, the "
             "same for every variant, torchrun's store shared; start difference from "
             f"{len(starts)} alternating pairs of {a.quiet_steps}-step runs; {seconds:.0f} s in all")
    notes = [f"machine load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
             f"{os.cpu_count()} CPUs"]
    notes += [f"{v}, per kill (steps lost, SIGKILL to first new step = to the loop again + replay s, sources): "
              + "; ".join(f"{f['lost']} {f['recovery']:.2f} = {f['to_loop']:.2f} + {f['replay']:.2f} "
                          f"{'/'.join(f['sources'])}{' (overlapped)' if f['overlapped'] else ''}" for f in kills)
              for v, kills in runs.items()]
    notes += [f"{v}, wall {walls[v]:.1f} s vs {a.steps} x baseline {a.steps * statistics.mean(ideal[v]):.1f} s; seconds "
              "beyond the baseline step, rank 0: " + ", ".join(f"{k} {x:.1f}" for k, x in parts.items()
                                                              if k != "other_step_ratio")
              + f"; the other steps' median / baseline {parts['other_step_ratio']:.2f}" for v, parts in lost.items()]
    notes += [f"{v}: {len(lines)} error(s) left the loop beyond one per kill per survivor (each a recovery of its "
              f"own; a bug if the job's): {'; '.join(lines[:4])}" for v, lines in extra.items() if lines]
    notes += [f"{v}: the baseline steps' median / mean {skew:.3f} (a steady run's goodput against its own median "
              "step is at most this)" for v, skew in ((v, statistics.median(s) / statistics.mean(s))
                                                             for v, s in ideal.items())]
    for v, parts in lost.items():
        metrics[f"other_step_ratio_{v}"] = parts["other_step_ratio"]
        # the same goodput against the run's own ordinary step (the median of the steps with no save, no kill, no
        # start nearby): blind to a steady per-step cost, but not to the machine's drift between baseline and run
        metrics[f"goodput_own_step_{v}"] = metrics[f"goodput_{v}"] * parts["other_step_ratio"]
    metrics = {k: v for k, v in metrics.items() if v == v}  # NaN: not measured
    h.emit(a, "P11", "a killed rank replaced alone (robustdist run) vs torchrun's restart of every worker", times,
           metrics, setup=setup, notes=notes)


if __name__ == "__main__":
    main()
