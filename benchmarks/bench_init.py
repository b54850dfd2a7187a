"""P4: `safe_init_process_group` vs plain `init_process_group`, 2 ranks, fresh processes each time.

Each repetition starts 2 new ranks (run_ranks, no group); once both have imported everything they agree on a
common start time (each writes when it was ready into a shared directory; both start 0.3 s after the later
one), so neither rank's init includes waiting for the other to finish importing torch, and time only the init
call; the slower rank's time counts (the job waits for it). Repetitions alternate between the two ways.
Run: .venv/bin/python benchmarks/bench_init.py [--reps 4]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import _harness as h
from robustdist.testing.ranks import run_ranks


def _init(rank: int, safe: bool, meet: str) -> float:
    import torch.distributed as dist

    from robustdist import safe_init_process_group
    from robustdist.init import process_group  # noqa: F401  (import everything before the clock starts)

    time.sleep(max(0.0, _start_time(rank, Path(meet)) - time.time()))
    start = time.perf_counter()
    if safe:
        safe_init_process_group({"distributed": {"backend": "gloo"}})
    else:
        dist.init_process_group("gloo")
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return elapsed


def _start_time(rank: int, meet: Path, ranks: int = 2, bound: float = 60.0) -> float:
    """Write when this rank was ready; wait for every rank's; the common start: 0.3 s after the latest."""
    tmp = meet / f".ready{rank}"
    tmp.write_text(repr(time.time()))
    tmp.rename(meet / f"ready{rank}")
    deadline = time.monotonic() + bound
    while not all((meet / f"ready{r}").exists() for r in range(ranks)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"P4: rank {rank}: found {sum((meet / f'ready{r}').exists() for r in range(ranks))} "
                               f"of {ranks} ranks ready after {bound:g} s; expected all within that (imports take a "
                               "few seconds). Fix: re-run on a less loaded machine.")
        time.sleep(0.005)
    return max(float((meet / f"ready{r}").read_text()) for r in range(ranks)) + 0.3


def main() -> None:
    p = h.parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    times: dict[str, list[float]] = {"init_process_group": [], "safe_init_process_group": []}
    for rep in range(args.reps):
        for safe in ((False, True) if rep % 2 == 0 else (True, False)):
            name = "safe_init_process_group" if safe else "init_process_group"
            with tempfile.TemporaryDirectory() as meet:
                times[name].append(max(run_ranks(_init, 2, args=(safe, meet), init=False, timeout=120)))
    med = {k: h.summary(v)["median"] for k, v in times.items()}
    h.emit(args, "P4", "safe_init_process_group vs plain init_process_group", times,
           {"extra_seconds": med["safe_init_process_group"] - med["init_process_group"]},
           setup=f"2 gloo ranks on one host, fresh processes per repetition, {args.reps} repetitions each, "
                 "the slower rank's init time",
           notes=["safe_init adds the environment checks, a named monitored barrier, a smoke-test all_reduce "
                  "whose value is checked, and one all_gather_object of each rank's fingerprint."])


if __name__ == "__main__":
    main()
