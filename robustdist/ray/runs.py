"""Where a run's checkpoints go, and who it is: inside Ray Train, in a Ray Tune function trainable's trial, or
elsewhere (:func:`run_directory`), so runs and trials never resume each other's checkpoints
(:mod:`robustdist.checkpoint._run_owner` records and checks the identity)."""

from __future__ import annotations

import hashlib
import os
import re

from robustdist.checkpoint._layout import committed_steps
from robustdist.checkpoint._run_owner import TUNE_TRIAL_SOURCE, RunIdentity
from robustdist.ray import train as _ray_train
from robustdist.runtime.log import get_logger

__all__ = ["run_directory", "safe_component", "trial_run"]

log = get_logger("robustdist.harden")


def trial_run(trial: _ray_train.TuneTrial) -> str:
    """The run a Ray Tune function trainable's trial records: ``<experiment>/<trial id>``."""
    return f"{trial.experiment}/{trial.trial_id}"[:400]


def run_directory(base: str, run_name: str | None, ray: _ray_train.RayTrain | None,
                   trial: _ray_train.TuneTrial | None) -> tuple[str, RunIdentity]:
    """Where this run's checkpoints go, and who it is. Inside Ray Train: ``<base>/<run>`` (the run is
    ``checkpoint.run_name``, else Ray's ``RunConfig.name``), so Tune trials never share a directory; its
    identity adds the ``train_loop_config`` fingerprint. In a Ray Tune function trainable's trial:
    ``<base>/<experiment>/<trial id>``, or ``<base>/<run_name>`` owned by that trial alone. Elsewhere: ``base``,
    and ``checkpoint.run_name``."""
    if ray is None:
        if trial is None:
            return base, RunIdentity(run=run_name)
        source = f"{TUNE_TRIAL_SOURCE} {trial.trial_id} of experiment {trial.experiment!r}"
        if run_name is not None:  # one name for every trial: the first trial owns it, the others are refused
            return (os.path.join(base, safe_component(run_name)),
                    RunIdentity(run=run_name, config=f"trial {trial.trial_id}", source=source))
        directory = os.path.join(base, safe_component(trial.experiment), safe_component(trial.trial_id))
        if committed_steps(base):  # written there by a robustdist that gave Tune trials no directories of their own
            log.warning("%s holds checkpoints of its own, but this Ray Tune trial now checkpoints in %s (one directory "
                        "per trial, so trials never resume each other's); they are not resumed from. Fix: to resume "
                        "them, move that trial's step directories into %s", base, directory, directory)
        return directory, RunIdentity(run=trial_run(trial), source=source)
    run = run_name or ray.run_name
    recorded = run if len(run) <= 200 else f"{run[:150]}-{hashlib.sha256(run.encode()).hexdigest()[:16]}"
    return (os.path.join(base, safe_component(run)),
            RunIdentity(run=recorded, config=ray.config,
                        source="checkpoint.run_name" if run_name else "Ray Train RunConfig.name, train_loop_config"))


def safe_component(name: str) -> str:
    """``name`` as one directory name: letters, digits and ``._=-`` kept, anything else ``_``, at most 100
    characters (a hash of the original keeps changed or shortened names apart)."""
    kept = re.sub(r"[^A-Za-z0-9._=-]", "_", name)
    if kept != name or len(kept) > 100 or kept in ("", ".", ".."):
        kept = f"{kept.strip('.')[:80]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return kept


