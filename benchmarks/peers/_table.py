"""The peer table: ``benchmarks/peers/results.json`` rendered as the "Side by side with the peers" section of
``benchmarks/RESULTS.md`` (``benchmarks/run.py`` calls :func:`section`), one row per variant, one column per
measure, and notes naming the option each variant used where.

Pure functions of the results dict: no processes, no files (a test renders a synthetic dict).
"""

from __future__ import annotations

from typing import Any

from _launch import VARIANTS

TITLE = "## Side by side with the peers"
LABELS = {"plain": "plain torch (pytorch/examples)", "accelerate": "Accelerate", "fabric": "Lightning Fabric",
          "ray_train": "Ray Train", "robustdist": "robustdist (`harden`)",
          "rd_accelerate": "robustdist inside Accelerate", "rd_fabric": "robustdist inside Lightning Fabric"}
# Where each variant's default for a stuck rank comes from (the number is the variant's STUCK_DEFAULT_SECONDS).
DEFAULT_SOURCES = {
    "plain": "torch's `default_pg_timeout` (torch/distributed/constants.py), which `init_process_group` uses",
    "accelerate": "`InitProcessGroupKwargs.timeout` unset: torch's `default_pg_timeout`",
    "fabric": "`DDPStrategy(timeout=default_pg_timeout)` (lightning/fabric/strategies/ddp.py)",
    "ray_train": "`TorchConfig.timeout_s` (ray/train/torch/config.py)",
    "robustdist": "`health.hang_timeout` (the watchdog's report; docs/configuration.md); the group's own "
                  "`distributed.timeout` is 1800 s",
    "rd_accelerate": "`health.hang_timeout`, as robustdist's",
    "rd_fabric": "`health.hang_timeout`, as robustdist's",
}
HEADER = ("| variant | step (ms; vs plain) | save / blocking (ms) | resume exact | save survives a kill | "
          "stuck rank: defaults | stuck rank: timeout option | NaN caught | CPU SyncBN |")


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def step_cell(rec: dict[str, Any], plain: dict[str, Any] | None) -> str:
    step = rec.get("step") or {}
    median = step.get("median_s")
    if median is None:
        return "failed" if step else "-"
    base = ((plain or {}).get("step") or {}).get("median_s")
    return f"{_ms(median)} ({median / base:.2f}x)" if base else _ms(median)


def save_cell(rec: dict[str, Any]) -> str:
    save = rec.get("save") or {}
    if save.get("median_s") is None:
        return "failed" if save else "-"
    return f"{_ms(save['median_s'])} / {_ms(save['blocking_s'])}"


def _init_failed(n: int) -> str:
    return f"; {n} restart{'s' if n > 1 else ''} failed at init" if n else ""


def resume_cell(rec: dict[str, Any]) -> str:
    r = rec.get("resume")
    if not r:
        return "-"
    points = r["points"]
    never = sum(1 for p in points if p.get("resumed_from") is None)
    measured = [p for p in points if p.get("resumed_from") is not None]
    verdict = "yes" if measured and all(p["equal"] for p in measured) else "no"
    cell = f"{verdict}, {r['exact']}/{r['of']}" + (f"; {never} never resumed" if never else "")
    return cell + _init_failed(sum(len(p.get("init_failures", [])) for p in points))


def save_kill_cell(rec: dict[str, Any]) -> str:
    k = rec.get("save_kill")
    if not k:
        return "-"
    cell = f"{k['intact']}/{k['kills']} intact"
    if k["kills"] < k["asked"]:
        cell += f" ({k['asked']} asked)"
    never = k["kills"] - len(k["restarts"][:k["kills"]])
    cell += f"; {never} never resumed" if never > 0 else ""
    return cell + _init_failed(len(k.get("init_failures", [])))


def stuck_cell(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    if not s.get("stuck_seen"):
        return "did not reach the stuck step"
    if not s["reported"]:
        default = f"; default {s['default_s']:g} s" if s.get("default_s") else ""
        return f"not within {s['cap_s']:g} s{default}"
    return f"{s['seconds']:.1f} s, {'names rank 1' if s['named'] else 'no rank named'}"


def nan_cell(rec: dict[str, Any]) -> str:
    n = rec.get("nan")
    return "-" if not n else ("yes" if n["caught"] else "no")


def sync_bn_cell(rec: dict[str, Any]) -> str:
    b = rec.get("sync_bn")
    return "-" if not b else ("yes" if b["ok"] else "no")


def row(name: str, rec: dict[str, Any], plain: dict[str, Any] | None) -> str:
    label = LABELS.get(name, name)
    if not rec.get("available", True):
        return f"| {label} | not run: {rec.get('missing', 'missing')} |" + " |" * 7
    cells = [step_cell(rec, plain), save_cell(rec), resume_cell(rec), save_kill_cell(rec),
             stuck_cell(rec.get("stuck_default")), stuck_cell(rec.get("stuck_timeout")), nan_cell(rec),
             sync_bn_cell(rec)]
    return f"| {label} | " + " | ".join(cells) + " |"


def _failures(errors: list[str]) -> str:
    if not errors:
        return ""
    return f"; {len(errors)} restart(s) failed before training started: {errors[0]}"


def _point(p: dict[str, Any]) -> str:
    text = f"kill at {p['kill_at']}: resumed from {p['resumed_from']}, {'equal' if p['equal'] else 'not equal'}"
    text += _failures(p.get("init_failures", []))
    if p.get("launch"):
        text += f" ({p['launch']}{': ' + p['where'] if p.get('where') else ''})"
    return text


def notes(name: str, rec: dict[str, Any]) -> list[str]:
    """What the variant did, column by column, and which of its options it used."""
    out = []
    options = rec.get("options") or {}
    if options:
        out.append("options: " + "; ".join(f"{k}: {v}" for k, v in options.items()))
    resume = rec.get("resume")
    if resume:
        pts = "; ".join(_point(p) for p in resume["points"])
        out.append(f"resume exact: {pts}")
    kill = rec.get("save_kill")
    if kill:
        bad = [r for r in kill["restarts"] if not r["intact"]]
        detail = "; ".join(f"loaded step {r['step']}, not the state saved" if r["ok"] else f"did not load: {r['error']}"
                           for r in bad)
        text = f"save survives a kill: {kill['kills_inside_a_save']} of {kill['kills']} kills landed inside a save"
        text += f"; not intact: {detail}" if detail else ""
        text += _failures(kill.get("init_failures", []))
        if not kill["finished"]:
            text += f"; the run did not finish ({kill.get('launch', '?')}: {kill.get('error') or kill.get('where')})"
        out.append(text)
    for key, what in (("stuck_default", "stuck, defaults"), ("stuck_timeout", "stuck, timeout option")):
        s = rec.get(key)
        if s and s.get("reported"):
            out.append(f"{what}: first report ({s['kind']}): {s['text']}")
    if rec.get("stuck_default") and not rec["stuck_default"].get("reported") and name in DEFAULT_SOURCES:
        out.append(f"stuck, default bound from {DEFAULT_SOURCES[name]}")
    for key, what in (("nan", "NaN"), ("sync_bn", "CPU SyncBN")):
        if rec.get(key):
            out.append(f"{what}: {rec[key]['how']}")
    return out


def _rate(rec: dict[str, Any], key: str, hit: str, total: str) -> float | None:
    r = rec.get(key)
    return r[hit] / r[total] if r and r.get(total) else None


def behind(variants: dict[str, Any], name: str = "robustdist") -> list[str]:
    """Where ``name`` does worse than the best of the other variants that ran, column by column."""
    me = variants.get(name)
    peers = {n: r for n, r in variants.items() if n != name and r.get("available", True)}
    if not me or not me.get("available", True) or not peers:
        return []
    out = []
    for key, what, better in (("step", "step time", min), ("save", "save time", min)):
        mine = (me.get(key) or {}).get("median_s")
        theirs = {n: (r.get(key) or {}).get("median_s") for n, r in peers.items()}
        theirs = {n: t for n, t in theirs.items() if t}
        if mine and theirs:
            best = better(theirs, key=lambda n: theirs[n])
            if mine > 1.05 * theirs[best]:
                out.append(f"{what}: {_ms(mine)} ms, {mine / theirs[best]:.2f}x {LABELS.get(best, best)}'s")
    for key, what, hit, total in (("resume", "resume exact", "exact", "of"),
                                  ("save_kill", "save survives a kill", "intact", "kills")):
        mine_rate = _rate(me, key, hit, total)
        rates = {n: _rate(r, key, hit, total) for n, r in peers.items()}
        best_rate = max((x for x in rates.values() if x is not None), default=None)
        if mine_rate is not None and best_rate is not None and mine_rate < best_rate:
            out.append(f"{what}: {mine_rate:.0%} against {best_rate:.0%}")
    for key, what in (("stuck_default", "stuck rank, defaults"), ("stuck_timeout", "stuck rank, timeout option")):
        s = me.get(key) or {}
        named = [r[key]["seconds"] for r in peers.values() if (r.get(key) or {}).get("named")]
        if named and (not s.get("named") or s["seconds"] > min(named) + 1.0):
            out.append(f"{what}: a peer names rank 1 in {min(named):.1f} s")
    for key, what, flag in (("nan", "NaN", "caught"), ("sync_bn", "CPU SyncBN", "ok")):
        if me.get(key) and not me[key][flag] and any((r.get(key) or {}).get(flag) for r in peers.values()):
            out.append(what)
    return out


def section(results: dict[str, Any]) -> str:
    """The whole section, Markdown, starting with :data:`TITLE`."""
    variants = results.get("variants", {})
    size = results.get("size", {})
    names = [n for n in VARIANTS if n in variants] + sorted(n for n in variants if n not in VARIANTS)
    timeout = size.get("timeout")
    lines = [TITLE, "",
             f"Generated by `make bench-peers` (`benchmarks/peers/run.py`) on {results.get('date', '?')} "
             f"(`{results.get('command', '?')}`, {results.get('wall_seconds', 0):.0f} s). One job, written the "
             "idiomatic way in each framework (`benchmarks/peers/v_*.py`, the contract in `_common.py`): DDP over 2 "
             "gloo ranks on CPU, a convnet with BatchNorm, the same seeded data. Faults are on rank 1 (rank 0 for the "
             "save kills). Each variant runs with its defaults except where a column uses a documented option; "
             "the notes say which.", "",
             f"- step: median of rank 0's step times after {size.get('warmup', '?')} warm-up steps, "
             f"{size.get('steps', '?')} steps; save: medians of rank 0's saves (every {size.get('save_every', '?')} "
             "steps) of model + optimizer + RNG, total and how long the loop was held.",
             f"- resume exact: rank 1 SIGKILLed at steps {', '.join(map(str, size.get('kill_points', [])))} (not "
             "save steps), then a restart; final weights bitwise equal to the uninterrupted run's? Restarts are "
             f"torchrun's `--max-restarts` (Ray: `FailureConfig(max_failures)`) with {size.get('spare_restarts', 0)} "
             "spare, so that a restart that fails at init is retried; those failures are counted. " + (
                 "In both restart columns torchrun runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, every torchrun "
                 "variant alike (robustdist too): with torch 2.13's default shared store a restart often fails or "
                 "hangs at init whatever the checkpoints do (findings, \"Peers\"), which `run.py --shared-store` "
                 "measures instead." if size.get("fresh_store") else
                 "Both restart columns use torchrun's default shared store (`run.py --shared-store`): there a "
                 "restart can fail or hang at init whatever the checkpoints do."),
             f"- save survives a kill: rank 0 SIGKILLed at a random moment of a save, {size.get('kill_saves', '?')} "
             "times, a save every step, the state padded by a 16 MiB buffer (every variant alike) so that a save "
             "lasts long enough for the kill to land inside it; after each restart, did the newest loadable "
             "checkpoint load intact (its parameters' digest equal to the one recorded when that save began)?",
             "- The step and save columns run one launch at a time; the other columns, which measure outcomes "
             "rather than speed, run a few launches at once.",
             f"- stuck rank: rank 1 sleeps at step {size.get('stuck_at', '?')}; seconds until a report (an error, "
             f"an exit or a report line) and whether it names rank 1. Defaults are waited on for "
             f"{size.get('stuck_cap', '?'):g} s; the second column sets each one's timeout option to "
             f"{timeout if timeout is None else format(timeout, 'g')} s.",
             f"- NaN caught: rank 1's loss is NaN at step {size.get('nan_at', '?')}: finished with finite weights, "
             "or stopped with an error naming the non-finite loss before the optimizer step?",
             "- CPU SyncBN: with each one's SyncBatchNorm option, do both ranks finish with equal BatchNorm "
             "statistics?", "", HEADER, "|" + "---|" * 9]
    plain = variants.get("plain")
    lines += [row(name, variants[name], plain) for name in names]
    lost = behind(variants)
    if "robustdist" in variants:
        lines += ["", "Where robustdist does worse than the best peer: " + ("; ".join(lost) + " (why: the findings "
                  "below, \"Peers\")" if lost else "nowhere in this run") + "."]
    lines += ["", "Notes:", ""]
    for name in names:
        rec = variants[name]
        if not rec.get("available", True):
            continue
        lines.append(f"- **{LABELS.get(name, name)}**" + (f" (measured {rec['date']})" if rec.get("date") and
                                                          rec.get("date") != results.get("date") else ""))
        lines += [f"  - {n}" for n in notes(name, rec)]
    for extra in results.get("findings", []):
        lines += ["", extra]
    return "\n".join(lines)
