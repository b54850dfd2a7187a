"""Shared fixtures: every test leaves the process as it found it, and the suite judges only what it made.

The run (controller, once): a temporary directory of its own (``robustdist-tests-*``), the ``TMPDIR`` and
``RAY_TMPDIR`` of everything the suite starts, removed at the end. Nothing outside it is looked at or removed: a
torchrun job or a Ray cluster of someone else's beside the suite neither fails it nor loses its files.

Autouse, per test:
* the environment is restored exactly (code under test may set env vars);
* logger levels and handlers, and the process's signal handlers, are as they were: a test that changes them
  fails (they are put back first), so the next test on the same worker does not inherit them;
* a leftover default process group is destroyed;
* a test that leaves child processes behind fails, and the children are killed (only this process's
  descendants are looked at);
* a test that leaves a node-lab network namespace behind fails, and the namespace is deleted (only namespaces
  this process created);
* child processes get a ``TMPDIR`` of the test's own (torchrun leaves its log directory, ``torchelastic_*``, in
  ``TMPDIR``); a ``torchelastic_*`` directory that appears in the run's own directory instead (a torchrun a
  module fixture started without a directory of its own) is named in a warning, and the run fails at its end;
* under ``make test-fast`` (``ROBUSTDIST_TEST_NO_PROCESSES``), a test that starts a process fails, naming the
  ``processes`` marker it lacks (``tests/_process_guard.py``);
* under pytest-xdist, a test that runs past a ``method="thread"`` timeout is reported with every thread's stack
  (``tests/_timeouts.py``), not only as a crashed worker.

``fsdp_cpu``: skips a test that trains FSDP2 on the CPU where this torch's gloo cannot average (torch 2.8).

Session: ``ray_cluster``, one local Ray cluster (``ray.init(address="local", num_cpus=2)``: always a new one: never a cluster found on the
machine) shared by every test that asks for it, skipped when ray is not installed, shut down (and checked for
survivors) at the end of the session.

``make test`` runs the suite on three pytest-xdist workers (``-n 3 --dist loadgroup``): many tests wait on
processes they started, not on a core. Every test that uses ``ray_cluster`` goes to one worker (the
``xdist_group`` "ray"), so there is still one Ray cluster per run. The multi-node lab tests
(``tests/multinode``) share one worker too (``xdist_group`` "multinode"): each runs several torchrun agents.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
import warnings

import pytest
from hypothesis import settings

from tests import _global_state, _procs, _process_guard, _timeouts

import robustdist  # noqa: E402

# `from robustdist import harden` must give the function in every test: Python's import system sets the package's
# attribute `harden` to the submodule robustdist.harden when that is first imported (`from robustdist.harden import
# ...`, or test_docs resolving `robustdist.harden:harden`). Resolving the public name first binds the function,
# and a later import of the submodule finds it loaded and leaves the attribute alone.
robustdist.harden  # noqa: B018

RUN_TMP_ENV = "ROBUSTDIST_TEST_RUN_TMP"  # the run's own temporary directory, set by the controller for its workers
_RUN_TMP_OWNED = pytest.StashKey[str]()  # set in the process that made it (and removes it)
_STATE_BEFORE = pytest.StashKey[dict]()
# What run_ranks' forkserver imports once, so that no rank imports it: torch, DCP, what harden() imports (the
# facade module itself is left to the rank: importing robustdist.harden would shadow the function of that name on
# the package), and pytest, which the test module a rank takes its function from imports. None starts a thread.
_FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "robustdist.testing.ranks",
                       "robustdist._hardened", "robustdist.recovery.loop", "robustdist.parallel.fsdp",
                       "robustdist.checkpoint.local.tier", "robustdist.data.dataloader", "pytest")

# The machine is shared and noisy: property tests check behaviour, never per-example speed.
settings.register_profile("robustdist", deadline=None)
settings.load_profile("robustdist")


def pytest_configure(config):
    config.addinivalue_line("markers", _process_guard.MARKER_HELP)
    if not hasattr(config, "workerinput") and not os.environ.get(RUN_TMP_ENV):  # the controller, or the only process
        _make_run_tmp(config)
    _process_guard.configure(config)
    # torch.compile compiles in this process: some torch versions (2.8) otherwise keep a pool of compile worker
    # processes alive for the session, which the leftover-children check would report as the test's
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # run_ranks' timeouts are a hang guard, not a speed test: on a 2-core machine running several workers, each
    # starting processes, a run that takes 40 s alone took over 60 s (robustdist.testing.ranks reads this).
    os.environ.setdefault("ROBUSTDIST_TEST_TIMEOUT_SCALE", "3")
    # Ranks fork from a server that imported torch once, instead of importing it each (the suite's main cost).
    from robustdist.testing.ranks import use_forkserver

    use_forkserver(_FORKSERVER_PRELOAD)
    from robustdist.testing import nodelab

    if nodelab.unavailable() is None and not hasattr(config, "workerinput"):  # the controller, once per run
        nodelab.remove_stale()  # namespaces a crashed earlier run left behind


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads xdist_group to pick the worker
def pytest_collection_modifyitems(config, items):
    _process_guard.mark_by_fixtures(items)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif "node_lab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("multinode"))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    return _timeouts.set_timer(item, settings, os.environ.get(RUN_TMP_ENV))


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    _timeouts.describe_crash(os.environ.get(RUN_TMP_ENV), crashitem, report)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_STATE_BEFORE] = _global_state.snapshot()  # before any fixture of the test is set up
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After every fixture's tear-down (``monkeypatch``'s included): what the test itself left changed."""
    before = item.stash.get(_STATE_BEFORE, None)
    try:
        result = yield
    finally:  # put back even when a fixture's tear-down failed, so the next test starts from what it expects
        changes = _global_state.restore(before) if before is not None else []
    if changes:
        pytest.fail("the test changed global state it did not restore (now put back): " + "; ".join(changes)
                    + ". Fix: restore it in the test (a fixture or try/finally), or in the code under test if it "
                    "should not change it", pytrace=False)
    return result


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _children_tmpdir(tmp_path_factory, monkeypatch):
    import tempfile

    monkeypatch.setenv("RAY_TMPDIR", os.environ.get("RAY_TMPDIR") or tempfile.gettempdir())  # the run's own
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))


def _make_run_tmp(config) -> None:
    """The run's own ``TMPDIR`` and ``RAY_TMPDIR`` (inherited by the xdist workers and all they start), so that
    the suite's checks look only there. ``RAY_TMPDIR`` also keeps the suite's Ray cluster from finding, or being
    found by, a cluster someone started with ``ray start`` (Ray records the newest one in its temporary
    directory); ``RAY_ADDRESS`` would point ``ray.init()`` at theirs, so the suite drops it."""
    import tempfile

    tempfile.gettempdir()  # this process keeps its own (multiprocessing removes its files there after the run's end)
    path = tempfile.mkdtemp(prefix="robustdist-tests-", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.makedirs(os.path.join(path, "ray"))
    config.stash[_RUN_TMP_OWNED] = path
    os.environ.update({RUN_TMP_ENV: path, "TMPDIR": path, "RAY_TMPDIR": os.path.join(path, "ray")})
    os.environ.pop("RAY_ADDRESS", None)


def escaped_torchrun_dirs(run_tmp: str | None = None) -> list[str]:
    """torchrun log directories (``torchelastic_*``) in the run's own temporary directory: left by a torchrun the
    suite started outside any test's ``TMPDIR`` (a module fixture's). Nothing outside the run's directory."""
    run_tmp = run_tmp if run_tmp is not None else os.environ.get(RUN_TMP_ENV)
    return sorted(glob.glob(os.path.join(glob.escape(run_tmp), "torchelastic_*"))) if run_tmp else []


@pytest.fixture(autouse=True)
def _torchrun_dirs_in_run_tmp():
    """A ``torchelastic_*`` directory that appears in the run's own directory during the test is named in a
    warning (with several xdist workers, possibly a test beside it; a module fixture's runs fall outside every
    test). The run fails for them at its end (below)."""
    before = set(escaped_torchrun_dirs())
    yield
    new = sorted(set(escaped_torchrun_dirs()) - before)
    if new:
        warnings.warn(f"torchrun log directories appeared outside the test's TMPDIR during this test: {new}",
                      stacklevel=1)


@pytest.hookimpl(trylast=True)  # after pytest-xdist has ended its workers
def pytest_sessionfinish(session, exitstatus):
    """A run whose torchruns left log directories outside their tests' ``TMPDIR`` fails, naming them; then the
    run's own temporary directory goes, with all it holds."""
    run_tmp = session.config.stash.get(_RUN_TMP_OWNED, None)
    if run_tmp is None:
        return
    escaped = escaped_torchrun_dirs(run_tmp)
    if escaped:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"FAILED: torchrun log directories were left outside their tests' TMPDIR (in the run's "
                                f"own directory, now removed): {escaped}; expected none. Fix: give the torchrun that "
                                "made them a TMPDIR of the test's own (see the warnings naming tests)", red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(run_tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _destroy_leftover_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_children():
    before = _procs.descendants(os.getpid())
    yield
    deadline = time.monotonic() + 5.0
    leftovers = _procs.new_descendants(os.getpid(), before)
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.1)
        leftovers = _procs.new_descendants(os.getpid(), before)
    if leftovers:
        described = [f"pid {pid}{' (zombie: never reaped)' if _procs.is_zombie(pid) else ''}: {_procs.cmdline(pid)}"
                     for pid in leftovers]
        for pid in leftovers:
            _procs.kill_and_reap(pid)
        pytest.fail("the test left child processes running (now killed):\n" + "\n".join(described), pytrace=False)


@pytest.fixture(autouse=True)
def _no_leftover_namespaces():
    from robustdist.testing import nodelab

    yield
    leftovers = nodelab.leftover_namespaces(owner=os.getpid())
    if leftovers:
        for name in leftovers:
            nodelab.delete_namespace(name)
        pytest.fail(f"the test left node-lab network namespaces behind (now deleted): {leftovers}", pytrace=False)


@pytest.fixture
def node_lab(tmp_path):
    """``node_lab(nodes, **kwargs)`` builds a :class:`robustdist.testing.nodelab.NodeLab` torn down after the test.
    Skips where the lab cannot run, except in CI (``CI`` set), where that is a failure."""
    from robustdist.testing import nodelab

    reason = nodelab.unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the multi-node lab must run in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    labs = []

    def make(nodes=2, **kwargs):
        kwargs.setdefault("log_dir", tmp_path / f"lab{len(labs)}-logs")
        lab = nodelab.NodeLab(nodes, **kwargs)
        labs.append(lab)
        return lab

    yield make
    for lab in labs:
        lab.close()


@pytest.fixture(scope="session")
def _gloo_averages():
    from robustdist.testing.ranks import run_ranks
    from tests._training import gloo_averages

    return all(run_ranks(gloo_averages, 2, timeout=120))


@pytest.fixture
def fsdp_cpu(_gloo_averages):
    """For a test that trains FSDP2 on the CPU: skipped on a torch whose gloo sums for ReduceOp.AVG (torch 2.8,
    pytorch#162338), where FSDP2 on the CPU trains wrong and wrap_fsdp refuses it (a test checks the refusal)."""
    if not _gloo_averages:
        pytest.skip("this torch's gloo reduce-scatter sums for ReduceOp.AVG (pytorch#162338): FSDP2 cannot train "
                    "on the CPU here, and wrap_fsdp refuses it")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the whole session: ``ray.init(address="local", num_cpus=2, include_dashboard=False)``
    (never a cluster found on the machine), with robustdist's bf16 worker setup hook."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    before = _procs.descendants(os.getpid())
    # Every worker installs robustdist's bf16 serializers, as docs/ray.md tells users to (the bf16 tests need it),
    # right after it first imports torch (the hook itself imports no torch: tests/ray/test_ray_hook.py).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"worker_process_setup_hook": "robustdist.ray.hook.worker_setup"})
    started = _procs.new_descendants(os.getpid(), before)
    try:
        yield ray
    finally:
        ray.shutdown()
        survivors = _procs.wait_gone(started, timeout=15.0)
        for pid in survivors:
            _procs.kill_and_reap(pid)
        if survivors:
            raise RuntimeError(f"ray.shutdown() left Ray processes running (now killed): {survivors}")


@pytest.fixture(scope="module")
def ray_by_value(request, ray_cluster):
    """The session cluster, with the requesting test module's functions and classes sent to Ray workers by value
    (the workers import robustdist but maybe not ``tests``)."""
    from ray import cloudpickle

    module = request.module
    cloudpickle.register_pickle_by_value(module)
    try:
        yield ray_cluster
    finally:
        cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(autouse=True)
def _reset_warn_once():
    """``robustdist.runtime.log.warn(once=...)`` remembers keys per process; each test starts fresh."""
    from robustdist.runtime import log

    log._warned.clear()
    yield
