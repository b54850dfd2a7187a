"""A replacement's join (robustdist.recovery.replacement) against a real TCPStore in this process: the
published state round-trips, the survivors' verdict decides, and the store's content and the environment are input
(hostile values are named RecoveryErrors, never raw errors, never a hang). The whole launcher runs in
test_replace.py."""

from __future__ import annotations

import ast
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from robustdist.recovery import faults, replacement
from robustdist.runtime.errors import RecoveryError
from robustdist.runtime.replacing import ATTEMPT_STORE_ENV, REPLACES_ENV, RUN_ENV, STATE_KEY, job_of

PACKAGE = Path(replacement.__file__).resolve().parents[1]
SCOPE = f"{faults.SCOPE}/1"  # the script's first h.run: the only one a replacement can stand in for


@pytest.fixture
def server(monkeypatch):
    """A TCPStore server standing for torchrun's agent store (and the generation's store), named by MASTER_ADDR/PORT;
    the module's and the counters' state restored afterwards."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the agent serves it (no new server to wait for)
    monkeypatch.setattr(replacement, "_published", {})
    for module, attr in replacement.COUNTERS.values():
        monkeypatch.setattr(module, attr, getattr(module, attr))
    return store


def _state(store, **over):
    state = {"scope": SCOPE, "generation": 4, "world": 2, "host": "127.0.0.1", "port": store.port,
             "counters": {"rendezvous": 6, "reach": 6, "barrier": 6, "watchdog": 5}, "fingerprint": "f00d",
             "pid": 1, "wall": 0.0}
    state.update(over)
    return state


def _replacing(monkeypatch, rank=1, **over):
    """This process replaces dead ``rank`` of the job its environment names, as robustdist run's agent says."""
    monkeypatch.setenv(RUN_ENV, "1")
    master, run = job_of()
    monkeypatch.setenv(REPLACES_ENV, json.dumps({"rank": rank, "pid": 4242, "died": "signal 9 (SIGKILL)", "n": 1,
                                                 "master": master, "run": run, **over}))


def _rank0(store, verdict: str, stop: threading.Event) -> threading.Thread:
    """The survivors' side: once rank 1's decision is in, rank 0 stores the verdict (as agree() does)."""
    def run() -> None:
        while not stop.is_set() and not store.check([f"{SCOPE}/4/decision/1"]):
            time.sleep(0.02)
        if not stop.is_set():
            store.compare_set(f"{SCOPE}/4/verdict", "", verdict)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_every_counter_that_names_store_keys_is_adopted():
    """A module-level counter bumped under ``global`` (``_x += 1``) names store keys the same on every rank; a
    replacement must take each from the survivors, so each must be in COUNTERS (or this test names it)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if "testing" in path.parts:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            declared = {n for g in ast.walk(fn) if isinstance(g, ast.Global) for n in g.names}
            for node in ast.walk(fn):
                if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and \
                        node.target.id in declared and isinstance(node.op, ast.Add):
                    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
                    found.add((module, node.target.id))
    found.discard(("robustdist.data.dataloader", "_pinned_persistent"))  # counts warnings, names no key
    listed = {(m.__name__, attr) for m, attr in replacement.COUNTERS.values()}
    assert found == listed, f"counters bumped in the package: {sorted(found)}; adopted by a replacement: {sorted(listed)}"


def test_publish_writes_what_join_reads(server, monkeypatch):
    monkeypatch.delenv(RUN_ENV, raising=False)
    replacement.publish(server, SCOPE, 4, 2, "f00d")
    assert not server.check([STATE_KEY])  # not under robustdist run: nothing
    monkeypatch.setenv(RUN_ENV, "1")
    replacement.publish(server, f"{faults.SCOPE}/2", 4, 2, "f00d")
    assert not server.check([STATE_KEY])  # a second h.run in the script: a replacement cannot stand in for it
    replacement.publish(server, SCOPE, 4, 2, "f00d")
    state = replacement._state(server.get(STATE_KEY), 2, 1)
    assert (state["scope"], state["generation"], state["port"]) == (SCOPE, 4, server.port)
    assert state["counters"] == replacement.counters()
    assert state["outlives_rank0"] is False  # no agent-served store: the generation's dies with rank 0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    served = {"addr": "127.0.0.1", "port": server.port, "token": "a" * 32, "master": f"127.0.0.1:{server.port}",
              "run": "job"}
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps(served))
    replacement.publish(server, SCOPE, 5, 2, "f00d")
    assert json.loads(server.get(STATE_KEY))["outlives_rank0"] is True  # the generation lives in the agent's
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps({**served, "port": 1}))
    replacement.publish(server, SCOPE, 6, 2, "f00d")
    assert json.loads(server.get(STATE_KEY))["outlives_rank0"] is False  # served, but not the store it uses
    monkeypatch.setenv(ATTEMPT_STORE_ENV, json.dumps({**served, "run": "outer-job"}))
    replacement.publish(server, SCOPE, 7, 2, "f00d")
    assert json.loads(server.get(STATE_KEY))["outlives_rank0"] is False  # another job's (inherited): not used
    replacement.withdraw()
    assert not server.check([STATE_KEY])


def test_a_replacement_joins_the_survivors_next_generation(server, monkeypatch):
    _replacing(monkeypatch)
    server.set(STATE_KEY, json.dumps(_state(server)))
    stop = threading.Event()
    _rank0(server, "recover", stop)
    assert replacement.join(in_process=True, rank=1, world=2, init_timeout=15, fingerprint="f00d") == (1, 5)
    assert replacement.counters() == {"rendezvous": 6, "reach": 6, "barrier": 6, "watchdog": 5}
    fault = faults.read_fault(server, generation=4, world_size=2, scope=SCOPE)
    assert fault is not None and fault.count == 1 and fault.why[1]["by"] == -1
    assert "pid 4242" in fault.why[1]["what"] and "SIGKILL" in fault.why[1]["what"]
    assert server.get(f"{SCOPE}/4/decision/1") == b"recover" and server.check([f"{SCOPE}/4/left/1"])
    assert replacement.join(in_process=True, rank=1, world=2, init_timeout=15) is None  # once per process
    assert server.check([STATE_KEY])  # a replacement of rank 1 leaves rank 0's state to rank 0
    stop.set()


def test_a_replacement_of_rank_0_withdraws_the_generations_state_at_the_verdict(server, monkeypatch):
    """As a living rank 0 does: a second death while the next generation is built is not replaced from it."""
    _replacing(monkeypatch, rank=0)
    server.set(STATE_KEY, json.dumps(_state(server)))
    stop = threading.Event()

    def survivors() -> None:
        while not stop.is_set() and not server.check([f"{SCOPE}/4/decision/0"]):
            time.sleep(0.02)
        server.compare_set(f"{SCOPE}/4/verdict", "", "recover")
    threading.Thread(target=survivors, daemon=True).start()
    try:
        assert replacement.join(in_process=True, rank=0, world=2, init_timeout=15, fingerprint="f00d") == (1, 5)
        assert not server.check([STATE_KEY])
    finally:
        stop.set()


def test_survivors_that_escalated_send_the_replacement_to_the_restart(server, monkeypatch):
    _replacing(monkeypatch)
    server.set(STATE_KEY, json.dumps(_state(server)))
    stop = threading.Event()
    _rank0(server, "escalate", stop)
    with pytest.raises(RecoveryError, match=r"verdict 'escalate'.*expected \"recover\".*launcher's restart"):
        replacement.join(in_process=True, rank=1, world=2, init_timeout=15)
    stop.set()


def test_no_state_and_no_verdict_end_within_the_init_timeout(server, monkeypatch):
    _replacing(monkeypatch)
    start = time.monotonic()
    # (6 s: an in-process TCPStore handshake here takes 5 s now and then, torch's own; seen 4-12 in 150)
    with pytest.raises(RecoveryError, match=r"\[rank 1\].*no in-process state .* within 6 s.*Fix"):
        replacement.join(in_process=True, rank=1, world=2, init_timeout=6)
    monkeypatch.setattr(replacement, "_published", {})
    server.set(STATE_KEY, json.dumps(_state(server)))  # published, but nobody decides
    with pytest.raises(RecoveryError, match="verdict missing|verdict 'none'"):
        replacement.join(in_process=True, rank=1, world=2, init_timeout=6)
    assert time.monotonic() - start < 40


@pytest.mark.parametrize("raw, found", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "a JSON list"),
    (b"x" * 9000, "9000 bytes"),
    (b"[" * 5000 + b"]" * 5000, "bytes"),
    (None, "scope '../../etc'"),
    (None, "generation -1"),
    (None, "world size 8"),
    (None, "without a valid store address"),
    (None, "counters"),
])
def test_a_hostile_state_is_a_named_error(server, monkeypatch, raw, found):
    _replacing(monkeypatch)
    over = {"scope '../../etc'": {"scope": "../../etc"}, "generation -1": {"generation": -1},
            "world size 8": {"world": 8}, "without a valid store address": {"port": 70000},
            "counters": {"counters": {"rendezvous": 2**40, "reach": 1, "barrier": 1, "watchdog": 1}}}.get(found, {})
    server.set(STATE_KEY, raw if raw is not None else json.dumps(_state(server, **over)))
    with pytest.raises(RecoveryError, match=rf"\[rank 1\].*{found}.*expected the JSON rank 0 publishes.*Fix"):
        replacement.join(in_process=True, rank=1, world=2, init_timeout=15)
    assert replacement.counters() != {"rendezvous": 2**40, "reach": 1, "barrier": 1, "watchdog": 1}


@pytest.mark.parametrize("value", ["{oops", json.dumps({"rank": 0}), json.dumps([1]), "[" * 4000,
                                   json.dumps({"rank": 1, "master": 5, "run": ""}), "1" * 70000])
def test_a_hostile_environment_is_a_named_error(server, monkeypatch, value):
    monkeypatch.setenv(RUN_ENV, "1")
    monkeypatch.setenv(REPLACES_ENV, value)
    with pytest.raises(RecoveryError, match=rf"\[rank 1\] {REPLACES_ENV}=.*expected the JSON robustdist run sets.*Fix"):
        replacement.join(in_process=True, rank=1, world=2, init_timeout=15)


@pytest.mark.parametrize("rank", [0, 1, "1", True])
def test_a_value_set_for_this_job_names_this_rank_or_is_a_named_error(server, monkeypatch, rank):
    _replacing(monkeypatch, rank=rank)
    if rank == 1 and rank is not True:
        server.set(STATE_KEY, "{oops")  # it is taken: the join goes on to read the state
        with pytest.raises(RecoveryError, match="expected the JSON rank 0 publishes"):
            replacement.join(in_process=True, rank=1, world=2, init_timeout=15)
    else:
        with pytest.raises(RecoveryError, match=rf"\[rank 1\] {REPLACES_ENV}=.*for a replacement of this rank \(1\)"):
            replacement.join(in_process=True, rank=1, world=2, init_timeout=15)


@pytest.mark.parametrize("other", [{"run": "outer-job"}, {"master": "10.0.0.9:29500"}])
def test_a_value_inherited_from_another_job_is_not_this_process_s(server, monkeypatch, other):
    """A torchrun (or another robustdist run) started inside a replaced worker inherits ROBUSTDIST_REPLACES and
    ROBUSTDIST_RUN; its ranks are no replacements, whatever their rank."""
    for rank in (0, 1):
        _replacing(monkeypatch, rank=rank, **other)
        monkeypatch.setattr(replacement, "_published", {})
        assert replacement.join(in_process=True, rank=rank, world=2, init_timeout=15) is None
    monkeypatch.delenv(RUN_ENV)  # not under robustdist run at all: not read
    _replacing(monkeypatch, rank=1)
    monkeypatch.delenv(RUN_ENV)
    assert replacement.join(in_process=True, rank=1, world=2, init_timeout=15) is None


def test_a_replacement_without_in_process_recovery_says_so(server, monkeypatch):
    _replacing(monkeypatch)
    with pytest.raises(RecoveryError, match="recovery.in_process off; expected the configuration the other ranks"):
        replacement.join(in_process=False, rank=1, world=2, init_timeout=15)
    monkeypatch.delenv(REPLACES_ENV)
    monkeypatch.setattr(replacement, "_published", {})
    assert replacement.join(in_process=False, rank=1, world=2, init_timeout=15) is None


def test_another_configuration_and_a_decision_the_dead_rank_gave_are_respected(server, monkeypatch):
    """A replacement whose config is not the run's is refused; a dead rank that had decided "escalate" before it
    died keeps its word (the replacement does not overwrite it)."""
    _replacing(monkeypatch)
    server.set(STATE_KEY, json.dumps(_state(server)))
    with pytest.raises(RecoveryError, match=r"\[rank 1\].*configuration \(fingerprint beef\) is not the one the "
                                            r"others run \(rank 0's: f00d\).*Fix"):
        replacement.join(in_process=True, rank=1, world=2, init_timeout=15, fingerprint="beef")
    monkeypatch.setattr(replacement, "_published", {})
    server.set(f"{SCOPE}/4/decision/1", "escalate (a stuck rank)")
    stop = threading.Event()
    _rank0(server, "escalate", stop)
    with pytest.raises(RecoveryError, match="verdict 'escalate'"):
        replacement.join(in_process=True, rank=1, world=2, init_timeout=15, fingerprint="f00d")
    assert server.get(f"{SCOPE}/4/decision/1") == b"escalate (a stuck rank)"
    stop.set()


def test_a_spare_takes_only_a_python_script_or_module():
    from robustdist.launcher.spare import usable

    assert usable(["-u", "train.py", "--lr", "1"]) and usable(["train.py"]) and usable(["-u", "-m", "pkg.train"])
    assert not usable(["-X", "dev", "train.py"]) and not usable(["-m"]) and not usable(["-u"]) and not usable([])


def test_the_launchers_log_directory_goes_when_empty_and_stays_with_a_file(tmp_path):
    from robustdist.launcher.launch import _remove_empty

    empty, kept = tmp_path / "torchelastic_a", tmp_path / "torchelastic_b"
    (empty / "run" / "attempt_0" / "0").mkdir(parents=True)
    (kept / "run" / "attempt_0" / "1").mkdir(parents=True)
    (kept / "run" / "attempt_0" / "1" / "error.json").write_text("{}")
    (kept / "run" / "attempt_0" / "0").mkdir()
    _remove_empty(str(empty))
    _remove_empty(str(kept))
    assert not empty.exists()
    assert (kept / "run" / "attempt_0" / "1" / "error.json").exists() and not (kept / "run" / "attempt_0" / "0").exists()
