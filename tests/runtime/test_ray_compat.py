"""The fences around Ray's private names (:mod:`robustdist.runtime._ray_compat`, ``_ray_train_compat``,
``_tune_compat``): their records and canaries, their import hygiene, and every capability check degrading with one
log line, never a raw error or an unbounded wait.

The degrade paths are checked here with stand-ins (tier a), since only an older Ray lacks the real names; the
matrix lanes (Ray 2.52.1, 2.55.1, 2.60.0) run the canaries on the real ones. On a real cluster:
``tests/ray/test_ray_compat_cluster.py``.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

from robustdist.runtime import _ray_compat, _ray_train_compat, _tune_compat
from robustdist.runtime.private_api import PrivateAPI, canary, installed

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "robustdist.runtime._ray_compat"  # every Ray fence says a missing capability through its degrade()
FENCES = (_ray_compat, _ray_train_compat, _tune_compat)
RECORD = tuple(api for fence in FENCES for api in fence.PRIVATE_APIS)


@pytest.fixture(autouse=True)
def _fresh_once(monkeypatch):
    """Each test starts with nothing said yet (the module says each missing capability once per process)."""
    monkeypatch.setattr(_ray_compat, "_said", set())


def test_the_record_lists_every_access_with_a_probe():
    names = [api.name for api in RECORD]
    assert len(names) == len(set(names)) >= 10
    for api in RECORD:
        assert isinstance(api, PrivateAPI) and api.dependency == "ray" and callable(api.probe), api
        assert api.used_for and api.verified.startswith("Ray "), api


def test_every_canary_resolves_and_every_since_is_honest():
    """Every entry resolves on the installed Ray, except where it is older than the entry's ``since``: there the
    name must really be absent (the probe fails), and the record must say so for that version."""
    pytest.importorskip("ray")
    from packaging.version import Version

    version = installed("ray")
    for api in RECORD:
        assert canary(api) is None, canary(api)
        if api.since and Version(version) < Version(api.since):
            assert f"absent in {version}" in api.verified, api
            try:
                found = api.probe()
            except Exception:
                found = None
            assert found is None, f"{api.name} resolves on Ray {version}: its since={api.since} is wrong"


@pytest.mark.processes
def test_importing_the_fences_imports_neither_ray_nor_torch_and_changes_nothing():
    code = ("import json, os, sys; before = dict(os.environ)\n"
            "import robustdist.runtime._ray_compat, robustdist.runtime._ray_train_compat\n"
            "import robustdist.runtime._tune_compat\n"
            "print(json.dumps({'ray': 'ray' in sys.modules, 'torch': 'torch' in sys.modules, "
            "'env': dict(os.environ) == before}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ray": False, "torch": False, "env": True}


@pytest.mark.parametrize("fence", FENCES, ids=lambda f: f.__name__.rsplit(".", 1)[1])
def test_the_fence_imports_only_the_runtime_layer_and_ray_inside_functions(fence):
    tree = ast.parse(Path(fence.__file__).read_text())
    for node in tree.body:  # module level: stdlib and robustdist.runtime only
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("robustdist"):
            assert node.module.startswith("robustdist.runtime."), node.module
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not any(n == "ray" or n.startswith(("ray.", "torch")) for n in names), names


def _records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_missing_exception_queue_degrades_with_one_line(caplog):
    context = types.SimpleNamespace(execution_context=types.SimpleNamespace(training_thread_runner=object()))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _ray_train_compat.exception_queue(context) is None
        assert _ray_train_compat.exception_queue(object()) is None
    [line] = _records(caplog)
    assert "no training_thread_runner.get_exception_queue" in line and "exiting the worker instead" in line
    assert "Fix:" in line


def test_a_present_exception_queue_is_returned():
    queue = object()
    runner = types.SimpleNamespace(get_exception_queue=lambda: queue)
    context = types.SimpleNamespace(execution_context=types.SimpleNamespace(training_thread_runner=runner))
    assert _ray_train_compat.exception_queue(context) is queue


def test_a_missing_user_exception_helper_degrades_with_one_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ray.train.v2._internal.util", None)  # import of it now fails
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _ray_train_compat.user_exception(RuntimeError("hung")) is None
        assert _ray_train_compat.user_exception(RuntimeError("hung")) is None
    [line] = _records(caplog)
    assert "construct_user_exception_with_traceback" in line and "Fix:" in line


def _fake_train(monkeypatch, **attrs) -> None:
    module = types.ModuleType("ray.train")
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, "ray.train", module)


class _Mode:
    COMMITTED = "committed"


@pytest.mark.parametrize("attrs", [
    {},  # no get_all_reported_checkpoints at all
    {"get_all_reported_checkpoints": lambda: [], "CheckpointConsistencyMode": _Mode},  # no timeout: never called
    {"get_all_reported_checkpoints": lambda consistency_mode=None: [], "CheckpointConsistencyMode": _Mode},
    {"get_all_reported_checkpoints": lambda consistency_mode=None, timeout_s=None: []},  # no COMMITTED mode
], ids=["absent", "no-arguments", "no-timeout", "no-mode"])
def test_reported_checkpoints_without_a_bounded_wait_degrade_with_one_line(monkeypatch, caplog, attrs):
    calls = []
    if "get_all_reported_checkpoints" in attrs:
        inner = attrs["get_all_reported_checkpoints"]

        def counted(*args, **kwargs):
            calls.append(kwargs)
            return inner(*args, **kwargs)

        counted.__signature__ = inspect.signature(inner)  # type: ignore[attr-defined]
        attrs = {**attrs, "get_all_reported_checkpoints": counted}
    _fake_train(monkeypatch, **attrs)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _ray_train_compat.wait_reported_checkpoints(5.0) is False
        assert _ray_train_compat.wait_reported_checkpoints(5.0) is False
    assert calls == []  # never called without a bound
    [line] = _records(caplog)
    assert "get_all_reported_checkpoints" in line and "Fix:" in line


def test_reported_checkpoints_are_waited_for_with_the_timeout(monkeypatch):
    calls = []

    def get_all_reported_checkpoints(consistency_mode="validated", timeout_s=None):
        calls.append((consistency_mode, timeout_s))
        return []

    _fake_train(monkeypatch, get_all_reported_checkpoints=get_all_reported_checkpoints,
                CheckpointConsistencyMode=_Mode)
    assert _ray_train_compat.wait_reported_checkpoints(7.5) is True
    assert calls == [("committed", 7.5)]


@pytest.mark.parametrize("problem", ["absent", "no-abort"])
def test_a_controller_without_abort_degrades_with_one_line(monkeypatch, caplog, problem):
    def controller_abort():
        if problem == "absent":
            raise ImportError("No module named 'ray.train.v2'")
        return None

    monkeypatch.setattr(_ray_train_compat, "_controller_abort", controller_abort)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _ray_train_compat.controller_abort_supported() is False
        assert _ray_train_compat.controller_abort_supported() is False
    [line] = _records(caplog)
    assert "TrainController.abort" in line and "kills the run" in line and "Fix:" in line


def test_a_handle_without_an_id_degrades_with_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _ray_compat.actor_id(object()) is None
        assert _ray_compat.actor_id(object()) is None
    [line] = _records(caplog)
    assert "ActorHandle._actor_id" in line and "cancel() still kills the run" in line


def test_outside_a_train_v2_worker_there_is_no_train_context(caplog):
    pytest.importorskip("ray.train")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert _ray_train_compat.train_context() is None
    assert _records(caplog) == []  # not a missing capability: nothing to say
    assert _ray_train_compat.train_loop_config(None) is None
    run = types.SimpleNamespace(train_loop_config={"lr": 0.1})
    assert _ray_train_compat.train_loop_config(types.SimpleNamespace(train_run_context=run)) == {"lr": 0.1}


def test_a_ray_without_the_trial_session_asks_tune_s_public_context_and_says_so_once(monkeypatch, caplog):
    pytest.importorskip("ray.tune")

    def no_session():
        raise ImportError("No module named 'ray.train._internal.session'")

    monkeypatch.setattr(_tune_compat, "_get_session", no_session)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _tune_compat.tune_trial() is None  # not in a trial: the public context says so
        assert _tune_compat.tune_trial() is None
    [line] = _records(caplog)
    assert "ray.train._internal.session.get_session" in line and "ray.tune.get_context()" in line
