"""`make bench-check`: compare benchmarks/results.json with benchmarks/targets.py; exit 1 on any miss.

Timing is not a test (the CI machine is shared and noisy), so this is not part of `make test`: run
`make bench` first, then `make bench-check`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets import TARGETS, judge  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else Path(__file__).resolve().parent / "results.json"
    if not path.exists():
        print(f"make bench-check: {path} does not exist; run `make bench` first.")
        return 1
    results = json.loads(path.read_text())["benchmarks"]
    misses = 0
    for bench_id, key, op, threshold, meaning in TARGETS:
        value = results.get(bench_id, {}).get("metrics", {}).get(key)
        if value is None:
            print(f"MISSING {bench_id} {key}: not in results.json ({meaning})")
            misses += 1
            continue
        verdict = judge(op, value, threshold)
        label = "REPORT " if verdict is None else "MET    " if verdict else "MISSED "
        target = "" if verdict is None else f" (target {op} {threshold:g})"
        print(f"{label}{bench_id} {key} = {value:.4g}{target}: {meaning}")
        misses += verdict is False
    print(f"make bench-check: {misses} target(s) missed" if misses else "make bench-check: every target met")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
