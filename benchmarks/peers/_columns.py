"""The columns of the peer table: each launches a variant (:mod:`_launch`) with the contract's flags and reads
what its ranks recorded (events, output, ``final.pt``). Each function returns one JSON-able record per variant.

* :func:`baseline` (columns *step* and *save*): an uninterrupted run; rank 0's ``step`` events after the
  warm-up and its ``save`` events (medians); its ``final.pt`` is the reference of *resume exact*.
* :func:`resume_point`: one run per kill point (rank 1 SIGKILLs itself, a restart), ``final.pt`` compared
  bitwise with the baseline's; :func:`resume_exact` sums the points.
* :func:`save_kill`: ``--kill-in-save``, ``--save-every 1``, N restarts; each restart's ``verify`` against the
  ``save_begin`` digest of the step it loaded.
* :func:`stuck`: ``--stuck-at``; seconds from the ``stuck`` event to the first report, capped.
* :func:`nan`, :func:`sync_bn`.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _launch import DRIVERS, Result, launch, script

FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class Size:
    """How much each column runs (the full suite's defaults; :data:`SMOKE` is the test's)."""

    steps: int = 60
    warmup: int = 10
    save_every: int = 5
    kill_points: tuple[int, ...] = (13, 37)
    kill_saves: int = 3
    kill_save_steps: int = 12  # each attempt gets at most 3 steps further (its third save is cut): 3 x 3 < 12
    stuck_at: int = 5
    stuck_cap: float = 20.0
    timeout: float = 10.0
    report_grace: float = 3.0
    nan_at: int = 5
    short_steps: int = 8
    launch_timeout: float = 150.0
    restart_timeout: float = 60.0
    stall: float = 45.0
    spare_restarts: int = 2
    fresh_store: bool = True  # the restart columns under torchrun: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

    def restart_stall(self, variant: str) -> float:
        """The stall bound of a launch that restarts: a Ray Train restart (the controller notices the dead worker,
        tears the group down and starts new worker processes) printed nothing for over 45 s on two busy cores while
        other launches ran beside it, and finished alone in 13 s per restart, so Ray's gets twice the bound."""
        return self.stall * (2 if variant in DRIVERS else 1)

    def restart_env(self, variant: str) -> dict[str, str]:
        """The environment of a launch that restarts: with :attr:`fresh_store`, torchrun shares no store with
        the workers, so every attempt's group starts from a store of its own (torch 2.13's torchrun otherwise
        lets a restart read the dead attempt's keys and fail or hang at init, whatever the checkpoints do)."""
        return dict(FRESH_STORE) if self.fresh_store and variant not in DRIVERS else {}

    def bound(self, restarts: int) -> float:
        """The bound on a launch allowed ``restarts`` restarts."""
        return self.launch_timeout + self.restart_timeout * restarts

    def record(self) -> dict[str, Any]:
        return asdict(self)


SMOKE = Size(steps=6, warmup=1, save_every=2, kill_points=(3,), kill_saves=1, kill_save_steps=8, stuck_at=2,
             stuck_cap=5.0, nan_at=2, short_steps=3, launch_timeout=150.0, stall=90.0)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _failure(run: Result) -> dict[str, Any]:
    errors = run.named("error")
    first = f"{errors[0]['type']}: {errors[0]['message']}" if errors else None
    out = {"launch": run.describe(), "error": _short(first) if first else None}
    if run.stalled:
        out["where"] = where_stalled(run)
    return out


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def where_stalled(run: Result) -> str | None:
    """From the stacks dumped when a launch stalled: the innermost frames of the first stack that runs the
    variant's script, as ``fn (file:line) <- ...``."""
    stack: list[tuple[str, str, str]] = []
    script_name = script(run.variant).name
    for _, text in list(run.lines):
        m = _FRAME.search(text)
        if m:
            stack.append(m.groups())
            continue
        if stack and any(f[0].endswith(script_name) for f in stack):
            break
        stack = []
    if not stack or not any(f[0].endswith(script_name) for f in stack):
        return None
    frames = [f for f in stack if not f[0].startswith("<")]
    mine = next(i for i, f in enumerate(frames) if f[0].endswith(script_name))
    shown = frames[:min(mine, 2)] + [frames[mine]]
    return " <- ".join(f"{fn} ({path.rsplit('/', 1)[-1]}:{line})" for path, line, fn in shown)


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- step and save
def baseline(variant: str, work: Path, size: Size) -> tuple[dict[str, Any], dict[str, Any], Result]:
    run = launch(variant, work, ["--steps", str(size.steps), "--save-every", str(size.save_every)],
                 timeout=size.launch_timeout, stall=size.stall)
    steps = [e["seconds"] for e in run.named("step", rank=0) if e["step"] > size.warmup]
    saves = run.named("save", rank=0)
    step = {"median_s": _median(steps), "n": len(steps), "warmup": size.warmup, "ok": run.ok}
    save = {"median_s": _median([e["seconds"] for e in saves]), "blocking_s": _median([e["blocking"] for e in saves]),
            "n": len(saves), "every": size.save_every, "ok": run.ok}
    if not run.ok:
        step.update(_failure(run))
        save.update(_failure(run))
    return step, save, run


# ---------------------------------------------------------------------------------------------- resume exact
def bitwise_equal(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
        and torch.equal(x[k].reshape(-1).view(torch.uint8), y[k].reshape(-1).view(torch.uint8)) for k in x)


def attempts(run: Result) -> list[dict[str, Any]]:
    """Each attempt of the job (a restart is a new one), in order: its rank-0 ``start`` event (None when it
    never got that far) and the first error any of its ranks recorded before starting (an init failure)."""
    out: list[dict[str, Any]] = []
    by_pid: dict[tuple[int, int], dict[str, Any]] = {}
    for e in run.events():
        key = (e["rank"], e["pid"])
        if key not in by_pid:
            by_pid[key] = {"rank": e["rank"], "t": e["t"], "start": None, "error": None}
        a = by_pid[key]
        if e["event"] == "start" and a["start"] is None:
            a["start"] = e
        elif e["event"] == "error" and a["start"] is None and a["error"] is None:
            a["error"] = f"{e['type']}: {e['message']}"
    for rank in sorted({r for r, _ in by_pid}):
        mine = sorted((a for (r, _), a in by_pid.items() if r == rank), key=lambda a: a["t"])
        if len(mine) > len(out):  # the rank that saw every attempt (rank 0 unless it never started one)
            out = mine
    return out


def init_failures(run: Result) -> list[str]:
    """Attempts that ended before training started (no ``start`` event), with their error."""
    return [_short(a["error"], 200) for a in attempts(run) if a["start"] is None and a["error"]]


def resume_point(variant: str, work: Path, size: Size, kill_at: int, reference: Path) -> dict[str, Any]:
    """One kill point of *resume exact*: rank 1 SIGKILLs itself before step ``kill_at``; torchrun (or Ray) restarts
    the job; its ``final.pt`` is compared bitwise with ``reference`` (the uninterrupted run's)."""
    run = launch(variant, work / f"kill{kill_at}", ["--steps", str(size.steps), "--save-every", str(size.save_every),
                                                    "--kill-at", str(kill_at)],
                 restarts=1 + size.spare_restarts, timeout=size.bound(1 + size.spare_restarts),
                 stall=size.restart_stall(variant), extra_env=size.restart_env(variant))
    killed = (run.workdir / "fault-kill").exists()
    started = [a["start"] for a in attempts(run) if a["start"] is not None]
    resumed = [e.get("resumed", 0) for e in started[1:]]
    equal = killed and run.ok and run.final.exists() and reference.exists() and bitwise_equal(run.final, reference)
    point = {"kill_at": kill_at, "killed": killed, "resumed_from": resumed[-1] if resumed else None,
             "equal": bool(equal), "init_failures": init_failures(run)}
    if not run.ok:
        point.update(_failure(run))
    return point


def resume_exact(points: list[dict[str, Any]], size: Size, reference: Result) -> dict[str, Any]:
    """The column from its points (:func:`resume_point`)."""
    return {"exact": sum(p["equal"] for p in points), "of": len(points), "save_every": size.save_every,
            "points": points, "reference_ok": reference.ok}


# ---------------------------------------------------------------------------------------------- save survives a kill
PAD_MIB = 16  # the state carries 16 MiB more in this column (every variant alike): a save lasts long enough for
# the kill, a timer thread, to land inside it (a 60 KB save takes a few ms, under Python's switch interval)

def save_kill(variant: str, work: Path, size: Size) -> dict[str, Any]:
    n = size.kill_saves
    run = launch(variant, work, ["--steps", str(size.kill_save_steps), "--save-every", "1", "--kill-in-save",
                                 "--kill-saves", str(n)], restarts=n + size.spare_restarts,
                 timeout=size.bound(n + size.spare_restarts), stall=size.restart_stall(variant),
                 extra_env={"PEERS_STATE_PAD_MB": str(PAD_MIB), **size.restart_env(variant)})
    events = run.events(rank=0)
    kills = sum(1 for p in run.workdir.iterdir() if p.name.startswith("fault-save-kill-"))
    restarts = []
    for i, e in enumerate(events):
        if e["event"] != "start" or "verify" not in e:
            continue
        verify = e["verify"] or {}
        begun = [b for b in events[:i] if b["event"] == "save_begin" and b["step"] == verify.get("step")]
        intact = bool(verify.get("ok")) and bool(begun) and begun[-1]["params"] == verify.get("params")
        restarts.append({"ok": bool(verify.get("ok")), "step": verify.get("step"), "intact": intact,
                         "error": _short(verify["error"]) if verify.get("error") else None})
    record = {"intact": sum(r["intact"] for r in restarts[:kills]), "kills": kills, "asked": n,
              "kills_inside_a_save": _kills_inside_a_save(events), "restarts": restarts,
              "init_failures": init_failures(run), "finished": run.ok}
    if not run.ok:
        record.update(_failure(run))
    return record


def _kills_inside_a_save(events: list[dict[str, Any]]) -> int:
    """Processes of rank 0 whose last event was a ``save_begin`` with no ``save`` after it: killed in a save."""
    last: dict[int, str] = {}
    for e in events:
        last[e["pid"]] = e["event"]
    return sum(1 for event in last.values() if event == "save_begin")


# ---------------------------------------------------------------------------------------------- stuck rank
REPORT = re.compile(r"timed? ?out|timeout|\bhang|\bstuck|watchdog|no beat|not respond|deadline|suspect", re.I)
NAMED = re.compile(r"\branks?\s*[:=#]?\s*1\b|\brank\s+1\s*\(|\[1\]\s*:|suspect:\s*rank 1", re.I)
_PREFIX = re.compile(r"^\s*\[(?:rank|default)\d+\]:\s?")


def stuck_flags(size: Size, timeout: float | None) -> list[str]:
    flags = ["--steps", str(size.stuck_at + 20), "--stuck-at", str(size.stuck_at)]
    return flags + (["--timeout", f"{timeout:g}"] if timeout is not None else [])


def stuck_until(size: Size) -> Callable[[Result], bool]:
    def done(run: Result) -> bool:
        found = _stuck_report(run, size)
        if found["stuck_t"] is None:
            return False
        now = time.time()
        if found["report_t"] is not None:
            return now > found["report_t"] + size.report_grace
        return now > found["stuck_t"] + size.stuck_cap

    return done


def _stuck_report(run: Result, size: Size) -> dict[str, Any]:
    stuck = run.named("stuck")
    if not stuck:
        return {"stuck_t": None, "report_t": None, "text": None, "named": False}
    t0 = stuck[0]["t"]
    candidates = [(e["t"], f"{e['type']}: {e['message']}", "error event") for e in run.named("error") if e["t"] >= t0]
    lines = [(t, _PREFIX.sub("", text)) for t, text in list(run.lines) if t >= t0]
    candidates += [(t, text, "output") for t, text in lines if REPORT.search(text)]
    if run.rc is not None and not run.stopped and not run.timed_out:
        candidates.append((run.ended, f"the job exited (code {run.rc})", "exit"))
    if not candidates:
        return {"stuck_t": t0, "report_t": None, "text": None, "named": False}
    t, text, kind = min(candidates, key=lambda c: c[0])
    window = [c for c in candidates if c[0] <= t + size.report_grace]
    naming = [c for c in window if NAMED.search(c[1])]
    if naming:  # show the line that names the rank (the first report may be another rank's own)
        text, kind = naming[0][1], naming[0][2]
    return {"stuck_t": t0, "report_t": t, "text": _short(text), "kind": kind, "named": bool(naming)}


def stuck(variant: str, work: Path, size: Size, timeout: float | None, default_s: float | None) -> dict[str, Any]:
    """With ``timeout`` None: the variant's defaults, waited on for ``size.stuck_cap`` at most."""
    cap = size.stuck_cap if timeout is None else max(size.stuck_cap, 3 * timeout)
    bounded = Size(**{**size.record(), "stuck_cap": cap})
    run = launch(variant, work, stuck_flags(size, timeout), timeout=size.launch_timeout + cap,
                 until=stuck_until(bounded))
    found = _stuck_report(run, bounded)
    record = {"timeout": timeout, "cap_s": cap, "default_s": default_s, "stuck_seen": found["stuck_t"] is not None}
    if found["report_t"] is None:
        record.update(reported=False, seconds=None, named=False, text=None)
        if found["stuck_t"] is None:
            record.update(_failure(run))
        return record
    record.update(reported=True, seconds=found["report_t"] - found["stuck_t"], named=found["named"],
                  text=found["text"], kind=found["kind"])
    return record


# ---------------------------------------------------------------------------------------------- NaN and SyncBN
_NONFINITE = re.compile(r"non-?finite|\bnan\b|\binf\b", re.I)


def nan(variant: str, work: Path, size: Size) -> dict[str, Any]:
    run = launch(variant, work, ["--steps", str(size.short_steps + size.nan_at), "--nan-at", str(size.nan_at)],
                 timeout=size.launch_timeout, stall=size.stall)
    done = run.named("done")
    steps_after = [e["step"] for e in run.named("step", rank=0) if e["step"] >= size.nan_at]
    errors = [e for e in run.named("error") if _NONFINITE.search(f"{e['type']} {e['message']}")]
    lines = [_PREFIX.sub("", t) for _, t in run.lines if "Error" in t and _NONFINITE.search(t)]
    record: dict[str, Any] = {"nan_at": size.nan_at, "ranks_done": len(done),
                              "finite": [bool(e["finite"]) for e in done]}
    if len(done) >= 2 and all(e["finite"] for e in done):
        record.update(caught=True, how="finished with finite weights (the step was skipped or undone)")
    elif (errors or lines) and not steps_after:
        what = f"{errors[0]['type']}: {errors[0]['message']}" if errors else lines[0]
        record.update(caught=True, how=f"raised before the optimizer step: {_short(what, 160)}")
    elif done:
        record.update(caught=False, how="finished with non-finite weights on every rank" if not any(record["finite"])
                      else "finished; some weights non-finite")
    else:
        record.update(caught=False, how=f"did not finish ({run.describe()}) and no error named the non-finite loss",
                      **_failure(run))
    return record


def sync_bn(variant: str, work: Path, size: Size) -> dict[str, Any]:
    run = launch(variant, work, ["--steps", str(size.short_steps), "--sync-bn"], timeout=size.launch_timeout,
                 stall=size.stall)
    done = {e["rank"]: e["bn_means"] for e in run.named("done")}
    if len(done) >= 2:
        means = list(done.values())
        diff = max(abs(a - b) for a, b in zip(means[0], means[1]))
        return {"ok": diff == 0.0, "max_abs_diff": diff,
                "how": "ran; BatchNorm statistics equal on both ranks" if diff == 0.0
                else "ran, but the ranks' BatchNorm statistics differ (not synchronised)"}
    failure = _failure(run)
    return {"ok": False, "max_abs_diff": None, "how": failure["error"] or f"did not finish ({failure['launch']})",
            **failure}
