"""The port tests' torchrun runs: launch a client under ``torchrun --standalone --nproc_per_node=2
--max-restarts=1`` with a clean launcher environment, wait for a set of runs against one deadline (killing the
whole process group of a run that overstays), and read what each rank wrote; :func:`shared_straight` makes a
deterministic straight run once per test session for every test that compares against it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID")


def launch(client: Path, workdir: Path, tag: str, *args: str, max_restarts: int = 1, nproc: int = 2,
           launcher: tuple[str, ...] = ("torch.distributed.run",), env: dict[str, str] | None = None
           ) -> subprocess.Popen:
    """Start ``client --workdir workdir --tag tag *args`` on ``nproc`` ranks, ``max_restarts`` restarts allowed, in a session
    of its own, by ``python -m <launcher>`` (torchrun; ``("robustdist", "run")`` for robustdist's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    own_tmp = workdir.parent / f"tmp-{tag}"  # torchrun's own temporary log directory goes here, not in /tmp, where
    own_tmp.mkdir(exist_ok=True)  # torchrun leaves it behind (the caller's TMPDIR wins)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(own_tmp), **(env or {})}
    for var in _LAUNCHER_VARS:
        env.pop(var, None)
    cmd = [sys.executable, "-m", *launcher, "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
           str(client), "--workdir", str(workdir), "--tag", tag, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, tuple[int, str]]:
    """Wait for every run within ``timeout`` seconds in all; fail the test (killing it) for one that does not end.
    Returns ``tag -> (exit code, output)``; whatever is still running on the way out is killed."""
    deadline = time.monotonic() + timeout
    outs = {}
    try:
        for tag, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                pytest.fail(f"torchrun ({tag}) did not finish within {timeout:g} s (killed):\n{out[-4000:]}")
            outs[tag] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return outs


def succeeded(outs: dict[str, tuple[int, str]]) -> dict[str, str]:
    """Each run's output, after asserting that every run exited 0."""
    for tag, (code, out) in outs.items():
        assert code == 0, f"{tag}:\n{out[-4000:]}"
    return {tag: out for tag, (_, out) in outs.items()}


def results(workdir: Path, tag: str, ranks: int = 2) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """What each rank of run ``tag`` wrote: ``result-<tag>-rank<r>.json`` and ``final-<tag>-rank<r>.pt``."""
    return [(json.loads((workdir / f"result-{tag}-rank{r}.json").read_text()),
             torch.load(workdir / f"final-{tag}-rank{r}.pt", weights_only=True)) for r in range(ranks)]


def straight_and_killed(client: Path, base: Path, kill_at: int, timeout: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Run ``client`` straight (tag ``straight``, in ``base/s``) and with ``--kill-at kill_at`` (tag ``killed``, in
    ``base/k``) side by side; returns ``(tag -> results, tag -> output)``."""
    where = {"straight": base / "s", "killed": base / "k"}
    logs = succeeded(finish({"straight": launch(client, where["straight"], "straight"),
                             "killed": launch(client, where["killed"], "killed", "--kill-at", str(kill_at))}, timeout))
    return {tag: results(w, tag) for tag, w in where.items()}, logs


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A directory ``make`` filled once per test session, for every test (on any pytest-xdist worker) that asks for
    the same ``name``: the first to ask calls ``make(directory)`` holding a file lock in the session's base temporary
    directory (the one all workers share), the others wait for the lock and read what it made. Only for what is the
    same whoever makes it (a deterministic run). Its outcome is recorded: a ``make`` that raised or failed the test
    (a run that overstayed) fails every test that asks for it, with its error. A worker killed while making it
    leaves no outcome: the next to ask makes it again, in a directory of its own (processes the killed one started
    may still be writing into theirs)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # each worker's base is a folder of the session's
    key = f"once-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    outcome = base / f"{key}.json"
    with FileLock(str(base / f"{key}.lock")):
        if not outcome.exists():
            made = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=base))
            try:
                make(made)
                error = None
            except (Exception, pytest.fail.Exception):
                error = traceback.format_exc()[-6000:]
            outcome.write_text(json.dumps({"name": name, "directory": made.name, "error": error}))
    recorded = json.loads(outcome.read_text())
    if recorded["error"] is not None:
        pytest.fail(f"the session's shared {name} failed:\n{recorded['error']}")
    return base / recorded["directory"]


def shared_straight(tmp_path_factory: pytest.TempPathFactory, client: Path, *args: str, timeout: float) -> Path:
    """The directory of a straight run of ``client *args`` (tag ``straight``, torchrun, 2 ranks; read it with
    :func:`results`), made once per test session (:func:`once_per_session`) for every test that compares against
    it: a deterministic client's straight run ends with the same results whoever starts it. A run that failed or
    overstayed ``timeout`` fails every test that asks for it, with its output. torchrun's ``TMPDIR`` (where it
    leaves its log directory) is the returned directory's ``parent / "tmp-straight"``."""
    def run(root: Path) -> None:
        succeeded(finish({"straight": launch(client, root / "run", "straight", *args)}, timeout))

    return once_per_session(tmp_path_factory, " ".join(("straight run of", str(client), *args)), run) / "run"
