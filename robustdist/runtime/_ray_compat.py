"""The fence around Ray's private names of the cluster: actor handles' ids and the GCS actor and placement-group
tables. Ray Train's are in ``_ray_train_compat``, Ray Tune's in ``_tune_compat``; nothing else in the package reaches
past Ray's public API (``tests/test_private_api.py`` enforces it).

Each access is listed in :data:`PRIVATE_APIS` as a :class:`~robustdist.runtime.private_api.PrivateAPI`: what it is
used for, what happens without it, the Ray versions the matrix verified it on, and a probe that resolves it on the
installed Ray (:func:`robustdist.runtime.private_api.canary`). The rest of robustdist calls the small accessors
below, each of which is also a capability check: where the installed Ray lacks the name (an older or a newer
Ray), the accessor returns None or False and logs ONE line for the process naming what is missing, what
robustdist does instead, and the fix (:func:`degrade`, which the other Ray fences use too); it never raises Ray's
own error and never waits without a bound.

Ray is imported inside the functions only: importing this module imports neither ray nor torch and changes
nothing. Layer 0: it imports from ``robustdist.runtime`` only.
"""

from __future__ import annotations

import threading
from typing import Any

from robustdist.runtime.log import get_logger
from robustdist.runtime.private_api import PrivateAPI, installed
from robustdist.runtime.ray_rows import ActorRow, GroupRow

__all__ = ["PRIVATE_APIS", "ActorRow", "GroupRow", "actor_id", "cluster_tables"]

log = get_logger(__name__)

ALL_VERIFIED = "Ray 2.52.1, 2.55.1, 2.60.0"
_lock = threading.Lock()
_said: set[str] = set()


def degrade(key: str, message: str) -> None:
    """Log ``message`` once per process for ``key``: a missing capability is said once, not on every call."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.warning("%s (Ray %s)", message, installed("ray"), all_ranks=True)


# --- actor handles ------------------------------------------------------------------------------------------


def actor_id(handle: Any) -> bytes | None:
    """The binary id of an actor handle (``ActorHandle._actor_id``, what ``ray.kill`` uses), or None where the
    handle has none. Ray's public API names an actor's id only inside the actor
    (``ray.get_runtime_context().get_actor_id()``)."""
    try:
        return bytes(handle._actor_id.binary())
    except Exception as e:  # a Ray whose handles changed
        degrade("actor_id", f"robustdist could not read an actor handle's id ({type(e).__name__}: {e}); expected "
                 "ActorHandle._actor_id. fit_async's abort and sweep are skipped (cancel() still kills the run). "
                 "Fix: use a Ray robustdist was tested on (2.52.1 to 2.60.0; robustdist doctor)")
        return None


# --- the GCS actor and placement-group tables ----------------------------------------------------------------


def _gcs_accessor() -> Any:
    """The connected ``GlobalStateAccessor`` of this process's Ray session."""
    from ray._private.state import state

    return state._connect_and_get_accessor()


def cluster_tables(job_hex: str | None) -> tuple[list[ActorRow], list[GroupRow]]:
    """(the actors of job ``job_hex``, or of every job for None; every placement group), read from Ray's GCS
    without the dashboard. Raises (any type) where Ray's internals differ: the caller degrades."""
    import ray
    from ray.core.generated import gcs_pb2 as pb

    accessor = _gcs_accessor()
    job = ray.JobID.from_hex(job_hex) if job_hex is not None else None
    actor_state = pb.ActorTableData.ActorState.Name
    group_state = pb.PlacementGroupTableData.PlacementGroupState.Name
    actors = []
    for raw in accessor.get_actor_table(job, None):
        a = pb.ActorTableData.FromString(raw)
        actors.append(ActorRow(actor_id=a.actor_id, class_name=a.class_name, state=actor_state(a.state),
                               worker_id=a.address.worker_id, owner_worker_id=a.owner_address.worker_id,
                               pid=a.pid, is_detached=a.is_detached))
    groups = []
    for raw in accessor.get_placement_group_table():
        g = pb.PlacementGroupTableData.FromString(raw)
        groups.append(GroupRow(group_id=g.placement_group_id, creator_actor_id=g.creator_actor_id,
                               state=group_state(g.state), is_detached=g.is_detached,
                               bundles=tuple(dict(b.unit_resources) for b in g.bundles)))
    return actors, groups


# --- the record: every private name above, and its probe ---------------------------------------------------


def _probe_gcs_accessor() -> object | None:
    from ray._private.state import GlobalState, state

    return getattr(GlobalState, "_connect_and_get_accessor", None) if isinstance(state, GlobalState) else None


def _probe_accessor_tables() -> object | None:
    from ray._raylet import GlobalStateAccessor

    return getattr(GlobalStateAccessor, "get_actor_table", None) and getattr(
        GlobalStateAccessor, "get_placement_group_table", None)


def _probe_gcs_pb2() -> object | None:
    from ray.core.generated import gcs_pb2 as pb

    fields = {f.name for f in pb.ActorTableData.DESCRIPTOR.fields} | {
        f.name for f in pb.PlacementGroupTableData.DESCRIPTOR.fields}
    wanted = {"actor_id", "class_name", "state", "address", "owner_address", "pid", "is_detached",
              "placement_group_id", "creator_actor_id", "bundles"}
    return pb if wanted <= fields else None


def _probe_actor_id() -> object | None:
    from ray.actor import ActorHandle

    return getattr(ActorHandle, "_actor_id", None)


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI(
        dependency="ray", name="ray._private.state.state._connect_and_get_accessor()",
        used_for="fit_async reads the GCS actor and placement-group tables to find the Train controller and sweep "
                 "the placement groups a cancelled run leaves; without it the abort and sweep are skipped with one "
                 "warning and cancel() still kills the run",
        verified=ALL_VERIFIED, probe=_probe_gcs_accessor,
        public="ray.util.state.list_actors / list_placement_groups (need the dashboard; no owner or creator)"),
    PrivateAPI(
        dependency="ray", name="ray._raylet.GlobalStateAccessor.get_actor_table / get_placement_group_table",
        used_for="the raw GCS rows behind cluster_tables(); as above", verified=ALL_VERIFIED,
        probe=_probe_accessor_tables, public="ray.util.placement_group_table() (no creator actor)"),
    PrivateAPI(
        dependency="ray", name="ray.core.generated.gcs_pb2 (ActorTableData, PlacementGroupTableData)",
        used_for="parsing the GCS rows (owner and creator ids); as above", verified=ALL_VERIFIED,
        probe=_probe_gcs_pb2),
    PrivateAPI(
        dependency="ray", name="ray.actor.ActorHandle._actor_id",
        used_for="naming fit_async's runner and matching the Train controller's handle; without it the abort and "
                 "sweep are skipped (ray.kill(handle) still works)",
        verified=ALL_VERIFIED, probe=_probe_actor_id,
        public="ray.get_runtime_context().get_actor_id() (inside the actor only)"),
)
