"""The performance targets ``make bench-check`` holds ``benchmarks/results.json`` to (issue: benchmark suite).

Each entry: (benchmark id, metric key in that benchmark's record, comparison, threshold, what it means).
A comparison of "report" has no threshold: the number is recorded, never judged.
"""

from __future__ import annotations

from typing import NamedTuple

TARGETS: list[tuple[str, str, str, float | None, str]] = [
    ("P1", "typical_step_ratio", "<=", 1.02,
     "hardened DDP step time / plain DDP step time, ~50 ms transformer step, 2 gloo ranks (median paired ratio)"),
    ("P1", "typical_step_ratio_ci_high", "<=", 1.03, "the upper end of that ratio's bootstrap 95% interval"),
    ("P1", "typical_step_ratio_loss_only", "report", None,
     "typical_step_ratio with health.check_gradients false (losses agreed by one all-reduce; gradients not read)"),
    ("P1", "small_added_us", "report", None,
     "microseconds harden() adds to a ~5 ms MLP step (median paired difference)"),
    ("P1", "small_added_us_loss_only", "report", None, "small_added_us with health.check_gradients false"),
    ("P1", "convnet_step_ratio", "report", None,
     "hardened DDP step time / plain DDP step time, small convnet with BatchNorm (SyncBN when hardened)"),
    ("P2", "throughput_vs_torch_save", ">=", 0.9, "robustdist sync save throughput / torch.save+fsync throughput"),
    ("P2", "time_vs_dcp", "<", 1.0, "robustdist sync save time / dcp.save time (faster than DCP)"),
    ("P2", "async_blocking_fraction", "<=", 0.15, "async save blocking time / sync save time"),
    ("P3", "vs_numpy_uint16", "<=", 1.1,
     "robustdist's in-band pickle round trip / the same bytes pickled as a plain numpy uint16 array (the floor)"),
    ("P3", "speedup_vs_default", ">=", 1.9, "torch's default bf16 pickle time / robustdist's"),
    ("P3", "out_of_band_vs_memcpy", "<=", 0.5,
     "robustdist's out-of-band (protocol-5 buffers) round trip / one memcpy (clone) of the tensor"),
    ("P3", "speedup_vs_float32_route", ">=", 3.5, "float32-route pickle time / robustdist's"),
    ("P3", "vs_memcpy", "report", None, "robustdist's in-band round trip / one memcpy: no in-band pickle reaches "
     "1.5x (dumps and loads copy twice into fresh memory); judged against the numpy floor instead"),
    ("P4", "extra_seconds", "<=", 0.5, "safe_init_process_group time - plain init_process_group time, 2 ranks"),
    ("P5", "syncbn_step_ratio", "<=", 1.5, "DDP step with robustdist's CPU SyncBN / with plain BatchNorm, 2 ranks"),
    ("P6", "detection_overshoot_seconds", "<=", 5.0, "time from the hang to rank 0 naming the rank - hang_timeout"),
    ("P7", "seconds_per_call", "report", None, "check_consistency on ~100M parameters, 2 gloo ranks"),
    ("P8", "loader_time_ratio", "<=", 1.01, "safe_dataloader epoch time / plain DataLoader epoch time, same settings"),
    ("P9", "goodput_plain", "report", None, "goodput under failures (ideal time / wall time), rank 0 torch.save"),
    ("P9", "goodput_durable", "report", None, "the same, robustdist's durable tier only"),
    ("P9", "goodput_memory", "report", None, "the same, robustdist's durable tier + in-memory tier"),
    ("P9", "ceiling_memory", "report", None, "(mean failure interval - restart floor) / mean failure interval"),
    ("P9", "floor_seconds", "report", None, "restart floor: torchrun restarting a script that only inits a group"),
    ("P9", "steps_lost_max_per_local_cadence", "<=", 1.0,
     "in-memory tier: the most steps any failure lost / the local cadence (local_every_n_steps)"),
    ("P9", "restore_memory_vs_durable_warm", "<=", 0.2,
     "LocalTier.load / AtomicCheckpointer.load, same state, 2 ranks; durable files in the page cache"),
    ("P9", "restore_memory_vs_durable_cold", "report", None,
     "the same after drop_caches (the VM's own disk, not a remote file system)"),
    ("P9", "restore_copy_floor_vs_durable_warm", "report", None,
     "the floor of any restore that copies the bytes once (the tier's file mapped and copied into memory in use, "
     "nothing checked) / AtomicCheckpointer.load warm, same state"),
    ("P9", "restore_gbps_100mb", ">=", 1.0, "LocalTier.load of 101 MB of model and Adam state, 2 ranks: GB/s per rank"),
    ("P9", "restore_gbps_1gb", ">=", 1.0, "the same at 1007 MB"),
    ("P9", "restore_memory_vs_durable_warm_100mb", "report", None, "restore_memory_vs_durable_warm at 101 MB"),
    ("P9", "restore_memory_vs_durable_warm_1gb", "report", None, "restore_memory_vs_durable_warm at 1007 MB"),
    ("P9", "restore_copy_floor_vs_durable_warm_100mb", "report", None,
     "restore_copy_floor_vs_durable_warm at 101 MB"),
    ("P9", "restore_copy_floor_vs_durable_warm_1gb", "report", None, "restore_copy_floor_vs_durable_warm at 1007 MB"),
    ("P9", "recovery_minus_floor_seconds", "<=", 1.0,
     "in-memory tier: kill to first new step (median of rank kills) - restart floor"),
    ("P9", "local_blocking_fraction", "<=", 0.05,
     "in-memory tier: h.save() time per local save (slowest rank, mean) / (local cadence x ideal step time)"),
    ("P9", "goodput_gap_to_ceiling", "<=", 0.05, "ceiling - goodput of the in-memory tier (points of goodput)"),
    ("P9", "goodput_ratio_over_others", ">", 1.0,
     "goodput of the in-memory tier / the better of plain torch.save and the durable tier only"),
    ("P10", "recovery_seconds_inprocess", "<=", 1.0,
     "in-process recovery: a fault that kills no process (an exception) to the first new step, median"),
    ("P10", "goodput_inprocess", ">=", 0.90,
     "in-process recovery: goodput on the schedule of faults that kill no process"),
    ("P10", "step_time_ratio_no_faults", "<=", 1.01,
     "step time without faults: in-process recovery on / off (median of alternating pairs)"),
    ("P10", "recovery_seconds_restart", "report", None, "the same fault recovered by torchrun's restart, median"),
    ("P10", "goodput_restart", "report", None, "the same schedule recovered by torchrun's restarts"),
    ("P10", "recovery_seconds_inprocess_stop", "report", None,
     "in-process recovery: a SIGSTOP of 5 s (hang_timeout 3 s) to the first new step, median"),
    ("P10", "recovery_seconds_restart_stop", "report", None, "the same SIGSTOP recovered by torchrun's restart, median"),
    ("P10", "recovery_seconds_inprocess_partition", "report", None,
     "in-process recovery: a node cut off for 5 s (hang_timeout 3 s) to the first new step, median"),
    ("P10", "recovery_seconds_restart_partition", "report", None,
     "the same partition recovered by torchrun's restart, median"),
    ("P11", "recovery_seconds_spare", "<=", 2.0,
     "robustdist run, warm spare: SIGKILL of rank 1 or 0 to the first new step, median (the issue's P9 kill target)"),
    ("P11", "goodput_spare", ">=", 0.90,
     "robustdist run, warm spare: goodput under SIGKILLs of ranks 1 and 0 on P9's intervals"),
    ("P11", "start_delta_seconds", "<=", 0.5,
     "no faults: robustdist run's job start (launch to first step) - torchrun's, same job (median of pairs)"),
    ("P11", "spare_ready_seconds", "<=", 5.0,
     "robustdist run: the workers' start -> the attempt's first spare warm, both ranks training (median of agents)"),
    ("P11", "early_kill_recovery_seconds", "<=", 2.0,
     "robustdist run, warm spare: SIGKILL of rank 1 2 s after the first step to the first new step, median"),
    ("P11", "recovery_seconds_cold", "report", None, "robustdist run --spares 0: the same kill to the first new step"),
    ("P11", "recovery_seconds_restart", "report", None, "torchrun restarting every worker: the same kill, median"),
    ("P11", "spare_saves_seconds", "report", None, "what the warm spare saves per kill (cold - spare, medians)"),
    ("P11", "goodput_restart", "report", None, "torchrun's restarts: goodput under the same kills"),
    ("P11", "goodput_own_step_spare", "report", None,
     "goodput_spare against the run's own median ordinary step (no save, kill or start nearby) instead of the baseline"),
    ("P11", "baseline_drift_spare", "report", None,
     "the plain job's step right after the spare variant's run / right before it (the machine's drift over the run)"),
    ("P11", "extra_faults_spare", "report", None,
     "warm spare: errors that left the loop beyond one per kill per survivor (each a recovery of its own; expected 0)"),
    ("P11", "other_step_ratio_spare", "report", None,
     "warm spare: median step outside kills, saves, starts and the 16 s after a recovery / the plain job's step"),
]


def judge(op: str, value: float, threshold: float | None) -> bool | None:
    """True when met, False when missed, None for report-only metrics."""
    if op == "report" or threshold is None:
        return None
    return {"<=": value <= threshold, "<": value < threshold, ">=": value >= threshold, ">": value > threshold}[op]


class Verdict(NamedTuple):
    """One target judged against one results file."""

    bench_id: str
    key: str
    op: str
    threshold: float | None
    meaning: str
    value: float | None  # None: the metric is not in the results
    met: bool | None  # None for report-only metrics and for missing ones

    @property
    def status(self) -> str:
        """``missing``, ``report``, ``met`` or ``missed``."""
        if self.value is None:
            return "missing"
        return "report" if self.met is None else "met" if self.met else "missed"


def evaluate(benchmarks: dict) -> list[Verdict]:
    """Judge every target against ``results.json``'s ``"benchmarks"`` mapping, in ``TARGETS`` order.

    ``make bench-check`` (check.py) and the results page (run.py) both use this, so they cannot disagree.
    """
    verdicts = []
    for bench_id, key, op, threshold, meaning in TARGETS:
        value = benchmarks.get(bench_id, {}).get("metrics", {}).get(key)
        met = None if value is None else judge(op, value, threshold)
        verdicts.append(Verdict(bench_id, key, op, threshold, meaning, value, met))
    return verdicts


def missed(verdicts: list[Verdict]) -> int:
    """How many targets are missed; a metric absent from the results counts as missed."""
    return sum(v.status in ("missed", "missing") for v in verdicts)


def summary(verdicts: list[Verdict]) -> str:
    """The one line ``make bench-check`` ends with and ``RESULTS.md`` states."""
    n = missed(verdicts)
    return f"make bench-check: {n} target(s) missed" if n else "make bench-check: every target met"
