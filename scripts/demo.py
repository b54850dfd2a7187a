"""``make demo``: one rank SIGKILLed mid-run, recovered two ways, each checked bitwise against a run without a fault.

The job is ``examples/resilient_training.py`` with ``--in-process`` (2 CPU ranks, DDP + SyncBatchNorm, dropout, SGD +
StepLR; a durable checkpoint every ``--every`` steps, an in-memory one every step), run three times:

1. **straight**: under torchrun, no fault: the reference.
2. **torchrun**: under ``torchrun --max-restarts=1``: rank 1 SIGKILLs itself at step ``--kill-step``; torchrun stops
   the survivor and starts both ranks again, which resume from the last checkpoint.
3. **robustdist run**: the same job under ``robustdist run --max-restarts=1``: at step ``--kill-step`` rank 1 waits
   until the agent has said its warm spare is ready (rank 0 waits in the step), then SIGKILLs itself; the spare forks
   the replacement, and rank 0 recovers in its own process.

For each faulty run it prints the time from the kill to the next step done on every rank (a step beyond the last one
done before the kill) and whether the final parameters and buffers of every rank are bitwise equal to the straight
run's. Each run's output (the killed rank's expected tracebacks included) goes to ``<workdir>/<run>.log``, which the
summary names. Exits 0 only when both faulty runs had their kill and ended bitwise equal to the straight run; refuses
a ``--workdir`` that is not empty (its runs would resume from an earlier demo's checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "resilient_training.py"
READY = re.compile(r"the warm spare \(pid \d+\) is ready")


def launch(work: Path, name: str, launcher: list[str], job: list[str], timeout: float,
           on_line: tuple[re.Pattern[str], Path] | None = None) -> int:
    """Run one launcher to its end, its output to ``<work>/<name>.log``; ``on_line``: create the file when a line of
    the output matches. Returns its exit code (the launcher's session killed past ``timeout``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *launcher, "--standalone", "--nproc_per_node=2", str(JOB),
                                 "--workdir", str(work / name), *job], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def copy() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if on_line is not None and on_line[0].search(line):
                    on_line[1].touch()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # the launcher stops its workers (and its spare) on SIGTERM
            proc.terminate()
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            print(f"make demo: the {name} run did not end within {timeout:g} s; stopped", file=sys.stderr)
        reader.join(30)
    return code


def steps(run: Path) -> dict[int, list[tuple[int, float]]]:
    """Rank -> its (step, time) lines, every process of the rank together."""
    out: dict[int, list[tuple[int, float]]] = {}
    for rank in (0, 1):
        path = run / f"steps-rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        out[rank] = [(int(e["step"]), float(e["time"])) for e in map(json.loads, lines)]
    return out


def kill_to_next_step(run: Path) -> tuple[float, int] | None:
    """(seconds from the kill to the next step done on every rank, the step killed at), or None without one."""
    fault_file = run / "fault.json"
    if not fault_file.exists():
        return None
    fault = json.loads(fault_file.read_text())
    done = steps(run)
    before = max((s for lines in done.values() for s, t in lines if t <= fault["time"]), default=0)
    firsts = [min((t for s, t in lines if t > fault["time"] and s > before), default=None) for lines in done.values()]
    if None in firsts:
        return None
    return max(t for t in firsts if t is not None) - fault["time"], int(fault["step"])


def same_as(run: Path, reference: Path) -> str:
    """"BITWISE EQUAL", or what differs (every rank's final parameters and buffers against the reference's)."""
    bad = []
    for rank in (0, 1):
        mine, ref = run / f"final-rank{rank}.pt", reference / f"final-rank{rank}.pt"
        if not mine.exists() or not ref.exists():
            return f"NOT COMPARED (no {mine.name if not mine.exists() else ref.name})"
        a, b = torch.load(mine, weights_only=True), torch.load(ref, weights_only=True)
        bad += [f"rank {rank} {k}" for k in sorted(set(a) | set(b)) if k not in a or k not in b
                or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]
    return "BITWISE EQUAL" if not bad else f"DIFFERENT ({len(bad)} tensors: {', '.join(bad[:3])})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".demo-run", help="the runs' directories and logs (empty or missing; make "
                                                          "demo empties it first)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="a durable checkpoint every this many steps")
    p.add_argument("--kill-step", type=int, default=37)
    p.add_argument("--timeout", type=float, default=300, help="seconds each run may take before it is killed")
    args = p.parse_args()
    work = Path(args.workdir).resolve()
    if work.exists() and any(work.iterdir()):  # its runs would resume from the last demo's checkpoints: no kill
        print(f"make demo: {work} is not empty (an earlier demo's runs); expected an empty or missing directory. Fix: "
              "remove it (make demo does) or pass another --workdir", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    job = ["--in-process", "--no-reference", "--steps", str(args.steps), "--every", str(args.every), "--kill-step",
           str(args.kill_step)]
    torchrun, robustdist = ["torch.distributed.run", "--max-restarts=1"], ["robustdist", "run", "--max-restarts=1"]
    runs = {"straight": (torchrun, [*job, "--no-fault"], None),
            "torchrun": (torchrun, job, None),
            "robustdist": (robustdist, [*job, "--kill-after", str(work / "spare-ready")],
                           (READY, work / "spare-ready"))}
    codes, took = {}, {}
    for name, (launcher, argv, on_line) in runs.items():
        print(f"make demo: {name} run ({' '.join(launcher[:2])}) ...", flush=True)
        started = time.monotonic()
        codes[name] = launch(work, name, launcher, argv, args.timeout, on_line)
        took[name] = time.monotonic() - started
    rows = {}
    for name, title in (("torchrun", "torchrun (restarts every worker)"),
                        ("robustdist", "robustdist run (warm spare)")):
        gap = kill_to_next_step(work / name)
        verdict = f"FAILED (exit {codes[name]}; straight run exit {codes['straight']})" \
            if codes[name] != 0 or codes["straight"] != 0 else "NOT A RECOVERY (no kill, or no step after it)" \
            if gap is None else same_as(work / name, work / "straight")
        rows[name] = (title, gap, verdict)
    print("\n== robustdist demo: rank 1 SIGKILLed mid-run, recovered two ways ==")
    print(f"job                      2 CPU ranks, DDP + SyncBatchNorm, dropout, SGD + StepLR, {args.steps} steps; "
          f"durable checkpoint every {args.every}, in-memory every step")
    for name, (title, gap, verdict) in rows.items():
        print(f"\n{title}")
        print("  killed at step         " + (str(gap[1]) if gap else "-"))
        print("  kill -> next step      " + (f"{gap[0]:.2f} s (on every rank)" if gap else "- (no step after a kill)"))
        print(f"  vs the straight run    {verdict}")
        print(f"  wall time, log         {took[name]:.1f} s, {work / (name + '.log')}")
    print(f"\nthe straight run: {took['straight']:.1f} s, {work / 'straight.log'}. The killed rank's tracebacks are "
          "expected: they are in the logs.")
    ok = all(verdict == "BITWISE EQUAL" for _, _, verdict in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
