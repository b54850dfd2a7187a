"""Ray Train (V2) for :class:`~robustdist.harden.Hardened`: the run's identity, reporting committed checkpoints,
Ray's checkpoint as a resume candidate, and a hang raised as the training thread's error.

Ray 2.60 runs Train V2 by default: the training function runs in a thread of each worker actor
(``TrainingThread(...)``), the controller polls the workers, and a worker's error is whatever the training
thread raised or a nested thread put on the thread runner's exception queue (which Ray's own background
checkpoint upload uses). All of this module's Ray calls are inside functions; it only looks at Ray when ray is
already imported in the process (a Ray Train worker always has it), so importing robustdist imports no Ray.

* :func:`current` says whether this process is a Ray Train V2 worker, and the run's identity: its
  ``RunConfig.name`` (Ray's own identity for a run: the same name and storage resume the same run) and a
  fingerprint of its ``train_loop_config`` (Tune trials differ there).
* :func:`report` reports a committed checkpoint: every rank reports its own part of the step directory
  (hard links in a scratch directory next to it), Ray merges the parts into one checkpoint directory in the
  run's storage, named ``step_<step>-<manifest crc>``. ``ray.train.report`` is a barrier: every rank calls it
  the same number of times, which ``Hardened`` keeps by reporting only at collective points.
* :func:`latest_checkpoint` is ``ray.train.get_checkpoint()``; :func:`checkpoint_step` reads its step from
  its manifest (validated like any checkpoint manifest).
* :func:`raise_in_training_thread` puts an error on the thread runner's exception queue: the controller then
  reports "rank r: HangError: ..." and ``FailureConfig`` restarts the group, instead of the "SYSTEM_ERROR ...
  possibly killed by the OOM killer" an exiting worker gets. Ray Train V2 internals: used only when present,
  with the exit code as the fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from robustdist.runtime import _ray_train_compat, _tune_compat
from robustdist.runtime.log import get_logger

__all__ = ["RayTrain", "TuneTrial", "checkpoint_step", "current", "current_trial", "json_metrics", "latest_checkpoint",
           "manifest_digest", "raise_in_training_thread", "report", "report_metrics"]

log = get_logger(__name__)
STAGE_PREFIX = ".ray-report-"
REGISTER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RayTrain:
    """This worker's Ray Train run: ``run_name`` (``RunConfig.name``), ``config`` (a fingerprint of the run's
    ``train_loop_config``, or None where Ray does not expose it), ``world_rank``."""

    run_name: str
    config: str | None
    world_rank: int


def current() -> RayTrain | None:
    """The Ray Train V2 run this process is a worker of, or None (no ray imported, not a worker, Train V1)."""
    if "ray" not in sys.modules:
        return None
    internal = _ray_train_compat.train_context()
    if internal is None:
        return None
    try:
        import ray.train

        ctx = ray.train.get_context()
        name, rank = str(ctx.get_experiment_name()), int(ctx.get_world_rank())
    except Exception as e:  # a worker whose public context is not there: treat as outside Ray Train
        log.debug("no Ray Train context: %s", e)
        return None
    config = _ray_train_compat.train_loop_config(internal)
    return RayTrain(run_name=name, config=fingerprint(config) if config is not None else None, world_rank=rank)


@dataclass(frozen=True)
class TuneTrial:
    """The Ray Tune trial this process runs: its experiment's name, its trial id, and ``function``: whether it
    is a function trainable's own process (False: a Ray Train V1 worker of the trial, one of several ranks)."""

    experiment: str
    trial_id: str
    function: bool = True


def current_trial() -> TuneTrial | None:
    """The Ray Tune trial this process runs as a function trainable, or None (Ray Tune not imported, or not in a
    trial). Ray Train V2 workers are told apart by :func:`current` first."""
    if "ray.tune" not in sys.modules:
        return None
    found = _tune_compat.tune_trial()
    return TuneTrial(experiment=found[0], trial_id=found[1], function=found[2]) if found is not None else None


def fingerprint(config: Any) -> str:
    """A stable fingerprint of a ``train_loop_config``: its plain values hashed as canonical JSON. Numbers,
    strings, bools and None count by value (numpy scalars and one-element tensors too, through ``.item()``),
    dicts, lists and tuples by their items, dataclasses by their fields; any other object counts by its type's
    name only (its repr may hold a memory address that differs on every restart), as does a dict key that is
    not a str, number or bool. At most 10,000 values are looked at, so a self-referencing config cannot hang."""
    budget = [10_000]
    text = json.dumps(_plain(config, 0, budget), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(value: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if depth > 32 or budget[0] < 0:
        return "<cut>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if type(value).__module__ == "numpy" or (hasattr(value, "numel") and hasattr(value, "item")):
        try:
            return _plain(value.item(), depth + 1, budget)
        except (ValueError, RuntimeError, TypeError, AttributeError):
            pass
    if isinstance(value, Mapping):
        return {_key(k): _plain(v, depth + 1, budget) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1, budget) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), depth + 1, budget) for f in dataclasses.fields(value)}
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _key(key: Any) -> str:
    if isinstance(key, (str, int, float, bool)) or key is None:
        return repr(key)
    return f"<{type(key).__module__}.{type(key).__qualname__}>"


def ray_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` as Ray accepts them: one-element tensors and numpy scalars as python numbers (Ray refuses
    tensors in metrics), everything else as given."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and callable(value.item) and not isinstance(value, (int, float, str, bool)):
            try:
                value = value.item()
            except (ValueError, RuntimeError, TypeError):
                value = str(value)[:200]
        out[str(key)] = value
    return out


def json_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` as plain JSON for the manifest: one-element tensors and numpy scalars become numbers,
    non-finite numbers their repr, anything else its str (at most 200 characters)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (ValueError, RuntimeError, TypeError):
                value = str(value)[:200]
        if isinstance(value, float) and not math.isfinite(value):
            value = repr(value)
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            value = str(value)[:200]
        out[str(key)] = value
    return out


def _owner(name: str, world_size: int) -> int:
    """Which rank reports a file of the step directory: its own per-rank and sharded files, rank 0 the rest."""
    base = os.path.basename(name)
    if name.startswith("rank_") and name.endswith(".pt"):
        digits = name[len("rank_"):-len(".pt")]
        if digits.isdigit() and int(digits) < world_size:
            return int(digits)
    if name.startswith("sharded/__") and base.endswith(".distcp"):
        digits = base[2:].split("_", 1)[0]
        if digits.isdigit() and int(digits) < world_size:
            return int(digits)
    return 0


def _stage(step_dir: str, rel: str, stage: Any, size: int | None) -> None:
    """Put the committed file ``<step_dir>/<rel>`` into ``stage`` (a :class:`~robustdist.checkpoint._confined.
    Confined` staging directory) for Ray to upload: opened confined (no link at any level, a regular file, the size
    its manifest records), refused if it has other names (a hard link to a file elsewhere), then given its name in
    the stage from the open descriptor, so what Ray uploads is the file checked, not whatever a swap put at the
    name since; the stage's subdirectories are walked without following links too."""
    from robustdist.checkpoint._safeio import open_in
    from robustdist.checkpoint._schema import MAX_MANIFEST_BYTES
    from robustdist.runtime.errors import CheckpointCorruptError

    with open_in(step_dir, rel, size=size, max_size=None if size is not None else MAX_MANIFEST_BYTES) as fh:
        links = os.fstat(fh.fileno()).st_nlink
        if links != 1:
            raise CheckpointCorruptError(
                f"{os.path.join(step_dir, rel)}: has {links} names (a hard link, possibly to a file outside the "
                "checkpoint); refused, so nothing but the files robustdist committed reaches Ray's storage. Fix: "
                "remove it; the next save writes a new checkpoint.")
        parts = rel.split("/")
        opened = []
        try:
            folder = stage
            for part in parts[:-1]:
                folder = folder.sub(part, create=True)
                opened.append(folder)
            folder.adopt(fh, parts[-1])
        finally:
            for inner in opened:
                inner.close()


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """A short digest of a checkpoint's manifest: names one committed checkpoint (its step, files and sums)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:8]


def report(metrics: Mapping[str, Any], step_dir: str, manifest: Mapping[str, Any], *, rank: int,
           world_size: int, timeout: float = REGISTER_TIMEOUT_S,
           agree: Callable[[str | None], None] | None = None, tune: bool = False) -> str:
    """Report a committed checkpoint to Ray Train: this rank's part of ``step_dir`` (the files the manifest lists
    that this rank wrote; rank 0 adds the manifest and the replicated state). Collective (a Ray barrier). Then
    wait (at most ``timeout``) until Ray's controller has registered it. Returns the checkpoint's directory name
    in Ray's storage. ``tune``: to Ray Tune instead, from a function trainable's trial (one process:
    ``ray.tune.report``, which persists the checkpoint before it returns, and may end the trial's thread with
    ``SystemExit`` when Tune stops or resets the trial).

    ``agree``: called on every rank with this rank's staging problem (None: staged), before Ray's barrier; it
    must raise on every rank if any rank's staging failed (robustdist's own collective, which a fault can cut:
    Ray's barrier cannot be, so no rank enters it while another will not)."""
    import ray.train

    from robustdist.checkpoint._confined import Confined
    from robustdist.runtime.dist import uncuttable
    from robustdist.runtime.errors import CheckpointError

    files = [n for n in manifest.get("files", {}) if _owner(n, world_size) == rank]
    name = f"{os.path.basename(step_dir)}-{manifest_digest(manifest)}"
    parent = os.path.dirname(step_dir)
    prefix = f"{STAGE_PREFIX}{rank}-"
    ours = re.compile(re.escape(prefix) + r"[A-Za-z0-9_]{1,64}")  # this rank's scratch (older ones: mkdtemp's)
    stage_name = f"{prefix}{uuid.uuid4().hex[:12]}"
    stage = os.path.join(parent, stage_name)
    made = False
    try:
        problem: Exception | None = None
        try:  # everything up to Ray's barrier: a failure here is told to every rank first (agree), then raised
            with Confined(parent) as folder:
                for leftover in folder.names():  # this rank's scratch from an attempt killed mid-report (its own)
                    if ours.fullmatch(leftover):
                        with contextlib.suppress(CheckpointError):
                            folder.remove_tree(leftover, ours)
                staged = folder.sub(stage_name, fresh=True, mode=0o700)
                made = True
            with staged:
                for rel in files + (["manifest.json"] if rank == 0 else []):
                    entry = manifest.get("files", {}).get(rel)
                    _stage(step_dir, rel, staged, entry.get("size") if isinstance(entry, dict) else None)
                checkpoint = ray.train.Checkpoint.from_directory(stage) if staged.names() else None
        except Exception as e:
            problem = e
        if agree is not None:
            try:
                agree(None if problem is None else f"{type(problem).__name__}: {str(problem)[:500]}")
            except BaseException as e:
                if problem is not None:
                    raise e from problem
                raise
        if problem is not None:
            raise problem
        if tune:
            import ray.tune

            ray.tune.report(dict(metrics), checkpoint=ray.tune.Checkpoint.from_directory(stage))
            return name
        with uncuttable("ray.train.report", lambda m: CheckpointError(m, rank=rank)):
            ray.train.report(dict(metrics), checkpoint=checkpoint, checkpoint_dir_name=name)
    finally:
        try:
            if made:
                with Confined(parent) as folder:
                    folder.remove_tree(stage_name, ours)
        except CheckpointError as e:
            log.warning("could not remove the report's scratch directory %s: %s", stage, e)
    _wait_registered(name, timeout)
    return name


def _wait_registered(name: str, timeout: float) -> None:
    """Wait until Ray's controller has registered the reports made so far. ``ray.train.report`` returns once the
    files are uploaded, but the controller registers a report only when it next polls the workers (every 2 s by
    default): a worker that dies in between loses it, and ``get_checkpoint()`` after the restart is one
    checkpoint older. ``ray.train.get_all_reported_checkpoints`` (alpha in 2.60) waits for that; without it
    (older Ray: said once) the gap stays, and resume still takes robustdist's own newer copy."""
    try:
        _ray_train_compat.wait_reported_checkpoints(timeout)
    except Exception as e:  # a timeout or a controller that is going away: the report itself happened
        log.warning("Ray Train's controller had not registered checkpoint %s after %g s (%s: %s); if this worker "
                    "fails now, Ray's newest checkpoint is the one before it", name, timeout, type(e).__name__, e)


def report_metrics(metrics: Mapping[str, Any], *, tune: bool = False) -> None:
    """Report metrics without a checkpoint (collective, like every ``ray.train.report``); ``tune``: to Ray Tune,
    from a function trainable's trial."""
    if tune:
        import ray.tune

        ray.tune.report(dict(metrics))
        return
    import ray.train

    from robustdist.runtime.dist import error_rank, uncuttable
    from robustdist.runtime.errors import CheckpointError

    with uncuttable("ray.train.report", lambda m: CheckpointError(m, rank=error_rank())):
        ray.train.report(dict(metrics))


def latest_checkpoint(*, tune: bool = False) -> Any | None:
    """``ray.train.get_checkpoint()``: the run's newest reported checkpoint, or None. ``tune``: in a Ray Tune
    function trainable, ``ray.tune.get_checkpoint()``: the checkpoint Tune started this trial from (its own
    newest, or another trial's that Tune handed over, as PBT's exploit does)."""
    if tune:
        import ray.tune

        return ray.tune.get_checkpoint()
    import ray.train

    return ray.train.get_checkpoint()


def checkpoint_manifest(checkpoint: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)`` of a Ray checkpoint (validated like any manifest), or ``(None, why)`` when it has no
    valid one or cannot be read (any error: a foreign candidate never escapes as one)."""
    from robustdist.checkpoint._layout import read_manifest

    try:
        with checkpoint.as_directory() as path:
            return read_manifest(path), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def checkpoint_step(checkpoint: Any) -> tuple[int | None, str | None]:
    """``(step, None)`` from a Ray checkpoint's manifest, or ``(None, why)`` when it has no valid one."""
    manifest, why = checkpoint_manifest(checkpoint)
    return (int(manifest["step"]), None) if manifest is not None else (None, why)


def raise_in_training_thread(error: BaseException) -> bool:
    """Make ``error`` this worker's error as Ray Train's controller sees it (the thread runner's exception
    queue). True when it was handed over; False outside Train V2 or where Ray's internals differ (said once)."""
    internal = _ray_train_compat.train_context()
    if internal is None:
        return False
    queue = _ray_train_compat.exception_queue(internal)
    if queue is None:
        return False
    try:
        try:
            raise error
        except BaseException as e:  # noqa: BLE001 - raised here only to give it a traceback
            wrapped = _ray_train_compat.user_exception(e)
        if wrapped is None:
            return False
        queue.put(wrapped)
        return True
    except Exception as e:  # Ray's internals changed: the caller falls back to exiting
        log.warning("could not hand the hang to Ray Train's controller (%s: %s); exiting instead",
                    type(e).__name__, e, all_ranks=True)
        return False
