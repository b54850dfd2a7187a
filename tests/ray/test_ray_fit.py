"""``fit_async``: a Ray Train fit that returns a future at once, and whose ``cancel()`` really stops the run.

On the session's real Ray cluster (2 CPUs). Every trainer asks for 2 workers of 1 CPU, so one run holds the
whole cluster: a run that did not give its CPUs back would stall the next one, which is what is checked.
Ray Train fits are slow here (~20 s each), so the file runs three that start workers: one cancelled, one that
completes, one that fails; and one cancelled while it queues behind the first. The placement-group sweep that
cancellation falls back on is also checked on its own, without Train.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from robustdist.ray.fit import FitFuture, fit_async
from robustdist.runtime import _ray_compat, _ray_train_compat
from robustdist.runtime.errors import ConfigError
from tests import _procs

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300, method="thread")]

CLUSTER_CPUS = 2.0
FIT_TIMEOUT_S = 240.0  # one fit is ~20 s alone; the machine is shared with other Ray test runs
RELEASE_BOUND_S = 15.0  # cancel() itself waits for the release; this is the test's margin on top


def _train(config: dict) -> None:
    """Each worker writes its pid, fails if told, holds for ``hold_s`` (or until a ``stop`` file), reports;
    rank 0 with a checkpoint."""
    import ray.train

    ctx = ray.train.get_context()
    run_dir = Path(config["dir"])
    tmp = run_dir / f".pid-{ctx.get_world_rank()}.tmp"  # renamed into place: the test never reads a half-written one
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, run_dir / f"pid-{ctx.get_world_rank()}")
    if config.get("fail"):
        raise RuntimeError("boom: the train function failed on purpose")
    deadline = time.monotonic() + config.get("hold_s", 0.0)
    while time.monotonic() < deadline and not (run_dir / "stop").exists():
        time.sleep(0.1)
    metrics = {"world_size": ctx.get_world_size(), "rank": ctx.get_world_rank()}
    if ctx.get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as checkpoint_dir:  # Ray Train V2 keeps only metrics sent with a checkpoint
        (Path(checkpoint_dir) / "state.txt").write_text("done")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir))


class _Plain:
    """Anything with ``fit()`` works; this one sleeps, then returns ``value`` (or what ``env`` names in its
    environment) or raises ``error``."""

    def __init__(self, seconds: float, value=None, error: Exception | None = None, env: str | None = None):
        self.seconds, self.value, self.error, self.env = seconds, value, error, env

    def fit(self):
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        return os.environ.get(self.env) if self.env else self.value


@pytest.fixture
def start_fit(ray_by_value):
    """``start_fit(trainer)`` is ``fit_async(trainer)``; a future still running when the test ends is cancelled."""
    started: list[FitFuture] = []

    def start(trainer) -> FitFuture:
        started.append(fit_async(trainer))
        return started[-1]

    yield start
    for future in started:
        future.cancel()


def _trainer(tmp_path: Path, name: str, **config):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run_dir = tmp_path / name
    run_dir.mkdir()
    return TorchTrainer(_train, train_loop_config={"dir": str(run_dir), **config},
                        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name=name,
                                             failure_config=FailureConfig(max_failures=0)))


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (waited {timeout:.0f} s)", pytrace=False)
        time.sleep(0.2)


def _free_cpus(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not _procs.is_zombie(pid)


def _fit_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("robustdist-fit-")]


def _live_actors(*class_names: str) -> dict[str, _ray_compat.ActorRow]:
    """Actors of these classes not yet dead (Ray's GCS table, read through robustdist's fence: no dashboard)."""
    actors, _ = _ray_compat.cluster_tables(None)
    return {a.actor_id.hex(): a for a in actors if a.class_name in class_names and a.state != "DEAD"}


def _placement_groups(ray, state: str) -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == state]


RUN_CLASSES = ("_FitRunner", _ray_train_compat.TRAIN_CONTROLLER_CLASS, "RayTrainWorker", "SynchronizationActor")
CLEANER = _ray_train_compat.PG_CLEANER_CLASS


def _assert_all_released(ray, cleaners_before: set[str]) -> None:
    """CPUs back, no thread, no actor of the run alive; Ray Train's placement-group cleaner was stopped too."""
    _wait_for(lambda: _free_cpus(ray) == CLUSTER_CPUS, RELEASE_BOUND_S,
              f"the run's CPUs were not given back: {ray.available_resources()}")
    _wait_for(lambda: not _fit_threads(), RELEASE_BOUND_S, f"fit_async left its thread running: {_fit_threads()}")
    # Actors alive before the test (another test's plain trainer.fit() may leave its controller) do not count.
    _wait_for(lambda: not set(_live_actors(*RUN_CLASSES)) - cleaners_before, RELEASE_BOUND_S,
              f"actors of the run are still alive: {set(_live_actors(*RUN_CLASSES)) - cleaners_before}")
    _wait_for(lambda: set(_live_actors(CLEANER)) <= cleaners_before, RELEASE_BOUND_S,
              "the run's PlacementGroupCleaner is still running")


@pytest.mark.processes
@pytest.mark.timeout(600, method="thread")  # its own bounded waits add up to over 300 s on a loaded machine
def test_a_running_fit_is_cancelled_and_the_next_fit_gets_the_cluster(ray_by_value, start_fit, tmp_path, caplog):
    ray = ray_by_value
    _wait_for(lambda: _free_cpus(ray) == CLUSTER_CPUS, 60, "the cluster's CPUs were busy before the test")
    cleaners_before = set(_live_actors(CLEANER, *RUN_CLASSES))  # what other tests left alive
    started = time.monotonic()
    future = start_fit(_trainer(tmp_path, "long", hold_s=FIT_TIMEOUT_S))
    assert time.monotonic() - started < 3.0, "fit_async blocked instead of returning the future"
    assert isinstance(future, concurrent.futures.Future) and isinstance(future, FitFuture)

    # The driver loop keeps working while the fit runs; here it waits for both workers to write their pid.
    run_dir = tmp_path / "long"
    polls = 0
    while len(list(run_dir.glob("pid-*"))) < 2:
        assert future.running() and not future.done()
        assert time.monotonic() - started < FIT_TIMEOUT_S, "the workers never started"
        polls += 1
        time.sleep(0.2)
    assert polls > 0
    pids = [int(p.read_text()) for p in run_dir.glob("pid-*")]
    assert future.running()
    _wait_for(lambda: _free_cpus(ray) == 0.0, RELEASE_BOUND_S, "the run should hold the whole cluster")

    # A second fit queues behind it (its placement group pending); cancelling it frees that placement group,
    # which Ray would otherwise keep until the job ends, and leaves the first fit running.
    queued = start_fit(_trainer(tmp_path, "queued", hold_s=FIT_TIMEOUT_S))
    _wait_for(lambda: _placement_groups(ray, "PENDING"), 120, "the queued fit never asked for its placement group")
    pending = _placement_groups(ray, "PENDING")
    with caplog.at_level(logging.WARNING, logger="robustdist.ray.fit"):
        assert queued.cancel() is True
    assert queued.cancelled() and future.running() and not future.done()
    assert set(pending) <= set(_placement_groups(ray, "REMOVED"))
    assert not list((tmp_path / "queued").glob("pid-*"))

    assert future.cancel() is True
    assert future.cancelled() and future.done() and not future.running()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=1)
    assert future.cancel() is True  # idempotent
    assert not _fit_threads(), "cancel() returned with a watcher thread still running"
    # Known leftover: the queued fit's controller was blocked waiting for its placement group, so it could not
    # stop Ray Train's detached cleaner; the warning names it (it holds no CPU, and polls until the cluster stops).
    # The first fit's controller did abort, and stopped its own.
    leftover = set(_live_actors(CLEANER)) - cleaners_before
    assert len(leftover) <= 1 and all(cleaner_id in caplog.text for cleaner_id in leftover), caplog.text
    cleaners_before |= leftover
    _wait_for(lambda: not any(_alive(pid) for pid in pids), RELEASE_BOUND_S,
              f"the worker processes {pids} outlived cancel()")
    _assert_all_released(ray, cleaners_before)
    assert not (run_dir / "stop").exists()  # it was cancel(), not the train function, that ended the run

    # The next run needs both CPUs: it completes only if the cancelled runs released them.
    second = start_fit(_trainer(tmp_path, "second"))
    result = second.result(timeout=FIT_TIMEOUT_S)
    assert result.error is None and result.metrics == {"world_size": 2, "rank": 0}
    assert result.checkpoint is not None
    assert second.done() and not second.running() and not second.cancelled()
    assert second.cancel() is False  # a finished fit cannot be cancelled
    _assert_all_released(ray, cleaners_before)


@pytest.mark.processes
def test_a_failing_fit_sets_the_exception_and_releases_the_cluster(ray_by_value, start_fit, tmp_path):
    from ray.train import TrainingFailedError

    ray = ray_by_value
    _wait_for(lambda: _free_cpus(ray) == CLUSTER_CPUS, 60, "the cluster's CPUs were busy before the test")
    cleaners_before = set(_live_actors(CLEANER, *RUN_CLASSES))  # what other tests left alive
    future = start_fit(_trainer(tmp_path, "failing", fail=True))
    error = future.exception(timeout=FIT_TIMEOUT_S)
    assert isinstance(error, TrainingFailedError), repr(error)
    assert "boom: the train function failed on purpose" in str(error)
    with pytest.raises(TrainingFailedError):
        future.result(timeout=1)
    assert future.cancel() is False and not future.cancelled()
    _assert_all_released(ray, cleaners_before)


@pytest.mark.processes
def test_result_error_and_cancel_reach_waiters_and_callbacks(start_fit, monkeypatch):
    """Without Train (quick): the outcome plumbing, and cancel() waking concurrent.futures.wait and callbacks."""
    finishing = start_fit(_Plain(0.0, value={"answer": 42}))
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1.5")  # Ray Train reads it where fit() runs
    assert start_fit(_Plain(0.0, env="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")).result(timeout=120) == "1.5"
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    failing = start_fit(_Plain(0.0, error=ValueError("bad learning rate")))
    sleeping = start_fit(_Plain(FIT_TIMEOUT_S))
    called: list[concurrent.futures.Future] = []
    sleeping.add_done_callback(called.append)
    assert finishing.result(timeout=120) == {"answer": 42}
    with pytest.raises(ValueError, match="bad learning rate"):  # the error itself, not Ray's RayTaskError
        failing.result(timeout=120)
    assert sleeping.running()
    canceller = threading.Timer(1.0, sleeping.cancel)
    canceller.start()
    try:
        done, _ = concurrent.futures.wait([sleeping], timeout=120)
    finally:
        canceller.join()
    assert done == {sleeping} and sleeping.cancelled() and called == [sleeping]
    _wait_for(lambda: not _fit_threads(), RELEASE_BOUND_S, f"fit_async left its threads running: {_fit_threads()}")
    _wait_for(lambda: not _live_actors("_FitRunner"), RELEASE_BOUND_S, "a runner actor outlived its future")


@pytest.mark.processes
def test_the_sweep_removes_a_placement_group_whose_creator_was_killed(ray_cluster):
    """The fallback of cancel(): Ray frees an actor's placement group only when the job ends, not when the
    actor dies; ``_release`` removes it (and the child actor died with its owner)."""
    from robustdist.ray import fit as ray_fit

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Creator:
        def reserve(self):
            from ray.util.placement_group import placement_group

            pg = placement_group([{"CPU": 1}])
            ray.get(pg.ready(), timeout=60)
            self.child = Child.options(num_cpus=1, placement_group=pg).remote()
            return ray.get(self.child.pid.remote())

    @ray.remote(num_cpus=0)
    class Child:
        def pid(self):
            return os.getpid()

    _wait_for(lambda: _free_cpus(ray) == CLUSTER_CPUS, 60, "the cluster's CPUs were busy before the test")
    creator = Creator.remote()
    child_pid = ray.get(creator.reserve.remote(), timeout=120)
    _wait_for(lambda: _free_cpus(ray) == 1.0, RELEASE_BOUND_S, "the placement group did not reserve its CPU")
    ray.kill(creator)
    _wait_for(lambda: not _alive(child_pid), RELEASE_BOUND_S, "the child actor outlived its owner")
    time.sleep(1.0)
    assert _free_cpus(ray) == 1.0, "Ray itself freed the placement group: the sweep is no longer needed"
    creator_id = _ray_compat.actor_id(creator)
    assert creator_id is not None
    held, _ = ray_fit._release(creator_id, ray.get_runtime_context().get_job_id(), RELEASE_BOUND_S)
    assert held == []
    _wait_for(lambda: _free_cpus(ray) == CLUSTER_CPUS, RELEASE_BOUND_S, "the placement group was not removed")


@pytest.mark.processes
def test_fit_async_without_ray_init_is_a_config_error():
    """In a fresh interpreter: the session cluster of this process may already be up."""
    pytest.importorskip("ray")
    code = textwrap.dedent("""
        import ray
        from robustdist.runtime.errors import ConfigError
        from robustdist.ray.fit import fit_async

        class Trainer:
            def fit(self):
                raise AssertionError("must not run")

        try:
            fit_async(Trainer())
        except ConfigError as e:
            print("CONFIG-ERROR:", e)
        print("INITIALIZED:", ray.is_initialized())
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "CONFIG-ERROR:" in out.stdout, out.stdout
    message = out.stdout.split("CONFIG-ERROR:", 1)[1]
    assert "ray.is_initialized() is False" in message and "Fix: call ray.init()" in message
    assert "INITIALIZED: False" in out.stdout  # it started no Ray session of its own


@pytest.mark.parametrize("kwargs", [{"poll_interval": 0}, {"poll_interval": -1.0}, {"release_timeout": 0},
                                    {"poll_interval": True}])
def test_bad_arguments_are_config_errors(kwargs):
    class Trainer:
        def fit(self):
            raise AssertionError("must not run")

    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        fit_async(Trainer(), **kwargs)


def test_an_object_without_fit_is_a_config_error():
    with pytest.raises(ConfigError, match="no fit\\(\\) method"):
        fit_async(object())  # type: ignore[arg-type]
