"""P6: how long after a rank hangs the watchdog names it, against the configured hang_timeout.

2 gloo ranks train through `harden()` with `health.hang_timeout` = T; at step 3 rank 1 sleeps (a stuck
rank); rank 0, blocked in DDP's all-reduce, must report "rank 1 last beat at step 3". Latency: from the
moment rank 1 stopped to rank 0's report (stacks dumped, records read, rank named). The plain way has no
detection: the collective times out after the group's timeout (30 min on gloo by default) naming no rank.
Run: .venv/bin/python benchmarks/bench_hang.py [--timeout 5] [--reps 3]
"""

from __future__ import annotations

import tempfile
import time

import torch
from torch import nn

import _harness as h
from robustdist import harden
from robustdist.testing.ranks import run_ranks


def _hang(rank: int, hang_timeout: float, dump_dir: str) -> tuple[float | None, float | None, str | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    hardened = harden(model, None, {"health": {"hang_timeout": hang_timeout, "dump_dir": dump_dir}})
    opt = torch.optim.SGD(hardened.model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    stopped = None
    for step in range(6):
        loss = nn.functional.cross_entropy(hardened.model(x), y)
        if rank == 1 and step == 3:
            stopped = time.time()
            time.sleep(hang_timeout + 4)  # the report comes about 0.5 s after hang_timeout (P6's overshoot)
        loss.backward()
        if hardened.step_guard(loss, step):
            opt.step()
        opt.zero_grad()
    reports = [r for r in hardened.watchdog.reports if r.summary]
    hardened.close()
    if not reports:
        return stopped, None, None
    return stopped, reports[0].detected_at, reports[0].summary


def main() -> None:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    latencies = []
    named = True
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as dumps:
            out = run_ranks(_hang, 2, args=(args.timeout, dumps), init=False, timeout=300)
        stopped, detected, summary = out[1][0], out[0][1], out[0][2]
        if detected is None or summary is None or "rank 1 last beat at step 3" not in summary:
            named = False
            continue
        latencies.append(detected - stopped)
    if not latencies:
        raise SystemExit("P6: rank 0 never named rank 1")
    med = h.summary(latencies)["median"]
    h.emit(args, "P6", "hang detection latency vs hang_timeout", {"robustdist watchdog: hang to report": latencies},
           {"hang_timeout_seconds": args.timeout, "detection_overshoot_seconds": med - args.timeout,
            "named_every_time": float(named)},
           setup=f"2 gloo ranks, hang_timeout {args.timeout:g} s, rank 1 sleeps at step 3, {args.reps} runs",
           notes=["Plain torch names no rank: rank 0 waits in the all-reduce until the group's timeout (1800 s "
                  "on gloo by default, not measured here) and then raises without saying which rank was stuck."])


if __name__ == "__main__":
    main()
