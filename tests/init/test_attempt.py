"""One attempt number for the whole job, from the job's store, never from TORCHELASTIC_RESTART_COUNT.

* Under real torchrun --max-restarts=1: a rank SIGKILLs itself on attempt 0 and every rank of the restarted
  group reports attempt 1; and the same in the run in which rank 0 overwrites its TORCHELASTIC_RESTART_COUNT
  before init (rank 1 leaves it as torchrun set it).
* Without torchrun's processes, the same store protocol with a job-lifetime store hosted by the test (standing
  in for torchrun's agent): consecutive "attempts" count 0, 1, 2 on every rank whatever the variable says; rank
  0's count is shared without a per-attempt store; an adopted group is counted once.
* Only where torchrun shares no store with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the ranks agree
  on the largest TORCHELASTIC_RESTART_COUNT of any rank.
* Everything else (no launcher, run_ranks, one process) is attempt 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from robustdist import harden
from robustdist.config.schema import DistributedConfig
from robustdist.init import elastic_store as _elastic_store
from robustdist.init.process_group import adopt_group, destroy_process_group_if_owned, safe_init_process_group
from robustdist.testing.ranks import run_ranks
from tests import _procs
from tests import _training as tr

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 150
CFG = DistributedConfig(timeout=60, barrier_timeout=30, init_timeout=30)


WORKER = textwrap.dedent('''
    """A torchrun worker: record the attempt robustdist reports; rank 1 SIGKILLs itself on attempt 0."""
    import ctypes, json, os, signal, sys
    from pathlib import Path

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: never outlive torchrun
    import torch.distributed as dist
    from robustdist.config import DistributedConfig
    from robustdist.init.process_group import destroy_process_group_if_owned, safe_init_process_group

    out, tamper = Path(sys.argv[1]), "--tamper" in sys.argv
    rank, told = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    if tamper and rank == 0:  # say the opposite of what torchrun said, as a script or a stale shell might
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1" if told == "0" else "0"
    report = safe_init_process_group(DistributedConfig(timeout=60, barrier_timeout=30, init_timeout=30))
    record = {"attempt": report.attempt, "torchrun_said": told, "env_at_init": os.environ["TORCHELASTIC_RESTART_COUNT"]}
    (out / f"attempt{report.attempt}-rank{rank}.json").write_text(json.dumps(record))
    if report.attempt == 0:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the fault: torchrun restarts the whole group
        dist.barrier()  # rank 0 learns of it here (gloo: connection reset) or is stopped by torchrun
        sys.exit(1)
    dist.barrier()
    destroy_process_group_if_owned(report)
''')


def _torchrun(tmp_path: Path, *args: str, env_extra: dict[str, str] | None = None) -> str:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    own_tmp = tmp_path / "tmp"  # torchrun leaves its log directory in its TMPDIR: this run's own, even for a
    own_tmp.mkdir(exist_ok=True)  # module fixture's run (set up before the test's own TMPDIR)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(own_tmp),
           **(env_extra or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.2", str(script), str(tmp_path), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {RUN_TIMEOUT} s (killed with its workers):\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """torchrun starts each worker in a session of its own: kill the workers by pid, then torchrun's group."""
    for pid in _procs.descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)


def _records(tmp_path: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(tmp_path.glob("attempt*-rank*.json"))}


@pytest.fixture(scope="module")
def agent_store_run(tmp_path_factory) -> dict[str, dict]:
    """One torchrun run with its shared store (the default) in which rank 0 overwrites its
    TORCHELASTIC_RESTART_COUNT before init and rank 1 leaves it as torchrun set it, read by the two tests below
    that check the default launch."""
    out = tmp_path_factory.mktemp("agent-store-run")
    _torchrun(out, "--tamper")
    return _records(out)


@pytest.mark.processes
@pytest.mark.xdist_group("attempt_agent_store_run")  # one worker makes the run [agent-store] and the next test read
@pytest.mark.parametrize("shared", [True, False], ids=["agent-store", "no-shared-store"])
def test_every_rank_reports_attempt_one_after_a_real_sigkill_under_torchrun(tmp_path, shared, request):
    """With torchrun's shared store (the default) the number is counted there (the run in which rank 0 also
    overwrites its variable: rank 1 is the untouched default); with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 no store
    outlives an attempt and the ranks agree on the largest count."""
    if shared:
        records = request.getfixturevalue("agent_store_run")
    else:
        _torchrun(tmp_path, env_extra={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        records = _records(tmp_path)
    assert sorted(records) == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"]
    assert [records[f"attempt1-rank{r}"]["attempt"] for r in (0, 1)] == [1, 1]
    assert [records[f"attempt0-rank{r}"]["attempt"] for r in (0, 1)] == [0, 0]


@pytest.mark.processes
@pytest.mark.xdist_group("attempt_agent_store_run")
def test_a_rank_that_overwrites_its_restart_count_still_gets_the_stores_attempt(agent_store_run):
    records = agent_store_run
    # rank 0 said "1" on the first attempt and "0" on the second: the shape of torch #108158 on a 2-node job
    assert records["attempt0-rank0"] == {"attempt": 0, "torchrun_said": "0", "env_at_init": "1"}
    assert records["attempt1-rank0"] == {"attempt": 1, "torchrun_said": "1", "env_at_init": "0"}
    assert records["attempt0-rank1"]["attempt"] == 0 and records["attempt1-rank1"]["attempt"] == 1


# ---------------------------------------------------------------------------------- the store protocol, fast
def _attempt(rank: int) -> tuple[int, str]:
    report = safe_init_process_group(CFG)
    try:
        return report.attempt, os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    finally:
        destroy_process_group_if_owned(report)


@pytest.fixture
def agent_store():
    """A job-lifetime store, as torchrun's agent hosts one for its workers (TORCHELASTIC_USE_AGENT_STORE=True)."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield store


def _torchrun_env(store, restarts: str) -> dict[str, str]:
    return {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "attempt-test",
            "TORCHELASTIC_MAX_RESTARTS": restarts, "MASTER_PORT": str(store.port)}


@pytest.mark.processes
def test_attempts_count_up_on_every_rank_whatever_the_variable_says(agent_store):
    """Three consecutive groups on one job-lifetime store (what torchrun restarts look like to the workers):
    0, 1, 2 on both ranks, while TORCHELASTIC_RESTART_COUNT disagrees across ranks every time."""
    env = _torchrun_env(agent_store, "3")
    seen = []
    for told in (("0", "0"), ("1", "0"), ("0", "7")):
        seen.append(run_ranks(_attempt, 2, init=False, timeout=90,
                              env=[{**env, "TORCHELASTIC_RESTART_COUNT": t} for t in told]))
    assert seen == [[(0, "0"), (0, "0")], [(1, "1"), (1, "0")], [(2, "0"), (2, "7")]]


@pytest.mark.processes
def test_without_restarts_rank_zeros_count_is_shared(agent_store):
    """No per-attempt store (--max-restarts=0): rank 0 counts in the agent's store and the others take its number
    through the group. Four attempts were counted before this one."""
    agent_store.add(_elastic_store._COUNTER, 4)
    out = run_ranks(_attempt, 2, init=False, timeout=90, env=_torchrun_env(agent_store, "0"))
    assert [attempt for attempt, _ in out] == [4, 4]


@pytest.mark.processes
def test_without_a_shared_store_the_ranks_agree_on_the_largest_restart_count():
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0's worker serves a store that lives for this attempt only. After
    a node's agent was restarted, its count is 0 while the other node's is 1 (seen in the node lab)."""
    env = {"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RUN_ID": "attempt-test",
           "TORCHELASTIC_MAX_RESTARTS": "1"}
    out = run_ranks(_attempt, 2, init=False, timeout=90,
                    env=[{**env, "TORCHELASTIC_RESTART_COUNT": told} for told in ("1", "0")])
    assert out == [(1, "1"), (1, "0")]


def _adopt_twice(rank: int) -> tuple[int, int, int]:
    first = adopt_group(CFG).attempt
    second = adopt_group(CFG).attempt  # the same group: counted once, not again
    h = harden(tr.make_model(), None, {"health": {"hang_timeout": None}})
    try:
        return first, second, h.attempt
    finally:
        h.close()


@pytest.mark.processes
def test_an_adopted_group_is_counted_once_and_harden_reports_the_same(agent_store):
    """The script made the group itself with a plain init_process_group on the agent's store (run_ranks does, as a
    script under torchrun would): rank 0 counts in that store once, however often the group is adopted."""
    agent_store.add(_elastic_store._COUNTER, 2)
    out = run_ranks(_adopt_twice, 2, timeout=90,
                    env={"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(agent_store.port)})
    assert out == [(2, 2, 2), (2, 2, 2)]
    assert agent_store.add(_elastic_store._COUNTER, 0) == 3


@pytest.mark.processes
def test_no_launcher_store_means_attempt_zero():
    assert run_ranks(_attempt, 2, init=False, timeout=90, env={"TORCHELASTIC_RESTART_COUNT": "3"}) == \
        [(0, "3"), (0, "3")]


def test_one_process_is_attempt_zero(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with harden(tr.make_model(), None, {"health": {"hang_timeout": None}}) as h:
        assert h.attempt == 0 and h.init_report.attempt == 0 and not h.init_report.distributed


def _init_twice(rank: int) -> tuple[int, int]:
    return _attempt(rank)[0], _attempt(rank)[0]


@pytest.mark.processes
def test_a_second_init_in_the_same_process_is_the_same_attempt(agent_store):
    """A retry around init, or a second harden(), in one worker process is not a restart (found by review:
    it used to count the next attempt)."""
    out = run_ranks(_init_twice, 2, init=False, timeout=90, env=_torchrun_env(agent_store, "1"))
    assert out == [(0, 0), (0, 0)]
    assert agent_store.add(_elastic_store._COUNTER, 0) == 1  # counted once
