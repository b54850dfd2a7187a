"""The benchmark tooling (not the timings: timing is not a test): targets, bench-check and the results page."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import check  # noqa: E402
import run  # noqa: E402
from targets import TARGETS, judge  # noqa: E402


def _results(metrics: dict[str, dict[str, float]]) -> dict:
    return {"date": "d", "command": "c", "machine": {"cpus": "2"},
            "benchmarks": {bid: {"id": bid, "title": "t", "unit": "ms", "metrics": m,
                                 "times": {"a": {"median": 0.001, "min": 0.001, "max": 0.002, "n": 3}}}
                           for bid, m in metrics.items()}}


def _all_met() -> dict[str, dict[str, float]]:
    values: dict[str, dict[str, float]] = {}
    for bid, key, op, threshold, _ in TARGETS:
        ok = 1.0 if threshold is None else threshold * (0.5 if op in ("<=", "<") else 2)
        values.setdefault(bid, {})[key] = ok
    return values


def test_judge():
    assert judge("<=", 1.02, 1.02) and not judge("<", 1.0, 1.0) and judge(">=", 2.0, 2.0)
    assert judge("report", 5.0, None) is None


def test_every_issue_benchmark_has_a_target_and_a_script():
    assert sorted({bid for bid, *_ in TARGETS}, key=lambda b: int(b[1:])) == [f"P{i}" for i in range(1, 12)]
    scripts = {p.read_text().split(":", 1)[0].strip('"') for p in BENCH.glob("bench_*.py")}
    assert {s for s in scripts} >= {f"P{i}" for i in range(1, 12)}


def test_bench_check_passes_misses_and_missing(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results(_all_met())))
    assert check.main([str(path)]) == 0
    worse = _all_met()
    worse["P3"]["vs_numpy_uint16"] = 3.2
    del worse["P8"]
    path.write_text(json.dumps(_results(worse)))
    assert check.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "MISSED P3 vs_numpy_uint16 = 3.2 (target <= 1.1)" in out and "MISSING P8 loader_time_ratio" in out
    assert check.main([str(tmp_path / "absent.json")]) == 1


def test_results_page_lists_targets_verdicts_and_tables():
    page = run.render(_results(_all_met()))
    assert page.startswith("# Benchmark results") and "| P1 | `typical_step_ratio` | 0.51 | <= 1.02 | met |" in page
    assert "## P5: t" in page and "| a | 1 | 1 | 2 | 3 |" in page


@pytest.mark.parametrize("name", ["results.json", "RESULTS.md"])
def test_the_committed_results_exist(name):
    assert (BENCH / name).exists()


def test_paired_ratio_and_its_interval():
    import _harness as h

    plain = [1.0, 2.0, 1.5, 1.2, 0.9] * 40
    exact = {"a": [1.03 * v for v in plain], "b": plain}
    assert h.paired_ratio(exact, "a", "b") == pytest.approx(1.03)
    assert h.paired_ratio_ci(exact, "a", "b") == pytest.approx((1.03, 1.03))  # no spread, no interval
    noisy = {"a": [v * (1.03 + (0.05 if i % 2 else -0.05)) for i, v in enumerate(plain)], "b": plain}
    low, high = h.paired_ratio_ci(noisy, "a", "b")
    assert 0.98 <= low < h.paired_ratio(noisy, "a", "b") <= high <= 1.08


def test_p10_takes_each_fault_s_phases_from_the_slowest_rank_and_detection_from_the_peer():
    import bench_inprocess

    events: list[dict] = []
    for rank, pid in ((0, 100), (1, 101)):
        events += [{"event": "step", "rank": rank, "pid": pid, "t": 1.0 + 0.1 * s, "step": s} for s in range(1, 51)]
        events.append({"event": "resumed", "rank": rank, "pid": pid, "t": 0.5, "t0": 0.5, "t1": 0.5, "step": 0,
                       "source": None, "phases": {}})
    events.append({"event": "fault", "rank": 1, "pid": 101, "t": 6.05})
    events.append({"event": "failed", "rank": 0, "pid": 100, "t": 6.06, "error": "RuntimeError: cut"})
    phases = [{"detect_s": 0.004, "decide_s": 0.02, "teardown_s": 0.3, "rebuild_s": 0.25, "restore_s": 0.05,
               "from_process": True},
              {"detect_s": 0.0, "decide_s": 0.01, "teardown_s": 0.2, "rebuild_s": 0.35, "restore_s": 0.04,
               "from_process": True}]
    for rank, pid in ((0, 100), (1, 101)):
        events.append({"event": "resumed", "rank": rank, "pid": pid, "t": 6.8, "t0": 6.8, "t1": 6.8, "step": 40,
                       "source": "memory", "phases": phases[rank]})
        events += [{"event": "step", "rank": rank, "pid": pid, "t": 7.0 + 0.1 * s, "step": 40 + s}
                   for s in range(1, 20)]
    [fault] = bench_inprocess.per_fault(events)
    assert (fault["rank"], fault["lost"], fault["sources"]) == (1, 10, ["memory", "memory"])
    assert fault["detect"] == 0.004  # the peer's watch (the faulting rank's own is 0)
    assert (fault["decide"], fault["teardown"], fault["rebuild"], fault["restore"]) == (0.02, 0.3, 0.35, 0.05)
    assert fault["from_process"] is True and abs(fault["error_seen"] - 0.01) < 1e-9
    assert abs(fault["to_loop"] - 0.75) < 1e-9 and abs(fault["recovery"] - (7.0 + 1.1 - 6.05)) < 1e-9
    phases[0]["from_process"] = False
    assert bench_inprocess.per_fault(events)[0]["from_process"] is False


def test_p11_breakdown_puts_each_gap_where_it_belongs():
    import bench_replace

    step = 0.1
    gaps = [step] * 300
    gaps[10] += 0.05  # in the job's first 6 s
    gaps[100] += 0.3  # an ordinary step, late
    gaps[150] += 0.2  # the step after a save (of step 151)
    gaps[200] += 1.0  # inside a kill's window: only the window counts
    times, t = [], 0.0
    for g in gaps:
        times.append(t)
        t += g
    events: list[dict] = [{"event": "step", "rank": 0, "pid": 1, "t": times[i], "step": i + 1} for i in range(300)]
    events.append({"event": "save", "rank": 0, "pid": 1, "t": times[150], "step": 151, "save_s": 0.0})
    events.append({"event": "step", "rank": 1, "pid": 2, "t": 1.0, "step": 5})  # another rank: not rank 0's clock
    fault = {"t": times[200] + 0.01, "recovery": 2.0}
    out = bench_replace.breakdown(events, [fault], step)
    assert abs(out["recovery"] - 2.0) < 1e-9
    assert abs(out["job_start"] - 0.05) < 1e-6 and abs(out["save_steps"] - 0.2) < 1e-6
    assert abs(out["other_steps"] - 0.3) < 1e-6 and out["new_process"] == 0.0
    assert abs(out["other_step_ratio"] - 1.0) < 1e-6


def test_p11_counts_the_errors_beyond_one_per_kill_per_survivor():
    import bench_replace

    events: list[dict] = [{"event": "step", "rank": r, "pid": 10 + r, "t": 0.0, "step": 1} for r in (0, 1)]
    kills = [{"t": 5.0, "rank": 1}]
    events.append({"event": "failed", "rank": 0, "pid": 10, "t": 5.1, "error": "RuntimeError: peer gone"})
    assert bench_replace.extra_faults(events, kills) == []
    # the replacement's first generation failed: the survivor's loop is cut a second time (a second recovery; P11's
    # job did so for every replaced rank)
    events.append({"event": "failed", "rank": 0, "pid": 10, "t": 5.6, "error": "RuntimeError: Connection closed"})
    assert bench_replace.extra_faults(events, kills) == ["rank 0 pid 10: RuntimeError: Connection closed"]
    assert bench_replace.extra_faults(events, []) == ["rank 0 pid 10: RuntimeError: peer gone",
                                                       "rank 0 pid 10: RuntimeError: Connection closed"]
