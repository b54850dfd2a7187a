"""`make bench`: run every ``benchmarks/bench_*.py`` in turn, each in its own interpreter.

Benchmarks compare robustdist with the plain torch/Ray way side by side in one run and report medians and
ratios; timing is never part of `make test`. The benchmark scripts arrive with the issues that own them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).resolve().parent
    scripts = sorted(here.glob("bench_*.py"))
    if not scripts:
        print("make bench: no benchmarks yet (benchmarks/bench_*.py arrive with the checkpoint, bf16 and "
              "benchmark-suite issues); nothing was measured.")
        return 0
    failed = []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)], check=False).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"make bench: failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
