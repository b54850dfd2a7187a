"""Ray Tune function trainables and :class:`~robustdist.harden.Hardened`: a trial that starts in a reused actor,
and a checkpoint Tune hands from one trial to another.

* **Trials that end without ``close()``.** Ray's examples never close (their function runs until Tune stops
  it: ``ray.tune.report`` raises ``SystemExit`` in the trial's thread when Tune stops, pauses or resets the
  trial). A ``Hardened`` left open holds its checkpoint directory's lock, its watchdog and its threads; with
  ``TuneConfig(reuse_actors=True)`` (the setting of Ray's PBT examples) the actor lives on, runs the next trial,
  and the trial it paused may continue in another actor, which then cannot take the lock. :func:`opened`
  watches the thread that made each ``Hardened`` in a trial and closes it when that thread ends (nothing is
  reported from it); :func:`take_over`, called by ``harden`` in a trial, waits for that first; and a trial's
  directory lock is waited for up to :data:`LOCK_PATIENCE_S` (the actor it left may still be releasing it).
* **Handed-over checkpoints.** Tune starts a trial from ``ray.tune.get_checkpoint()``: the trial's own newest
  after a failure, another trial's after PBT's exploit (the one Tune feature that copies state between trials on
  purpose). :func:`donor` tells the second apart: its manifest records another trial of the same experiment.
  ``Hardened.resume`` then restores it whatever this trial's own directory holds, records where the state came
  from (``adopted`` in every later manifest of the trial: the donor's run, step and manifest digest), and
  :func:`retire` removes every step of the trial's own: they belong to a lineage Tune abandoned, and would
  otherwise be resumed as "newest" after a later failure, or fallen back to. A checkpoint of another experiment
  is never adopted (it is refused as any other run's is).
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from robustdist.checkpoint import _cleanup, _layout
from robustdist.ray.runs import trial_run
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.log import get_logger

if TYPE_CHECKING:
    from robustdist.checkpoint import AtomicCheckpointer
    from robustdist.ray.train import TuneTrial

__all__ = ["LOCK_PATIENCE_S", "adopted_by", "adopted_of", "donor", "opened", "retire", "take_over"]

log = get_logger(__name__)
LOCK_PATIENCE_S = 30.0
"""How long a Tune trial's save waits for its directory's lock while another process holds it."""
_open: list[tuple[Any, threading.Thread, threading.Thread]] = []
"""A Hardened made in a trial (the facade's type: ``Any`` here, a layer below it), the thread that made it, and the
thread that closes it when that one ends; an entry goes when its closer is done."""
_lock = threading.Lock()


def opened(hardened: Any) -> None:
    """Watch the thread that made ``hardened`` in a Tune trial (the trial's training thread): when it ends,
    ``hardened`` is closed unless the script closed it. A ``Hardened`` watched already is not watched twice."""
    watched = threading.current_thread()
    with _lock:
        if any(h is hardened for h, _, _ in _open):
            return
        closer = threading.Thread(target=_close_after, args=(hardened, watched), daemon=True,
                                  name="robustdist-tune-trial-end")
        _open.append((hardened, watched, closer))
    closer.start()


def _close_after(hardened: Any, watched: threading.Thread) -> None:
    try:
        watched.join()
        if hardened.closed:
            return
        directory = hardened.checkpointer.directory if hardened.checkpointer is not None else None
        log.info("closing the Hardened of %s (checkpoints in %s): its trial's thread %r ended without closing it "
                 "(Ray Tune stopped, paused or reset the trial)", hardened.identity.describe() if hardened.identity
                 else "a Ray Tune trial", directory, watched.name)
        hardened.tune = None  # its trial is over: nothing of it goes to Tune
        try:
            hardened.close()
        except Exception as e:  # an async save of the trial that failed: said; the actor goes on
            log.warning("closing the Hardened of the ended trial (checkpoints in %s) raised %s: %s", directory,
                        type(e).__name__, e)
    finally:
        with _lock:  # the entry (and the model it holds) goes with it
            _open[:] = [entry for entry in _open if entry[0] is not hardened]


def take_over(timeout: float = LOCK_PATIENCE_S) -> None:
    """Before a trial hardens in this process: wait (at most ``timeout``) until the ``Hardened`` of every earlier
    trial whose thread has ended is closed, so its directory lock and threads are gone. The calling thread's own
    are not waited for (a trial may harden twice)."""
    me = threading.current_thread()
    with _lock:
        closers = [closer for _, watched, closer in _open if watched is not me]
    deadline = time.monotonic() + timeout
    for closer in closers:
        closer.join(max(0.0, deadline - time.monotonic()))
        if closer.is_alive():
            log.warning("the Hardened of an earlier Ray Tune trial in this process is still open after %g s (its "
                        "thread still runs, or its close waits for a save); this trial goes on beside it. Fix: "
                        "if its trial function runs a thread of its own, end it when the trial ends", timeout)


def donor(manifest: dict[str, Any], trial: TuneTrial) -> str | None:
    """The run of another trial of ``trial``'s experiment that wrote ``manifest``, or None (this trial's own, a run
    of another experiment, or a manifest that records no run)."""
    recorded = manifest.get("metadata", {}).get("run")
    run = recorded.get("run") if isinstance(recorded, dict) else None
    own = trial_run(trial)
    if isinstance(run, str) and run != own and run.startswith(f"{trial.experiment}/") and "/" not in \
            run[len(trial.experiment) + 1:]:
        return run
    return None


def adopted_of(manifest: Any) -> dict[str, Any] | None:
    """What a manifest records as adopted from another trial, when it has the shape robustdist writes (``run`` a
    str, ``step`` an int, ``manifest`` a digest), else None: a value read from a checkpoint is input."""
    metadata = manifest.get("metadata") if isinstance(manifest, dict) else None
    adopted = metadata.get("adopted") if isinstance(metadata, dict) else None
    if (isinstance(adopted, dict) and set(adopted) == {"run", "step", "manifest"} and isinstance(adopted["run"], str)
            and len(adopted["run"]) <= 400 and type(adopted["step"]) is int and adopted["step"] >= 0
            and isinstance(adopted["manifest"], str) and re.fullmatch(r"[0-9a-f]{8}", adopted["manifest"])):
        return dict(adopted)
    return None


def adopted_by(directory: str, step: int) -> dict[str, Any] | None:
    """What this trial's committed ``step`` records as adopted from another trial, or None (none recorded, or a
    manifest that cannot be read: then it is not known to descend from anything)."""
    try:
        manifest = _layout.read_manifest(os.path.join(directory, _layout.step_dirname(step)), step)
    except Exception:  # a damaged step: the loader judges it; here it only is not known to descend
        return None
    return adopted_of(manifest)


def retire(checkpointer: AtomicCheckpointer) -> list[int]:
    """Remove every committed step of this trial's own (after Tune handed it another trial's state): a lineage
    Tune abandoned, which no later resume or fallback may reach. Returns the steps removed; a step that cannot be
    removed is a :class:`~robustdist.runtime.errors.CheckpointError`."""
    own = checkpointer.steps()
    trashed = [(step, _cleanup.trash(checkpointer.directory, step)) for step in own]
    _cleanup.delete_all([path for _, path in trashed if path])
    stuck = [step for step, path in trashed if not path]
    if stuck:
        raise CheckpointError(f"Ray Tune handed this trial another trial's checkpoint, but its own steps {stuck} in "
                              f"{checkpointer.directory} could not be set aside (see the warnings above); expected "
                              "them gone, or a later resume would reach the lineage Tune abandoned. Fix: make the "
                              "directory writable, or remove those step directories, and restart the trial.")
    if own:
        log.info("removed this trial's own steps %s from %s: Ray Tune handed it another trial's checkpoint, so they "
                 "belong to a lineage it abandoned", own, checkpointer.directory)
    return own
