"""``make test-fast``: the tests that start no process, with a guard that keeps the tier honest.

Every test that starts a process (``run_ranks``, a subprocess, torchrun, a Ray cluster, a node lab, DataLoader
workers...), in its own body or in a fixture it uses, carries the ``processes`` marker: on the test, its class or
its module (``pytestmark``). Tests that use the ``ray_cluster``, ``ray_by_value`` or ``node_lab`` fixtures get it
from ``tests/conftest.py``. ``make test-fast`` runs ``-m "not processes"`` with ``ROBUSTDIST_TEST_NO_PROCESSES=1``:
then every way Python starts a process (``os.fork``, ``os.forkpty``, ``os.posix_spawn[p]``, ``os.system``,
``subprocess``'s and ``multiprocessing``'s fork-exec) raises :class:`ProcessStarted` while a test runs (its
fixtures' set-up and tear-down included), and the test fails naming the marker it lacks, even if it caught the
error. ``make test`` runs everything and installs no guard.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

MARKER = "processes"
MARKER_HELP = (f"{MARKER}: the test (or a fixture it uses) starts a process; `make test-fast` leaves it out "
               "(tests/_process_guard.py)")
ENV = "ROBUSTDIST_TEST_NO_PROCESSES"
FIXTURES = ("ray_cluster", "ray_by_value", "node_lab")  # fixtures that start processes: their tests are marked here

_state: dict[str, Any] = {"item": None, "attempts": {}}


class ProcessStarted(RuntimeError):
    """A test in the no-process tier started a process."""


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def configure(config: Any) -> None:
    """Install the guard in this process when the tier asks for it (it only acts while a test runs)."""
    if enabled() and not _state.get("installed"):
        _install()
        _state["installed"] = True
        config.pluginmanager.register(_Hooks(), "robustdist-process-guard")


def mark_by_fixtures(items: list[Any]) -> None:
    for item in items:
        if any(f in getattr(item, "fixturenames", ()) for f in FIXTURES):
            item.add_marker(getattr(pytest.mark, MARKER))


def _refuse(what: str) -> None:
    item = _state["item"]
    if item is None:
        return
    if item.nodeid not in _state["attempts"]:
        _state["attempts"][item.nodeid] = what
    raise ProcessStarted(
        f"{item.nodeid} started a process ({what}) in the no-process tier (make test-fast); expected none. Fix: "
        f"mark the test @pytest.mark.{MARKER} (or its module: pytestmark), so that only `make test` runs it.")


def _wrap(owner: Any, name: str) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _refuse(f"{getattr(owner, '__name__', owner)}.{name}")
        return original(*args, **kwargs)

    # pickled by reference as the attribute it replaces (the hostile-pickle tests pickle os.system)
    guarded.__module__, guarded.__qualname__, guarded.__name__ = owner.__name__, name, name
    setattr(owner, name, guarded)


def _install() -> None:
    import _posixsubprocess
    import subprocess

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        _wrap(os, name)
    _wrap(subprocess, "_fork_exec")
    _wrap(_posixsubprocess, "fork_exec")


class _Hooks:
    """The guard's pytest hooks: which test is running, and its failure if it started a process."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Any:
        _state["item"] = item
        try:
            return (yield)
        finally:
            _state["item"] = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        report = yield
        what = _state["attempts"].get(item.nodeid)
        if what is None:
            return report
        if report.failed:
            _state["attempts"][item.nodeid] = None  # already failing: its error says why
        elif call.when == "teardown":
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} started a process ({what}) in the no-process tier (make test-fast), "
                               f"though it caught the error. Fix: mark it @pytest.mark.{MARKER}.")
        return report
