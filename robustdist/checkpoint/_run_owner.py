"""Which run a checkpoint directory belongs to: ``<dir>/.robustdist-run.json``, so runs never mix.

A Tune trial (another learning rate) that "resumes" trial 1's model trains nothing and reports nonsense; so
does a job pointed at another job's directory. The first run that writes into a directory records its
identity (:class:`RunIdentity`: the run's name, and a fingerprint of its training configuration); a later run
whose identity differs is refused with :class:`~robustdist.runtime.errors.CheckpointError` naming both, before
anything is read or written. A field that is None on either side is not compared (an unnamed job may resume a
named run's directory, and the other way round), so the guard bites where an identity exists: inside Ray Train
(the run's ``RunConfig.name`` and its ``train_loop_config``), and wherever ``checkpoint.run_name`` is set.

The record is input like any checkpoint file: read through :mod:`._safeio` (confined, a regular file, at most
64 KiB), parsed as JSON and validated; a malformed record is refused (a named error with the fix), never
adopted or overwritten, since overwriting it would let any run take any directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._layout import committed_steps
from robustdist.runtime.dist import Collectives
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError
from robustdist.runtime.log import get_logger
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["RUN_RECORD", "RunIdentity", "claim"]

log = get_logger(__name__)
RUN_RECORD = ".robustdist-run.json"
TUNE_TRIAL_SOURCE = "Ray Tune trial"
"""How the identity of a Ray Tune function trainable's trial starts its ``source``."""
_MAX_BYTES = 64 << 10
_MAX_FIELD = 1024


@dataclass(frozen=True)
class RunIdentity:
    """``run``: the run's name (Ray Train's ``RunConfig.name``, or ``checkpoint.run_name``); ``config``: a
    fingerprint of its training configuration (Ray Train's ``train_loop_config``); ``source``: where they came
    from, for messages."""

    run: str | None = None
    config: str | None = None
    source: str = "checkpoint.run_name"

    @property
    def empty(self) -> bool:
        return self.run is None and self.config is None

    def describe(self) -> str:
        parts = [f"run {self.run!r}" if self.run is not None else "an unnamed run"]
        if self.config is not None:
            parts.append(f"training config {self.config}")
        return f"{' with '.join(parts)} ({self.source})"


def claim(directory: str, identity: RunIdentity, rank: int, collectives: Collectives) -> None:
    """Check that ``directory`` belongs to ``identity``'s run, recording it when the directory has no record.
    Collective: rank 0 decides, every rank raises the same :class:`CheckpointError`."""
    message: str | None = None
    if rank == 0:
        try:
            message = _claim(directory, identity)
        except CheckpointError as e:
            message = str(e)
        except Exception as e:  # an unwritable directory, say: every rank learns why, not a collective failure
            message = (f"could not record or check the run record in {directory} ({type(e).__name__}: "
                       f"{str(e)[:300]}); expected a writable checkpoint directory. Fix: check its permissions "
                       "and free space.")
    message = collectives.broadcast(message, "run identity")
    if message:
        raise CheckpointError(message, rank=collectives.rank if collectives.world_size > 1 else None)


def _claim(directory: str, identity: RunIdentity) -> str | None:
    recorded = _read(directory)
    path = os.path.join(directory, RUN_RECORD)
    if recorded is None:
        if identity.empty:
            return None
        steps = committed_steps(directory)
        if steps:
            log.info("%s holds %d checkpoint(s) but no run record: recording %s as its run", directory, len(steps),
                     identity.describe())
        if not _create(directory, identity):  # another run created it meanwhile: compare with that one
            return _claim(directory, identity)
        return None
    clashes = [f for f in ("run", "config") if getattr(identity, f) is not None and recorded.get(f) is not None
               and getattr(identity, f) != recorded[f]]
    if not clashes:
        if (identity.run is not None and recorded.get("run") is None) or \
                (identity.config is not None and recorded.get("config") is None):
            _write(directory, RunIdentity(identity.run or recorded.get("run"), identity.config or recorded.get("config"),
                                          identity.source))
        return None
    theirs = RunIdentity(recorded.get("run"), recorded.get("config"), str(recorded.get("source", "unknown")))
    if identity.source.startswith(TUNE_TRIAL_SOURCE):
        how = ("drop checkpoint.run_name: each Ray Tune trial then gets <checkpoint.dir>/<experiment>/<trial id> "
               "of its own")
    else:
        how = ("give each run its own checkpoint.dir (inside Ray Train robustdist already uses "
               "<checkpoint.dir>/<RunConfig.name>, so name each Tune trial's run after the trial, e.g. "
               "RunConfig(name=f\"trial-{tune.get_context().get_trial_id()}\"))")
    return (f"checkpoint directory {directory} belongs to {theirs.describe()}, but this is {identity.describe()} "
            f"(they differ in: {', '.join(clashes)}); expected a directory of this run's own, so another run's "
            f"checkpoints are never resumed from or written over. Fix: {how}, or, if the old run is finished with, "
            f"delete {path} (its checkpoints then count as this run's, and are resumed).")


def _read(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, RUN_RECORD)
    try:
        with Confined(directory) as folder:
            raw = folder.read(RUN_RECORD, max_size=_MAX_BYTES)
        if raw is None:
            return None
        record = json_value(raw, _MAX_BYTES)
    except (CheckpointCorruptError, Unreadable) as e:
        raise CheckpointError(_malformed(path, f"{type(e).__name__}: {str(e)[:200]}")) from None
    if not isinstance(record, dict) or record.get("format") != 1:
        raise CheckpointError(_malformed(path, "not a format-1 run record"))
    for key in ("run", "config", "source"):
        value = record.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > _MAX_FIELD):
            raise CheckpointError(_malformed(path, f"{key} is {type(value).__name__}, expected a short string or null"))
    return record


def _malformed(path: str, why: str) -> str:
    return (f"{path}: the run record is unreadable ({why}); expected the JSON robustdist writes, naming the run "
            "the directory belongs to. It is not adopted or overwritten, so no run can take over a directory by "
            f"damaging it. Fix: if this directory's checkpoints are yours, delete {path} (the next run records "
            "itself); otherwise use another checkpoint.dir.")


def _create(directory: str, identity: RunIdentity) -> bool:
    """Create the record only if there is none (:meth:`Confined.create`, a hard link that fails when the name
    exists), so two runs starting at once cannot both claim the directory. False when another record got there
    first."""
    with Confined(directory) as folder:
        return folder.create(RUN_RECORD, _encoded(identity))


def _encoded(identity: RunIdentity) -> bytes:
    record = {"format": 1, "run": identity.run, "config": identity.config, "source": identity.source}
    return json.dumps(record).encode("utf-8")


def _write(directory: str, identity: RunIdentity) -> None:
    """Replace the record (the same run filling in a field the first writer did not know)."""
    with Confined(directory) as folder:
        folder.write(RUN_RECORD, _encoded(identity))
