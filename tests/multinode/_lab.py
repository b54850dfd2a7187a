"""Helpers for the lab tests: run the job script in nodes, read what each rank recorded, wait with a bound."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
JOB = str(Path(__file__).with_name("job.py"))
DEMO = str(ROOT / "examples" / "resilient_training.py")
TUTORIAL = str(ROOT / "tests" / "clients" / "ddp_tutorial_inprocess.py")  # the DDP-tutorial client
STRAIGHT_EPOCHS = 6  # its lab runs on 2 ranks (8 steps an epoch): the session's straight run (conftest.py)
# Fast failure detection for the lab: the agents' keep-alive and the rendezvous' last call.
FAST_RDZV = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2, "join_timeout": 60}


def events(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return sorted(out, key=lambda e: e["time"])


def of(evs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["event"] == kind]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, *, lab: Any = None,
             procs: Sequence[subprocess.Popen[bytes]] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if procs and all(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (logs(lab) if lab else ""))


def finish(procs: Sequence[subprocess.Popen[bytes]], timeout: float, lab: Any = None) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent pid {p.pid} still running after {timeout} s" + (logs(lab) if lab else ""))
    return codes


def logs(lab: Any, tail: int = 4000) -> str:
    parts = []
    for path in sorted(Path(lab.log_dir).glob("*.log")):
        text = "\n".join(line for line in path.read_text(errors="replace").splitlines()
                         if "hostname of the client socket" not in line)
        parts.append(f"\n----- {path.name} -----\n{text[-tail:]}")
    return "".join(parts)


def job_args(events_dir: Path, **kwargs: Any) -> list[str]:
    args = ["--events", str(events_dir)]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not None and value is not False:
            args += [flag, str(value)]
    return args


PY = sys.executable
