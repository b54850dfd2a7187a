"""The restart-loop guard: stop a job whose restarts make no progress, naming the step and the errors.

A job that crashes on the same step after every restart (a bad batch, a node that keeps failing, an error
the restart cannot fix) otherwise burns the cluster until ``--max-restarts`` runs out, which is often
unbounded. At every ``resume()``, before anything is loaded, rank 0 counts the attempt (the job-wide attempt
number, :attr:`robustdist.harden.Hardened.attempt`) in a record in the durable checkpoint directory
(``.robustdist-restarts.json``), and after the load it notes the step resumed from. A commit newer than the
resumed step, in either tier, marks progress (at once, from the thread that completes it), and the next
resume starts a new record. When ``health.max_restarts_without_progress`` attempts in a row made no progress
(crashing while training, or while resuming), the next ``resume()`` raises
:class:`~robustdist.runtime.errors.RestartLoopError` on every rank before loading anything, naming the step, the
attempts and the last errors they recorded.

Errors are recorded per rank and attempt in ``.robustdist-errors/`` when an exception leaves
``with harden(...) as h:`` (a process killed by a signal or the OOM killer records none, and says so).

The record and the error files are input (the directory may be shared, copied or tampered with): read
bounded and confined, validated, and a record that is not valid is replaced with a warning, never trusted.
Attempt 0 (a fresh launch) and a launch with another ``TORCHELASTIC_RUN_ID`` start a new record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import traceback
import uuid
from typing import Any

from robustdist.checkpoint._safeio import read_in
from robustdist.runtime.errors import CheckpointCorruptError
from robustdist.runtime.log import get_logger

__all__ = ["RECORD", "begin", "mark_progress", "record_error", "resumed"]

log = get_logger(__name__)
RECORD = ".robustdist-restarts.json"
ERRORS = ".robustdist-errors"
MAX_RECORD_BYTES = 64 << 10
MAX_ERROR_BYTES = 4096
MAX_ATTEMPTS_KEPT = 64
_ERROR_FILE = re.compile(r"attempt_(\d{1,9})_rank_(\d{1,6})\.txt")


def _job() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")[:200]


def _valid(record: Any) -> bool:
    return (isinstance(record, dict) and set(record) == {"job", "step", "attempts", "progress"}
            and isinstance(record["job"], str) and len(record["job"]) <= 200
            and (record["step"] is None or (type(record["step"]) is int and 0 <= record["step"] < 2**63))
            and isinstance(record["attempts"], list) and len(record["attempts"]) <= MAX_ATTEMPTS_KEPT
            and all(type(a) is int and 0 <= a < 10**9 for a in record["attempts"])
            and isinstance(record["progress"], bool))


def _read(directory: str) -> dict[str, Any] | None:
    if not os.path.lexists(os.path.join(directory, RECORD)):
        return None
    try:
        record = json.loads(read_in(directory, RECORD, max_size=MAX_RECORD_BYTES).decode("utf-8"))
    except (CheckpointCorruptError, ValueError, RecursionError) as e:
        log.warning("the restart record %s is unreadable (%s); starting a new one", os.path.join(directory, RECORD),
                    str(e)[:200])
        return None
    if not _valid(record):
        log.warning("the restart record %s is not one robustdist writes; starting a new one",
                    os.path.join(directory, RECORD))
        return None
    return record


def _write(directory: str, record: dict[str, Any]) -> None:
    """Atomically replace the record: a new file with a random name (``O_EXCL | O_NOFOLLOW``, so nothing planted
    is written through), then a rename over whatever is at the record's name (a rename replaces a link, never
    follows it)."""
    path = os.path.join(directory, RECORD)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        log.warning("could not write the restart record %s (%s: %s); the restart-loop guard is off for this attempt",
                    path, type(e).__name__, e)


def begin(directory: str, *, attempt: int, limit: int) -> str | None:
    """Rank 0, at ``resume()`` before anything is loaded: count this attempt; the error message when the
    ``limit`` attempts before it all ended without committing anything newer than they resumed from (whether
    they crashed while training or while loading), else None."""
    record = _read(directory)
    if record is None or attempt == 0 or record["job"] != _job() or record["progress"] \
            or (record["attempts"] and attempt <= max(record["attempts"])):
        if record is not None:
            _clear_errors(directory)
        record = {"job": _job(), "step": record["step"] if record else None, "attempts": [], "progress": False}
    earlier = list(record["attempts"])
    record["attempts"] = (earlier + [attempt])[-MAX_ATTEMPTS_KEPT:]
    _write(directory, record)
    if len(earlier) < limit:
        return None
    shown = ", ".join(map(str, earlier[-limit:]))
    where = f"step {record['step']}" if record["step"] is not None else "the start (no checkpoint)"
    errors = _last_errors(directory, earlier[-limit:])
    return (f"{limit} restart attempts in a row ({shown}) resumed from {where} (or crashed while resuming) and none "
            f"committed a newer checkpoint; this is attempt {attempt}. Expected progress between restarts, so this is "
            f"a crash loop (it would burn the cluster until --max-restarts runs out). Last errors: {errors}. Fix: fix "
            f"the cause above (a bad batch near {where}, a failing node, a bug), then relaunch: a fresh launch "
            f"(attempt 0) starts a new count; or raise health.max_restarts_without_progress. The record is "
            f"{os.path.join(directory, RECORD)}.")


def resumed(directory: str, step: int | None) -> None:
    """Rank 0, after the load: note the step this attempt resumed from (for the message of a later attempt)."""
    record = _read(directory)
    if record is not None and record["job"] == _job() and record["step"] != step:
        record["step"] = step
        _write(directory, record)


def mark_progress(directory: str, committed: int) -> None:
    """Rank 0, once per attempt: a step newer than the one resumed from is committed (in either tier)."""
    record = _read(directory)
    if record is None or record["progress"]:
        return
    record["progress"] = True
    _write(directory, record)
    log.debug("restart record: step %d committed after resuming from %s", committed, record["step"])


def record_error(directory: str, attempt: int, rank: int, error: BaseException) -> None:
    """Keep the error that ended this rank's attempt (bounded), for the guard's message."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()[:MAX_ERROR_BYTES]
    try:
        folder = os.path.join(directory, ERRORS)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"attempt_{attempt}_rank_{rank}.txt")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        log.debug("could not record the error of attempt %d: %s", attempt, e)


def _clear_errors(directory: str) -> None:
    folder = os.path.join(directory, ERRORS)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if _ERROR_FILE.fullmatch(name):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def _last_errors(directory: str, attempts: list[int]) -> str:
    folder = os.path.join(directory, ERRORS)
    found: list[str] = []
    try:
        names = sorted(os.listdir(folder))[:4096]
    except OSError:
        names = []
    wanted = set(attempts)
    for name in names:
        m = _ERROR_FILE.fullmatch(name)
        if not m or int(m.group(1)) not in wanted:
            continue
        try:
            text = read_in(folder, name, max_size=MAX_ERROR_BYTES).decode("utf-8", "replace")
        except CheckpointCorruptError:
            continue
        lines = [line for line in text.splitlines() if line.strip()]
        found.append((int(m.group(1)), int(m.group(2)), (lines[-1] if lines else "")[:300]))  # type: ignore[arg-type]
    found.sort()
    if not found:
        return ("none recorded (a rank killed by a signal or the OOM killer records none; see the launcher's log "
                "and dmesg)")
    return "; ".join(f"attempt {a} rank {r}: {t}" for a, r, t in found[-6:])  # type: ignore[misc]
