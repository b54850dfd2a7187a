"""The Ray side of :class:`~robustdist.harden.Hardened`: reporting committed checkpoints to Ray Train (or to Ray
Tune from a function trainable), Ray's checkpoint as a resume candidate, and the report at ``close``. A mixin:
``Hardened`` holds the state these methods use (``ray``, ``tune``, ``checkpointer``, ``identity``, ``state``,
``local``, ``_unreported``, ``_reported``, ``_resumed_from``, ``_adopted``, ``last_metrics``);
:mod:`robustdist.ray.train` does the talking to Ray, :mod:`robustdist.ray.tune` what only Tune needs."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from robustdist.checkpoint import CheckpointInfo, LoadedCheckpoint, _layout
from robustdist.ray import train as _ray_train
from robustdist.ray import tune as _tune
from robustdist.runtime.errors import CheckpointError, ranks_phrase
from robustdist.runtime.log import get_logger

if TYPE_CHECKING:
    import contextlib

    from robustdist.checkpoint import AtomicCheckpointer, LocalTier
    from robustdist.checkpoint._run_owner import RunIdentity
    from robustdist.checkpoint.train_state import TrainState

__all__ = ["RayReporting"]

log = get_logger("robustdist.harden")


class RayReporting:
    """Ray Train (and Ray Tune function trainable) reporting and resume for ``Hardened`` (inert outside both:
    ``ray`` and ``tune`` are None)."""

    ray: _ray_train.RayTrain | None
    tune: _ray_train.TuneTrial | None
    _adopted: dict[str, Any] | None
    _handed: dict[str, Any] | None
    checkpointer: AtomicCheckpointer | None
    identity: RunIdentity | None
    state: TrainState
    local: LocalTier | None
    last_metrics: dict[str, Any] | None
    _unreported: list[tuple[CheckpointInfo, dict[str, Any]]]
    _reported: bool
    _resumed_from: int | None

    def _bounded(self, what: str) -> contextlib.AbstractContextManager[None]:  # pragma: no cover - Hardened's
        raise NotImplementedError

    def _report_committed(self, *, wait: bool) -> int:
        """Inside Ray Train (or a Tune trial), report the committed durable saves not reported yet (collective:
        every rank reaches this at the same calls). ``wait``: first wait for an async save in flight. Returns how
        many were reported."""
        if (self.ray is None and self.tune is None) or self.checkpointer is None or not self._unreported:
            return 0
        sent = 0
        pending, self._unreported = self._unreported, []  # a report that fails is not retried at every save
        if wait:
            with self._bounded("waiting for the previous checkpoint save"):
                self.checkpointer.wait()
        for info, metrics in pending:
            if info.total_seconds is None:  # never committed (its error surfaced already)
                continue
            with self._bounded(f"report to {self._whose()}"):
                try:
                    manifest = _layout.read_manifest(info.path)
                except Exception as e:  # every rank learns it before any enters Ray's barrier
                    try:
                        self._staged_everywhere(info.step, f"reading its manifest: {type(e).__name__}: "
                                                           f"{str(e)[:500]}")
                    except BaseException as named:
                        raise named from e
                    raise
                name = _ray_train.report(_ray_train.ray_metrics(metrics), info.path, manifest,
                                         rank=self.checkpointer.rank, world_size=self.checkpointer.collectives.world_size,
                                         timeout=min(self.checkpointer.timeout, _ray_train.REGISTER_TIMEOUT_S),
                                         agree=lambda problem, step=info.step: self._staged_everywhere(step, problem),
                                         tune=self.tune is not None)
            self._reported = True
            sent += 1
            log.info("reported checkpoint step %d to %s as %s", info.step, self._whose(), name)
        return sent

    def _whose(self) -> str:
        return "Ray Tune" if self.tune is not None else "Ray Train"

    def _report_uncommitted(self, step: int, metrics: Mapping[str, Any] | None, sent: int) -> None:
        """In a Ray Tune trial, ``save(step, metrics=...)`` reports once per call: with its checkpoint when this
        call committed one (:meth:`_report_committed`), otherwise the metrics alone, here."""
        if self.tune is None or metrics is None or sent:
            return
        with self._bounded("report to Ray Tune"):  # Tune's report waits for the driver's next request
            _ray_train.report_metrics(_ray_train.ray_metrics({"step": step, **metrics}), tune=True)
        self._reported = True

    def _staged_everywhere(self, step: int, problem: str | None) -> None:
        """Before Ray's report barrier: every rank's staging outcome; raises the same error on every rank when one
        failed (so none waits in Ray's barrier for a rank that will not come)."""
        assert self.checkpointer is not None
        failed = self.checkpointer.collectives.problems(problem, "report staging")
        if failed:
            detail = "; ".join(f"rank {r}: {p}" for r, p in sorted(failed.items()))
            raise CheckpointError(f"reporting checkpoint step {step} to Ray Train failed: {ranks_phrase(failed)} "
                                  f"could not stage their files ({detail[:1500]}); expected every rank's files "
                                  "staged. Nothing was reported to Ray; robustdist's own checkpoint stays committed. "
                                  "Fix: see the named ranks' errors (a full disk under the checkpoint directory?).",
                                  rank=self.checkpointer.rank, ranks=sorted(failed))

    def _ray_candidate(self, level: int) -> tuple[Any, str, int | None, bool]:
        """Inside Ray Train: Ray's newest reported checkpoint as a resume candidate, ``(checkpoint, why, its step,
        first)``: ``first`` when it is newer than robustdist's newest committed step (then it is tried first;
        otherwise only when robustdist's own copies fail or fall back below it). A checkpoint without a valid
        manifest, or whose manifest names another run, is no candidate. The same on every rank (rank 0 reads,
        broadcasts)."""
        none: tuple[Any, str, int | None, bool] = (None, "", None, False)
        if self.tune is not None and self.checkpointer is not None:
            return self._tune_candidate(level)
        if self.ray is None or self.checkpointer is None:
            return none
        checkpoint = _ray_train.latest_checkpoint()
        facts: tuple[int | None, str | None, int | None] = (None, None, None)
        if self.checkpointer.rank == 0:
            bad: str | None = None
            ray_step: int | None = None
            if checkpoint is not None:
                with self._bounded("reading Ray Train's checkpoint"):
                    manifest, bad = _ray_train.checkpoint_manifest(checkpoint)
                if manifest is not None:
                    ray_step, bad = manifest["step"], self._foreign(manifest)
            steps = self.checkpointer.steps()
            facts = (ray_step, bad, steps[-1] if steps else None)
        ray_step, bad, newest = self.checkpointer.collectives.broadcast(facts, "Ray checkpoint")
        if checkpoint is None:
            return none
        if bad is not None or ray_step is None:
            log.warning("Ray Train's checkpoint %s is not resumed from: %s", getattr(checkpoint, "path", checkpoint), bad)
            return none
        if newest is not None and ray_step <= newest:
            return checkpoint, f"Ray Train's newest is step {ray_step}, not newer", ray_step, False
        log.log(level, "Ray Train's checkpoint (step %s) is newer than %s: resuming from Ray's", ray_step,
                f"robustdist's newest (step {newest})" if newest is not None else "anything in robustdist's directory")
        return checkpoint, f"Ray Train's step {ray_step} is newer than robustdist's {newest}", ray_step, True

    def _tune_candidate(self, level: int) -> tuple[Any, str, int | None, bool]:
        """In a Ray Tune trial (one process): the checkpoint Tune started it from. This trial's own is a candidate
        as Ray Train's is (first only when newer than robustdist's newest); one Tune handed over from another
        trial of the experiment (PBT's exploit) is tried first, unless this trial's newest step already continues
        from it (:mod:`robustdist.ray.tune`)."""
        assert self.checkpointer is not None and self.tune is not None
        self._handed = None
        checkpoint = _ray_train.latest_checkpoint(tune=True)
        if checkpoint is None:
            return None, "", None, False
        with self._bounded("reading Ray Tune's checkpoint"):
            manifest, bad = _ray_train.checkpoint_manifest(checkpoint)
        giver = _tune.donor(manifest, self.tune) if manifest is not None else None
        if manifest is not None and giver is None:
            bad = self._foreign(manifest)
        if manifest is None or bad is not None:
            log.warning("Ray Tune's checkpoint %s is not resumed from: %s", getattr(checkpoint, "path", checkpoint), bad)
            return None, "", None, False
        step = int(manifest["step"])
        steps = self.checkpointer.steps()
        newest = steps[-1] if steps else None
        if giver is None:  # the trial's own: its own newest wins only within the same lineage
            same = newest is not None and _tune.adopted_by(self.checkpointer.directory, newest) == \
                _tune.adopted_of(manifest)
            if newest is not None and step <= newest and same:
                return checkpoint, f"Ray Tune's newest is step {step}, not newer", step, False
            return checkpoint, f"Ray Tune's step {step} is newer than robustdist's {newest}, or of another lineage", \
                step, True
        handed = {"run": giver, "step": step, "manifest": _ray_train.manifest_digest(manifest)}
        if newest is not None and newest > step and _tune.adopted_by(self.checkpointer.directory, newest) == handed:
            return checkpoint, f"this trial's step {newest} continues from run {giver!r}'s step {step}", step, False
        self._handed = handed
        log.log(level, "Ray Tune started this trial from run %r's checkpoint (step %d), as PBT's exploit does: "
                "resuming from it, not from this trial's own newest (%s)", giver, step,
                f"step {newest}" if newest is not None else "none")
        return checkpoint, f"handed over by Ray Tune from run {giver!r}", step, True

    def _lineage(self, loaded: LoadedCheckpoint) -> None:
        """Where the state just restored came from, for every later manifest of this trial (``adopted``)."""
        if self._handed is not None and loaded.source == "ray" and loaded.step == self._handed["step"]:
            self._adopted = dict(self._handed)
        elif loaded.source in ("durable", "ray"):  # an in-memory copy keeps no metadata: the lineage stays
            self._adopted = _tune.adopted_of({"metadata": loaded.metadata})

    def _foreign(self, manifest: dict[str, Any]) -> str | None:
        """Why a checkpoint (Ray's) belongs to another run, from the run its manifest records; None if ours."""
        recorded = manifest.get("metadata", {}).get("run")
        if not isinstance(recorded, dict) or self.identity is None:
            return None
        for field in ("run", "config"):
            ours, theirs = getattr(self.identity, field), recorded.get(field)
            if ours is not None and theirs is not None and ours != theirs:
                return (f"it belongs to run {recorded.get('run')!r} with training config {recorded.get('config')}, "
                        f"but this is {self.identity.describe()} (they differ in: {field})")
        return None

    def _metrics_of(self, loaded: LoadedCheckpoint) -> dict[str, Any] | None:
        """The metrics saved with the resumed step: its manifest's, or, for an in-memory copy (which keeps none),
        the durable copy's of the same step."""
        metrics = loaded.metadata.get("metrics") if isinstance(loaded.metadata, dict) else None
        if not isinstance(metrics, dict) and loaded.source not in ("durable", "ray") and self.checkpointer is not None:
            try:
                durable = _layout.read_manifest(os.path.join(self.checkpointer.directory,
                                                             _layout.step_dirname(loaded.step)), loaded.step)
                metrics = durable.get("metadata", {}).get("metrics")
            except Exception:  # no durable copy of that step, or a damaged one: no metrics
                metrics = None
        return dict(metrics) if isinstance(metrics, dict) else None

    def _load_ray(self, checkpoint: Any, step: int | None) -> LoadedCheckpoint | None:
        """Ray's checkpoint (newer than robustdist's), verified like any; on failure, robustdist's own."""
        assert self.checkpointer is not None
        try:  # a handed-over checkpoint is the donor's: no copy of this trial's own may stand in for it
            loaded = self.state.load(self.checkpointer, local=None if self._handed is not None else self.local,
                                     checkpoint=checkpoint, at_least=step)
        except (CheckpointError, OSError) as e:
            log.warning("%s's checkpoint %s failed to load (%s); falling back to robustdist's own in %s",
                        self._whose(), getattr(checkpoint, "path", checkpoint), e, self.checkpointer.directory)
            return None
        if loaded is not None and loaded.source == "durable":
            loaded.source, loaded.source_detail = "ray", f"{self._whose()}'s checkpoint"
        if loaded is not None and self._handed is not None:
            loaded.source_detail = f"run {self._handed['run']!r}'s checkpoint, handed over by Ray Tune"
            _tune.retire(self.checkpointer)
        return loaded

    def _report_at_close(self) -> None:
        """Inside Ray Train: report async saves still unreported, and, when this attempt resumed and reported
        nothing (a restored run already at its end), the resumed checkpoint's metrics, so Ray's (and Tune's)
        last result is this run's, not a stale one. Collective, like every report."""
        if self.ray is None or self.checkpointer is None:
            return
        if sys.exc_info()[0] is not None:  # close() in a `finally:` while an error propagates: the other ranks
            log.info("close() while an exception propagates: nothing reported to Ray Train")  # may not be here
            return
        self._report_committed(wait=True)
        if not self._reported and self._resumed_from is not None:
            metrics = dict(self.last_metrics or {"step": self._resumed_from})
            with self._bounded("report to Ray Train"):
                _ray_train.report_metrics(metrics)
            self._reported = True
            log.info("resumed at step %d and reported nothing since: reported its metrics to Ray Train again",
                     self._resumed_from)

