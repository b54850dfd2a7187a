"""The fence around Ray Tune's private names: which trial a function trainable runs (its session). Listed in
:data:`PRIVATE_APIS`; the accessor degrades as the other Ray fences' do
(:func:`robustdist.runtime._ray_compat.degrade`). Ray is imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from robustdist.runtime._ray_compat import ALL_VERIFIED, degrade
from robustdist.runtime.private_api import PrivateAPI

__all__ = ["PRIVATE_APIS", "tune_trial"]


def _get_session() -> Callable[[], Any]:
    from ray.train._internal.session import get_session

    return get_session


def tune_trial() -> tuple[str, str, bool] | None:
    """``(experiment name, trial id, function)`` of the Ray Tune trial this process runs (a function trainable;
    Ray Train V1 workers too, with ``function`` False: their session has a world rank), or None outside one. Read
    from the trial's session (``ray.train._internal.session``), which says "no trial" without a warning; where this
    Ray has no such internal, from ``ray.tune.get_context()`` (public; outside a trial it warns once and says
    None; ``function`` True)."""
    try:
        get = _get_session()
    except ImportError as e:
        degrade("tune_session", f"Ray has no ray.train._internal.session.get_session ({e}); expected it to tell a "
                 "Tune trial apart. robustdist asks ray.tune.get_context() instead, which warns once outside a "
                 "trial. Fix: none needed")
        return _public_tune_trial()
    session = get()
    if session is None:
        return None
    experiment, trial = getattr(session, "experiment_name", None), getattr(session, "trial_id", None)
    function = getattr(session, "world_rank", None) is None
    return (str(experiment or "unnamed"), str(trial), function) if trial else None


def _public_tune_trial() -> tuple[str, str, bool] | None:
    try:
        import ray.tune

        ctx = ray.tune.get_context()
        trial, experiment = ctx.get_trial_id(), ctx.get_experiment_name()
    except Exception:  # no Tune, or a context that cannot answer: not a trial
        return None
    return (str(experiment or "unnamed"), str(trial), True) if trial else None


def _probe_tune_session() -> object | None:
    import dataclasses

    from ray.train._internal.session import TrialInfo, _TrainSession, get_session

    fields = {f.name for f in dataclasses.fields(TrialInfo)}
    ok = {"experiment_name", "id"} <= fields and isinstance(getattr(_TrainSession, "trial_id", None), property) \
        and isinstance(getattr(_TrainSession, "experiment_name", None), property)
    return get_session if ok else None


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI(
        dependency="ray", name="ray.train._internal.session.get_session() (.experiment_name, .trial_id)",
        used_for="a Tune function trainable's trial gets its own checkpoint namespace; without it robustdist asks "
                 "ray.tune.get_context() (public), which warns once outside a trial",
        verified=ALL_VERIFIED, probe=_probe_tune_session,
        public="ray.tune.get_context().get_trial_id() (warns outside a trial)"),
)
