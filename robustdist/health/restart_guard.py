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
bounded and confined, validated (attempts strictly increase), and a record that is not valid is replaced with a
warning, never trusted. Both are written by :mod:`robustdist.checkpoint._confined`'s rule (a new file renamed
into place, never through a link or a hard link, deletes only of the error files' own names). A record that
cannot be written (a directory planted at its name, a read-only directory) is a
:class:`~robustdist.runtime.errors.CheckpointError` at that ``resume()``, never a guard silently off.
Attempt 0 (a fresh launch) and a launch with another ``TORCHELASTIC_RUN_ID`` start a new record.
"""

from __future__ import annotations

import json
import os
import re
import traceback
from typing import TYPE_CHECKING, Any

from robustdist.checkpoint._confined import Confined
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, RestartLoopError
from robustdist.runtime.log import get_logger
from robustdist.runtime.stored import Unreadable, json_value

if TYPE_CHECKING:
    from robustdist.checkpoint import AtomicCheckpointer, CheckpointInfo

__all__ = ["RECORD", "ProgressMarks", "begin", "mark_progress", "record_error", "resumed"]

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
            and all(a < b for a, b in zip(record["attempts"], record["attempts"][1:]))  # attempts only increase
            and isinstance(record["progress"], bool))


def _read(directory: str) -> dict[str, Any] | None:
    try:
        with Confined(directory) as folder:
            raw = folder.read(RECORD, max_size=MAX_RECORD_BYTES)
        if raw is None:
            return None
        record = json_value(raw, MAX_RECORD_BYTES)
    except (CheckpointCorruptError, Unreadable) as e:
        log.warning("the restart record %s is unreadable (%s); starting a new one", os.path.join(directory, RECORD),
                    str(e)[:200])
        return None
    if not _valid(record):
        log.warning("the restart record %s is not one robustdist writes; starting a new one",
                    os.path.join(directory, RECORD))
        return None
    return record


def _write(directory: str, record: dict[str, Any]) -> None:
    """Atomically replace the record (:meth:`Confined.write`: a new file renamed over the name, so nothing planted
    is written through). A record that cannot be written is a :class:`CheckpointError`: a guard that cannot count
    is not silently switched off."""
    try:
        with Confined(directory) as folder:
            folder.write(RECORD, json.dumps(record).encode("utf-8"))
    except CheckpointError as e:
        raise CheckpointError(f"the restart-loop guard cannot write its record: {e.message} (the guard counts "
                              "attempts there; it is never switched off silently, since a crash loop would then run "
                              "until --max-restarts runs out)") from None


def _write_later(directory: str, record: dict[str, Any]) -> None:
    """A write after ``begin`` (which raised if the record could not be written at all): on rank 0 alone, or
    on a commit's background thread, where raising would leave the other ranks in a collective; warn instead."""
    try:
        _write(directory, record)
    except CheckpointError as e:
        log.warning("%s", e)


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
    if limit == 1:
        found = f"restart attempt {shown} resumed from {where} (or crashed while resuming) and committed no newer"
    else:
        found = (f"{limit} restart attempts in a row ({shown}) resumed from {where} (or crashed while resuming) and "
                 "none committed a newer")
    return (f"{found} checkpoint; this is attempt {attempt}. Expected progress between restarts, so this is "
            f"a crash loop (it would burn the cluster until --max-restarts runs out). Last errors: {errors}. Fix: fix "
            f"the cause above (a bad batch near {where}, a failing node, a bug), then relaunch: a fresh launch "
            f"(attempt 0) starts a new count; or raise health.max_restarts_without_progress. The record is "
            f"{os.path.join(directory, RECORD)}.")


def resumed(directory: str, step: int | None) -> None:
    """Rank 0, after the load: note the step this attempt resumed from (for the message of a later attempt)."""
    record = _read(directory)
    if record is not None and record["job"] == _job() and record["step"] != step:
        record["step"] = step
        _write_later(directory, record)


def mark_progress(directory: str, committed: int) -> None:
    """Rank 0, once per attempt: a step newer than the one resumed from is committed (in either tier)."""
    record = _read(directory)
    if record is None or record["progress"]:
        return
    record["progress"] = True
    _write_later(directory, record)
    log.debug("restart record: step %d committed after resuming from %s", committed, record["step"])


def record_error(directory: str, attempt: int, rank: int, error: BaseException) -> None:
    """Keep the error that ended this rank's attempt (bounded), for the guard's message. Never raises: it runs
    while an exception is already leaving ``with harden(...)``."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()[:MAX_ERROR_BYTES]
    try:
        with Confined(directory) as root, root.sub(ERRORS, create=True) as folder:
            folder.write(f"attempt_{attempt}_rank_{rank}.txt", text.encode("utf-8", "replace"), durable=False)
    except CheckpointError as e:
        log.warning("could not record the error that ended attempt %d on rank %d: %s", attempt, rank, e)


def _clear_errors(directory: str) -> None:
    try:
        with Confined(directory) as root:
            if root.kind(ERRORS) is None:
                return
            with root.sub(ERRORS) as folder:
                for name in folder.names():
                    if _ERROR_FILE.fullmatch(name):
                        folder.remove(name, _ERROR_FILE)
    except CheckpointError as e:
        log.warning("could not clear the recorded errors of earlier attempts: %s", e)


def _last_errors(directory: str, attempts: list[int]) -> str:
    found: list[tuple[int, int, str]] = []
    wanted = set(attempts)
    try:
        with Confined(directory) as root, root.sub(ERRORS) as folder:
            for name in sorted(folder.names())[:4096]:
                m = _ERROR_FILE.fullmatch(name)
                if not m or int(m.group(1)) not in wanted:
                    continue
                try:
                    raw = folder.read(name, max_size=MAX_ERROR_BYTES)
                except CheckpointCorruptError:
                    continue
                lines = [line for line in (raw or b"").decode("utf-8", "replace").splitlines() if line.strip()]
                found.append((int(m.group(1)), int(m.group(2)), (lines[-1] if lines else "")[:300]))
    except CheckpointError:
        pass  # no errors folder (or one that is not a directory): none recorded
    found.sort()
    if not found:
        return ("none recorded (a rank killed by a signal or the OOM killer records none; see the launcher's log "
                "and dmesg)")
    return "; ".join(f"attempt {a} rank {r}: {t}" for a, r, t in found[-6:])


class ProgressMarks:
    """The guard in ``Hardened`` (a mixin): the attempt counted at ``resume()``, the step resumed from, and the
    first commit newer than it marking progress. ``Hardened`` holds ``checkpointer``, ``_resumed_from``, ``_progress_marked`` and
    ``_pending`` (durable async saves not known to have committed yet)."""

    checkpointer: AtomicCheckpointer | None
    _resumed_from: int | None
    _progress_marked: bool
    _pending: list[CheckpointInfo]

    def _resumed(self, step: int | None) -> None:
        assert self.checkpointer is not None
        self._resumed_from, self._progress_marked, self._pending = step, False, []
        if self.checkpointer.rank == 0:
            resumed(self.checkpointer.directory, step)

    def _committed(self, step: int) -> None:
        """A step is committed (a durable save, or an in-memory one completing on its background thread): on rank
        0, the first one newer than the step resumed from marks progress in the restart record."""
        if self._progress_marked or self.checkpointer is None:
            return
        if self._resumed_from is None or step > self._resumed_from:
            self._progress_marked = True
            if self.checkpointer.rank == 0:
                mark_progress(self.checkpointer.directory, step)

    def _guard_restarts(self, attempt: int, limit: int, err_rank: int | None) -> None:
        """The guard, at ``resume()`` before anything is loaded: rank 0 counts this attempt and decides, every rank
        raises the same error (a crash loop, or a record that cannot be kept)."""
        assert self.checkpointer is not None
        verdict: tuple[str, str] | None = None
        if self.checkpointer.rank == 0:
            try:
                message = begin(self.checkpointer.directory, attempt=attempt, limit=limit)
                verdict = ("loop", message) if message else None
            except CheckpointError as e:  # every rank learns why, not a collective that names nothing
                verdict = ("record", e.message)
        verdict = self.checkpointer.collectives.broadcast(verdict, "restart guard")
        if verdict is not None:
            kind, message = verdict
            raise (RestartLoopError if kind == "loop" else CheckpointError)(message, rank=err_rank)

    def _mark_progress(self) -> None:
        """Durable async saves commit in the background: look at them at the next save."""
        for info in self._pending:
            if info.done.is_set() and info.total_seconds is not None:
                self._committed(info.step)
        self._pending = [i for i in self._pending if not i.done.is_set()]
