"""`make bench-check`: compare benchmarks/results.json with benchmarks/targets.py; exit 1 on any miss.

Timing is not a test (the CI machine is shared and noisy), so this is not part of `make test`: run
`make bench` first, then `make bench-check`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets import evaluate, missed, summary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else Path(__file__).resolve().parent / "results.json"
    if not path.exists():
        print(f"make bench-check: {path} does not exist; run `make bench` first.")
        return 1
    verdicts = evaluate(json.loads(path.read_text())["benchmarks"])
    for v in verdicts:
        if v.value is None:
            print(f"MISSING {v.bench_id} {v.key}: not in results.json ({v.meaning})")
            continue
        label = {"report": "REPORT ", "met": "MET    ", "missed": "MISSED "}[v.status]
        target = "" if v.met is None else f" (target {v.op} {v.threshold:g})"
        print(f"{label}{v.bench_id} {v.key} = {v.value:.4g}{target}: {v.meaning}")
    print(summary(verdicts))
    return 1 if missed(verdicts) else 0


if __name__ == "__main__":
    raise SystemExit(main())
