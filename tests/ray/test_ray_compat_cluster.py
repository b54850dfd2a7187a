"""The Ray fence (:mod:`robustdist.runtime._ray_compat`) on the session's real Ray cluster: the private reads
agree with what Ray's public API says about the same actor and placement group, and ``fit_async`` still stops a
run when an actor handle's id cannot be read (the capability a newer Ray could take away).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from robustdist.runtime import _ray_compat

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(240, method="thread")]


class Probe:
    def ids(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_actor_id(), os.getpid()


class _Sleeper:
    def fit(self):
        time.sleep(600)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (waited {timeout:.0f} s)", pytrace=False)
        time.sleep(0.2)


def _row(actor: bytes, job: str | None) -> _ray_compat.ActorRow | None:
    actors, _ = _ray_compat.cluster_tables(job)
    return next((a for a in actors if a.actor_id == actor), None)


def test_the_actor_table_agrees_with_the_public_api(ray_by_value):
    ray = ray_by_value
    job = ray.get_runtime_context().get_job_id()
    handle = ray.remote(num_cpus=0)(Probe).remote()
    try:
        public_id, pid = ray.get(handle.ids.remote(), timeout=120)
        private_id = _ray_compat.actor_id(handle)
        assert private_id is not None and private_id.hex() == public_id  # the handle's id is the actor's own
        row = _row(private_id, job)
        assert row is not None and row == _row(private_id, None)  # this job's table is part of the whole one
        assert (row.class_name, row.state, row.pid, row.is_detached) == ("Probe", "ALIVE", pid, False)
        assert row.owner_worker_id.hex() == ray.get_runtime_context().get_worker_id()  # the driver owns it
        assert row.worker_id and row.worker_id != row.owner_worker_id
    finally:
        ray.kill(handle)
    _wait_for(lambda: _row(private_id, job).state == "DEAD", 30, "the killed actor is not DEAD in the table")


def test_the_placement_group_table_agrees_with_the_public_api(ray_by_value):
    ray = ray_by_value
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    group = placement_group([{"CPU": 0.5}])
    try:
        ray.get(group.ready(), timeout=120)
        public = placement_group_table(group)
        _, groups = _ray_compat.cluster_tables(None)
        [row] = [g for g in groups if g.group_id.hex() == public["placement_group_id"]]
        assert (row.state, public["state"]) == ("CREATED", "CREATED")
        assert row.bundles == ({"CPU": 0.5},) and not row.is_detached
        assert not row.creator_actor_id.strip(b"\xff\x00")  # made by the driver, not by an actor
    finally:
        remove_placement_group(group)
    _wait_for(lambda: next(g for g in _ray_compat.cluster_tables(None)[1] if g.group_id == row.group_id).state
              == "REMOVED", 30, "the removed placement group is not REMOVED in the table")


def test_fit_async_still_cancels_when_handle_ids_cannot_be_read(ray_by_value, monkeypatch, caplog):
    """Without an actor handle's id there is no abort and no sweep: cancel() kills the runner all the same, and
    the run's thread ends."""
    ray = ray_by_value
    from robustdist.ray import fit as ray_fit

    monkeypatch.setattr(_ray_compat, "actor_id", lambda handle: None)
    future = ray_fit.fit_async(_Sleeper())
    assert len(future._label) == 8 and future._runner_id is None
    runner = future._runner
    _wait_for(lambda: future.running(), 10, "the fit did not start")
    with caplog.at_level(logging.WARNING, logger="robustdist.ray.fit"):
        assert future.cancel() is True
    assert future.cancelled() and not [r for r in caplog.records if r.name == "robustdist.ray.fit"]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(runner.fit.remote(_Sleeper()), timeout=60)  # the runner is dead
    _wait_for(lambda: not [t for t in threading.enumerate() if t.name == f"robustdist-fit-{future._label}"], 30,
              "the fit's watcher thread outlived cancel()")
