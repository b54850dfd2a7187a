"""P4: `safe_init_process_group` vs plain `init_process_group`, 2 ranks, fresh processes each time.

Each repetition starts 2 new ranks (run_ranks, no group); both wait for a common start time (so neither
rank's init includes waiting for the other to finish importing torch) and time only the init call; the
slower rank's time counts (the job waits for it). Repetitions alternate between the two ways.
Run: .venv/bin/python benchmarks/bench_init.py [--reps 4]
"""

from __future__ import annotations

import time

import _harness as h
from robustdist.testing import run_ranks


def _init(rank: int, safe: bool, start_at: float) -> float:
    import torch.distributed as dist

    from robustdist import safe_init_process_group
    from robustdist import process_group  # noqa: F401  (import everything before the clock starts)

    time.sleep(max(0.0, start_at - time.time()))
    start = time.perf_counter()
    if safe:
        safe_init_process_group({"distributed": {"backend": "gloo"}})
    else:
        dist.init_process_group("gloo")
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return elapsed


def main() -> None:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    times: dict[str, list[float]] = {"init_process_group": [], "safe_init_process_group": []}
    for rep in range(args.reps):
        for safe in ((False, True) if rep % 2 == 0 else (True, False)):
            name = "safe_init_process_group" if safe else "init_process_group"
            start_at = time.time() + 6.0  # both ranks have imported torch and robustdist by then
            times[name].append(max(run_ranks(_init, 2, args=(safe, start_at), init=False, timeout=120)))
    med = {k: h.summary(v)["median"] for k, v in times.items()}
    h.emit(args, "P4", "safe_init_process_group vs plain init_process_group", times,
           {"extra_seconds": med["safe_init_process_group"] - med["init_process_group"]},
           setup=f"2 gloo ranks on one host, fresh processes per repetition, {args.reps} repetitions each, "
                 "the slower rank's init time",
           notes=["safe_init adds the environment checks, a named monitored barrier, a smoke-test all_reduce "
                  "whose value is checked, and one all_gather_object of each rank's fingerprint."])


if __name__ == "__main__":
    main()
