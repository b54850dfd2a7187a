"""`make bench-peers`' tooling (not its timings: timing is not a test).

* One tiny round of each variant (``benchmarks/peers/v_*.py``) through the runner's own launch
  code (``_suite.measure`` with the smoke steps: the step and save columns): both ranks record their events,
  rank 0 writes ``final.pt``, and the table renders a row for it. Every launch is bounded by the runner
  (``Size.launch_timeout``, ``Size.stall``) and killed with everything it started; the test has its own bound.
  The rounds run side by side (:func:`rounds`): a round is mostly processes starting and waiting, not computing.
  The Ray Train variant connects to the one Ray head the runner starts for the run (``_launch.ray_cluster``:
  its own port, temporary directory and token), never the suite's session cluster; the head is tested alone too.
* The table, the stuck-rank report parsing and the results page, on synthetic data (no processes).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))
try:
    import _columns as col
    import _launch
    import _suite
    import _table
finally:
    sys.path.remove(str(PEERS))

VARIANTS = _launch.VARIANTS
TORCHRUN_LANES = 2  # torchrun rounds at once, beside the Ray Train round
# The smoke round's steps, with twice its bounds per launch: here up to three launches run at once, beside the
# suite's other worker, on two cores. The bounds stay hang guards.
ROUND = dataclasses.replace(col.SMOKE, launch_timeout=2 * col.SMOKE.launch_timeout, stall=2 * col.SMOKE.stall)


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> tuple[Path, dict[str, Future]]:
    """One tiny round of every variant that exists (:func:`_round`), all under one root: the Ray Train round in a
    lane of its own, started first (the longest), the torchrun rounds :data:`TORCHRUN_LANES` at a time beside it.
    A round spends most of its time starting processes and waiting on them (rendezvous, Ray's actors, polls), so
    side by side they take about as long as the Ray Train round alone. Every round has ended (or failed: its
    future holds the error) when this returns. The launches get a ``TMPDIR`` of this fixture's own (torchrun
    leaves its log directory there)."""
    root = tmp_path_factory.mktemp("peers")
    present = sorted((v for v in VARIANTS if _launch.script(v).exists()), key=lambda v: v not in _launch.DRIVERS)
    driver = ThreadPoolExecutor(1, thread_name_prefix="peers-ray")
    others = ThreadPoolExecutor(TORCHRUN_LANES, thread_name_prefix="peers-torchrun")
    with pytest.MonkeyPatch.context() as env, driver, others:
        env.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        futures = {v: (driver if v in _launch.DRIVERS else others).submit(_round, v, root) for v in present}
        try:
            wait(futures.values())
        except BaseException:  # the test's bound or Ctrl-C: start no queued round (the running ones are bounded)
            for pool in (driver, others):
                pool.shutdown(wait=False, cancel_futures=True)
            raise
    return root, futures


def _round(variant: str, root: Path) -> tuple[dict, list[int], list[str]]:
    """``variant``'s round, a ``_suite.measure`` call of its own (the Ray Train one starts and ends the run's Ray
    head, as ``make bench-peers ray_train`` does), and what was left right after it: processes working under its
    directory and, after the Ray Train round, any live process of a Ray head (no other round starts one)."""
    records = _suite.measure([variant], root, ROUND, ("step",), log=lambda _: None)
    heads = [m for m in _launch.CLUSTER_MARKERS if _launch.marked(m)] if variant in _launch.DRIVERS else []
    return records, _procs_of(root / variant), heads


@pytest.mark.processes
@pytest.mark.xdist_group("bench_peers_rounds")  # one worker runs the rounds, once
@pytest.mark.timeout(900)  # the first test waits for every round (each launch bounded by ROUND)
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_tiny_round_of_each_variant(variant, rounds):
    if not _launch.script(variant).exists():
        pytest.skip(f"benchmarks/peers/v_{variant}.py does not exist yet (written separately)")
    root, futures = rounds
    records, left, heads = futures[variant].result()
    rec = records[variant]
    work = root / variant / "baseline"
    log = (work / "launch.log").read_text()[-3000:] if (work / "launch.log").exists() else "(no launch.log)"
    assert rec["step"]["ok"], f"{variant} did not finish its smoke round: {rec['step']}\n{log}"
    for rank in (0, 1):
        events = [e["event"] for e in _launch.Result(variant, work, [], 0.0).events(rank)]
        assert events.count("step") == ROUND.steps and "start" in events and events[-1] == "done", (rank, events)
    assert rec["step"]["n"] == ROUND.steps - ROUND.warmup and rec["step"]["median_s"] > 0
    assert rec["save"]["n"] == ROUND.steps // ROUND.save_every and rec["save"]["median_s"] > 0
    final = torch.load(work / "final.pt", weights_only=True)
    assert final and all(torch.isfinite(t).all() for t in final.values() if t.is_floating_point())
    assert rec["options"], f"{_launch.script(variant).name} has no OPTIONS saying which option it used where"
    section = _table.section({"variants": records, "size": ROUND.record()})
    assert f"| {_table.LABELS[variant]} | " in section
    assert not left and not _procs_of(root / variant), "a launch left processes behind"
    assert not heads and not [m for m in _launch.CLUSTER_MARKERS if _launch.marked(m)], \
        "the run's Ray head left processes behind"


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_the_runs_ray_head_serves_a_driver_and_leaves_nothing_behind(tmp_path):
    """The one Ray head a run starts for its Ray Train launches (``_launch.ray_cluster``): a driver given its
    environment connects to it (its token, its CPUs), and leaving the ``with`` ends every process it started."""
    code = "import ray; ray.init(); print('CPUS', ray.cluster_resources().get('CPU')); ray.shutdown()"
    with _launch.ray_cluster(cpus=3) as cluster:
        assert _launch.marked(cluster.marker), "the head's processes do not carry its marker"
        assert cluster.env["RAY_AUTH_TOKEN"] not in repr(cluster)
        env = {**os.environ, **cluster.env, "RAY_USAGE_STATS_ENABLED": "0"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert "CPUS 3.0" in out.stdout, out.stdout[-1000:] + out.stderr[-2000:]
        head = _launch._RAY_HEAD
        assert head is not None
        head.kill()
        head.wait()
        with pytest.raises(RuntimeError, match=r"the run's Ray head exited \(code -9\).*Fix: re-run `make "
                           r"bench-peers ray_train`(?s:.*)`ray start` said:"):  # not recorded as Ray Train's result
            _launch.launch("ray_train", tmp_path / "after", ["--steps", "1"], timeout=30)
    assert not _launch.marked(cluster.marker), "the head left processes behind"
    assert not Path(cluster.temp_dir).exists()
    assert _launch._RAY_HEAD is None and not _launch._RAY_ENV


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_the_runs_ray_head_dies_with_a_killed_runner():
    """A runner killed before its ``finally`` (SIGKILL, a cancelled CI job) leaves no Ray head behind: the
    reaper ``ray_cluster`` starts ends the head's processes and removes its directory."""
    code = ("import sys, time; sys.path.insert(0, {peers!r}); import _launch\n"
            "with _launch.ray_cluster(cpus=1) as c:\n"
            "    print(c.marker, c.temp_dir, flush=True)\n"
            "    time.sleep(600)\n").format(peers=str(PEERS))
    runner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        marker, temp_dir = runner.stdout.readline().split()
        assert _launch.marked(marker)
    finally:
        runner.kill()
        runner.wait()
    deadline = time.monotonic() + 60
    while (_launch.marked(marker) or Path(temp_dir).exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _launch.marked(marker)
    _launch._sweep(marker, quiet=3)  # whatever the outcome, leave nothing for the next test
    assert not left, "the head outlived its killed runner"
    assert not Path(temp_dir).exists()


def _procs_of(path: Path) -> list[int]:
    """Processes whose working directory is under ``path`` (every launch runs in its workdir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path) in str((entry / "cwd").resolve()):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


# ---------------------------------------------------------------------------------------------- synthetic
def _record(step_ms: float, *, ok: bool = True) -> dict:
    stuck = {"timeout": None, "cap_s": 60.0, "default_s": 1800.0, "stuck_seen": True, "reported": False,
             "seconds": None, "named": False, "text": None}
    return {
        "available": True, "date": "d", "options": {"timeout": "the option"}, "stuck_default_s": 1800.0,
        "step": {"median_s": step_ms / 1e3, "n": 50, "warmup": 10, "ok": True},
        "save": {"median_s": 0.004, "blocking_s": 0.002, "n": 8, "every": 5, "ok": True},
        "resume": {"exact": 2 if ok else 1, "of": 2, "save_every": 5, "reference_ok": True, "points": [
            {"kill_at": 13, "killed": True, "resumed_from": 10, "equal": True, "init_failures": []},
            {"kill_at": 37, "killed": True, "resumed_from": 35, "equal": ok,
             "init_failures": [] if ok else ["RuntimeError: Gloo connectFullMesh failed"]}]},
        "save_kill": {"intact": 3 if ok else 1, "kills": 3, "asked": 3, "kills_inside_a_save": 3, "finished": True,
                      "init_failures": [], "restarts": [{"ok": True, "step": 2, "intact": True, "error": None}] * 3},
        "stuck_default": stuck,
        "stuck_timeout": {**stuck, "timeout": 10.0, "reported": True, "seconds": 10.4, "named": ok,
                          "text": "Suspect: rank 1", "kind": "output"},
        "nan": {"caught": ok, "how": "raised" if ok else "finished with non-finite weights on every rank"},
        "sync_bn": {"ok": ok, "how": "ran" if ok else "ValueError: SyncBatchNorm layers only work with GPU modules"},
    }


def _synthetic() -> dict:
    variants = {"plain": _record(5.0, ok=False), "accelerate": _record(6.0), "fabric": _record(5.5),
                "robustdist": _record(7.5), "rd_accelerate": _record(6.5), "rd_fabric": _record(6.0)}
    variants["ray_train"] = {"available": False, "missing": "v_ray_train.py does not exist", "date": "d"}
    return {"date": "2026-11-30 23:00 UTC", "command": "python benchmarks/peers/run.py", "wall_seconds": 512.0,
            "size": col.Size().record(), "machine": {"cpus": "2"}, "variants": variants}


def test_the_table_has_a_row_per_variant_and_notes():
    page = _table.section(_synthetic())
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert [r.split(" | ")[0][2:] for r in rows] == [_table.LABELS[v] for v in VARIANTS]
    assert all(r.count("|") == 10 for r in rows), rows
    plain, robust = rows[0], rows[VARIANTS.index("robustdist")]
    assert "| 5 (1.00x) | 4 / 2 | no, 1/2; 1 restart failed at init | 1/3 intact |" in plain
    assert "| not within 60 s; default 1800 s | 10.4 s, no rank named | no | no |" in plain
    assert "| 7.5 (1.50x) |" in robust and "10.4 s, names rank 1 | yes | yes |" in robust
    assert "not run: v_ray_train.py does not exist" in rows[3]
    assert "restart(s) failed before training started: RuntimeError: Gloo connectFullMesh failed" in page
    assert "stuck, default bound from torch's `default_pg_timeout`" in page and "timeout: the option" in page
    assert "does worse than the best peer: step time: 7.5 ms, 1.50x plain torch (pytorch/examples)'s (why" in page


def test_the_restart_columns_give_torchrun_a_fresh_store_unless_asked_and_say_which():
    size = col.Size()
    assert size.fresh_store and size.restart_env("plain") == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert size.restart_env("robustdist") == size.restart_env("fabric") == size.restart_env("plain")
    assert size.restart_env("ray_train") == {}  # no torchrun there
    assert size.restart_stall("ray_train") == 2 * size.restart_stall("plain") == 2 * size.stall
    shared = col.Size(fresh_store=False)
    assert shared.restart_env("plain") == {}
    assert _suite.parse(["--shared-store", "plain"]).shared_store and not _suite.parse([]).shared_store
    results = _synthetic()
    results["size"] = {**results.get("size", {}), "fresh_store": True}
    assert "torchrun runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`" in _table.section(results)
    results["size"]["fresh_store"] = False
    assert "use torchrun's default shared store (`run.py --shared-store`)" in _table.section(results)


def test_the_results_page_carries_the_peers_section_before_the_findings():
    bench = _suite._bench_run()
    results = {"date": "d", "command": "c", "machine": {}, "benchmarks": {}}
    page = bench.render(results, peers=_synthetic())
    assert _table.TITLE in page and page.index(_table.TITLE) < page.index("## What profiling found")
    assert _table.TITLE not in bench.render(results, peers=None)


def test_a_subset_keeps_the_other_variants_records(tmp_path, monkeypatch):
    out = tmp_path / "results.json"
    import json

    out.write_text(json.dumps(_synthetic()))
    fresh = copy.deepcopy(_synthetic()["variants"]["plain"])
    monkeypatch.setattr(_suite, "measure", lambda *a, **k: {"plain": fresh})
    assert _suite.main(["plain", "--out", str(out), "--workdir", str(tmp_path / "w")]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["variants"]) == set(VARIANTS) and saved["variants"]["plain"] == fresh


def _result(lines: list[tuple[float, str]], events: list[dict], tmp_path: Path) -> _launch.Result:
    import json

    (tmp_path / "events-rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    run = _launch.Result("plain", tmp_path, [], started=0.0)
    run.lines = lines
    run.stopped = True
    return run


def test_stuck_report_timing_and_naming(tmp_path):
    now = time.time()
    stuck = {"event": "stuck", "rank": 1, "pid": 2, "t": now}
    summary = [(now + 10.5, "  rank      : 1 (local_rank: 1)"), (now + 10.5, "  exitcode  : -15 (pid: 9)  (SIGTERM)")]
    gloo = {"event": "error", "rank": 0, "pid": 1, "t": now + 10.2, "type": "RuntimeError",
            "message": "[pair.cc:537] Timed out waiting 10000ms for recv operation to complete"}
    found = col._stuck_report(_result(summary, [stuck, gloo], tmp_path), col.Size())
    # the gloo error names no rank, and torchrun's failure summary (rank 1 SIGTERMed) is not a report
    assert found["report_t"] == pytest.approx(now + 10.2) and not found["named"], found
    watchdog = [(now + 10.8, "[rank0]: robustdist watchdog: rank 0 had no beat for 10.8 s"),
                (now + 11.0, "hang report from rank 0: rank 1 last beat at step 4. Suspect: rank 1.")]
    found = col._stuck_report(_result(watchdog, [stuck], tmp_path), col.Size())
    assert found["named"] and found["report_t"] == pytest.approx(now + 10.8) and "Suspect: rank 1" in found["text"]
    assert col._stuck_report(_result([(now - 5, "timeout 10")], [], tmp_path), col.Size())["stuck_t"] is None
