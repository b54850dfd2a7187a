"""``robustdist run``: a rank killed by a signal is started again alone and joins the survivors' in-process
recovery; everything else is torchrun's own path. Real torchrun agents, 2 gloo ranks, the DDP tutorial's shape
(tests/clients/ddp_tutorial_inprocess.py) and the demo (examples/resilient_training.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from robustdist.launcher.spare import idle_possible
from tests._torchrun import ROOT, finish, launch, results, shared_straight, succeeded

pytestmark = pytest.mark.processes

CLIENT = ROOT / "tests" / "clients" / "ddp_tutorial_inprocess.py"
RUN = ("robustdist", "run")
TIMEOUT = 240.0  # a test's 2-rank jobs side by side on 2 cores: each ends in about 10 s alone
EPOCHS_6 = ("--epochs", "6")  # the spared run's length (48 steps)
LONG_LOOK = 60.0  # a --monitor-interval no look of the agent's may wait for: it wakes at a worker's end


@pytest.fixture
def reaped():
    """Launchers a test starts beside the run it watches: killed and reaped if the test fails before it waits for them."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _events(workdir: Path, tag: str, rank: int) -> list[dict]:
    return [json.loads(line) for line in (workdir / f"events-{tag}-rank{rank}.jsonl").read_text().splitlines()]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _tmp_env(path: Path) -> dict[str, str]:
    path.mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(path)}  # torchrun's log directory (torchelastic_*) goes here: the test sees what is left


@pytest.mark.timeout(600)  # the shared straight run (made here or awaited), then its own runs
def test_a_killed_rank_is_replaced_alone_and_the_run_matches_torchrun(tmp_path, tmp_path_factory):
    """SIGKILL of rank 1 mid-run, no spare: rank 0's process keeps running (one pid throughout), rank 1 is a new process that
    joins generation 1, nothing is restarted by torchrun (attempt 0 throughout), and the parameters are bitwise those
    of an uninterrupted torchrun run (the session's shared straight run) and of an uninterrupted robustdist run. The
    agent looks every 60 s, and still starts the replacement at once: it waits for its workers' ends, not for its next
    look."""
    torchrun = shared_straight(tmp_path_factory, CLIENT, timeout=TIMEOUT)
    where = {tag: tmp_path / tag for tag in ("plain", "killed")}
    procs = {"plain": launch(CLIENT, where["plain"], "plain", launcher=RUN, env=_tmp_env(tmp_path / "tmp-plain")),
             "killed": launch(CLIENT, where["killed"], "killed", "--kill", "1:5",
                              launcher=(*RUN, "--spares", "0", f"--monitor-interval={LONG_LOOK}"),
                              env=_tmp_env(tmp_path / "tmp-killed"))}
    logs = succeeded(finish(procs, TIMEOUT))
    final = {"torchrun": results(torchrun, "straight"), **{tag: results(w, tag) for tag, w in where.items()}}
    for tag in ("plain", "killed"):
        for r in range(2):
            _same(final["torchrun"][r][1], final[tag][r][1])
            assert final[tag][r][0]["end"] == final["torchrun"][r][0]["end"] == 24
    survivor, replaced = _events(where["killed"], "killed", 0), _events(where["killed"], "killed", 1)
    assert {e["pid"] for e in survivor} == {final["killed"][0][0]["pid"]}, survivor  # rank 0: one process
    assert [e["event"] for e in replaced if e["pid"] == replaced[0]["pid"]] == ["start", "kill"]
    new = [e for e in replaced if e["pid"] != replaced[0]["pid"]]
    assert [e["event"] for e in new] == ["start", "done"] and new[0]["generation"] == 1, replaced
    assert new[0]["pid"] == final["killed"][1][0]["pid"]
    # the agent woke at the death, not at its next look (--monitor-interval 60 s): the cold replacement ran at once
    took = new[0]["time"] - next(e["time"] for e in replaced if e["event"] == "kill")
    assert took < LONG_LOOK / 2, f"the replacement began {took:.1f} s after the kill; expected well within the interval"
    assert [e["generation"] for e in survivor if e["event"] == "start"] == [0, 1]
    assert {e["attempt"] for e in survivor + replaced} == {0}  # no torchrun restart
    out = logs["killed"]
    assert "rank 1 (local rank 1, pid " in out and "died (signal 9 (SIGKILL)); started it again alone" in out, out
    assert "joins in-process recovery generation 1" in out
    assert "Stopping worker group" not in out and "will restart worker group" not in out, out[-3000:]
    # torchrun leaves its temporary log directory behind; robustdist run removes it (nothing was written there)
    assert list((torchrun.parent / "tmp-straight").glob("torchelastic_*"))
    for tag in ("plain", "killed"):
        assert not list((tmp_path / f"tmp-{tag}").glob("torchelastic_*")), tag


@pytest.mark.timeout(600)  # the shared straight run (made here or awaited), then its own runs
def test_a_killed_rank_0_is_replaced_alone_where_the_agent_serves_the_store(tmp_path, tmp_path_factory):
    """Rank 0 killed mid-run: robustdist run's agent serves each attempt's store (not rank 0's process), so rank 0 is
    started again alone like any rank (rank 1 keeps one process), bitwise. With the agent's store not shared
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, rank 0's process serves the job's port) and in the demo (no in-process
    recovery), torchrun's path, saying why. Every run ends as torchrun's restart makes it end (the demo checks its own
    result bitwise against a straight run and exits 1 otherwise), the others as the session's shared straight run."""
    straight = results(shared_straight(tmp_path_factory, CLIENT, timeout=TIMEOUT), "straight")
    demo = ROOT / "examples" / "resilient_training.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    procs = {
        "rank0": launch(CLIENT, tmp_path / "rank0", "rank0", "--kill", "0:5", launcher=RUN,
                        env=_tmp_env(tmp_path / "tmp-rank0")),
        "own": launch(CLIENT, tmp_path / "own", "own", "--kill", "0:5", launcher=RUN,
                      env={**_tmp_env(tmp_path / "tmp-own"), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
        "demo": subprocess.Popen([sys.executable, "-m", "robustdist", "run", "--standalone", "--nproc_per_node=2",
                                  "--max-restarts=1", str(demo), "--workdir", str(tmp_path / "demo"), "--steps", "30",
                                  "--every", "5", "--kill-step", "17"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)}
    logs = succeeded(finish(procs, TIMEOUT))
    out = logs["rank0"]
    assert "rank 0 (local rank 0, pid" in out, out[-3000:]
    assert "died (signal 9 (SIGKILL)); started it again alone" in out, out[-3000:]
    assert "every worker is stopped and started again" not in out, out[-3000:]
    killed = results(tmp_path / "rank0", "rank0")
    survivor, replaced = _events(tmp_path / "rank0", "rank0", 1), _events(tmp_path / "rank0", "rank0", 0)
    assert {e["pid"] for e in survivor} == {killed[1][0]["pid"]}, survivor  # rank 1: one process throughout
    assert len({e["pid"] for e in replaced}) == 2 and replaced[-1]["pid"] == killed[0][0]["pid"], replaced
    assert max(e["attempt"] for e in replaced + survivor) == 0  # no torchrun restart
    assert [e["generation"] for e in replaced if e["event"] == "start"][-1] == 1
    for r in range(2):
        _same(straight[r][1], killed[r][1])
        assert killed[r][0]["end"] == 24
    own = logs["own"]
    assert "rank 0 (local rank 0) ended with signal 9 (SIGKILL); every worker is stopped and started again" in own
    assert "Rank 0 is replaced alone only where this agent serves the attempt's store" in own, own[-3000:]
    events = _events(tmp_path / "own", "own", 0)
    assert len({e["pid"] for e in events}) == 2 and max(e["attempt"] for e in events) == 1
    restarted = results(tmp_path / "own", "own")
    for r in range(2):
        _same(straight[r][1], restarted[r][1])
        assert restarted[r][0]["end"] == 24
    assert "rank 1 (local rank 1) ended with signal 9 (SIGKILL); every worker is stopped" in logs["demo"]
    assert "The run takes no replacement (it does not recover in process" in logs["demo"], logs["demo"][-3000:]


@pytest.mark.timeout(600)  # the shared straight run (made here or awaited), then its own run
def test_every_rank_killed_at_once_takes_torchruns_restart_at_once(tmp_path, tmp_path_factory):
    """Both ranks SIGKILLed at step 5 with --max-restarts=1: no survivor is left to take a replacement in, so the
    agent does not start them again alone (each would wait for a verdict no rank can give, then the restarts are
    gone); torchrun's one restart runs the job to its end, bitwise. A rank the agent had already started again
    alone before the other's death was seen is not charged: the one restart is torchrun's."""
    straight = results(shared_straight(tmp_path_factory, CLIENT, timeout=TIMEOUT), "straight")
    proc = launch(CLIENT, tmp_path / "all", "all", "--kill=-1:5", launcher=(*RUN, "--spares", "0"),
                  max_restarts=1, env=_tmp_env(tmp_path / "tmp-all"))
    out = succeeded(finish({"all": proc}, TIMEOUT))["all"]
    assert "no survivor is left to take a replacement in" in out, out[-3000:]
    assert "every worker is stopped and started again" in out, out[-3000:]
    ended = results(tmp_path / "all", "all")
    for r in range(2):
        events = _events(tmp_path / "all", "all", r)
        assert "kill" in [e["event"] for e in events if e["attempt"] == 0], events
        assert max(e["attempt"] for e in events) == 1, events  # torchrun's restart, once
        _same(straight[r][1], ended[r][1])
        assert ended[r][0]["end"] == 24


def _reader(proc: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    lines: list[str] = []
    thread = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    thread.start()
    return lines, thread


def _ended(proc: subprocess.Popen, reader: threading.Thread, lines: list[str]) -> str:
    """Wait for the launcher (killing its session past the timeout, or on the way out of a failure); its output."""
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(10)
    return "".join(lines)


def _await_line(lines: list[str], proc: subprocess.Popen, pattern: str, after: int, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in lines[after:]:
            if found := re.search(pattern, line):
                return found
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no line matching {pattern!r} within {timeout:g} s:\n{''.join(lines)[-4000:]}")
    pytest.fail(f"the run ended (exit {proc.returncode}) with no line matching {pattern!r}:\n{''.join(lines)[-4000:]}")


@pytest.mark.timeout(600)  # the shared straight run (made here or awaited), then its own runs
def test_the_warm_spare_forks_each_killed_worker_and_a_killed_spare_is_replaced(tmp_path, tmp_path_factory):
    """The agent's warm spare: killed itself once ready, another is started; then rank 1 is SIGKILLed from outside
    (as the OOM killer does) and the spare forks its replacement, staying warm: the replacement, killed in turn once it
    trains, is forked by the same spare. The run ends bitwise equal to an uninterrupted torchrun run (the session's
    shared straight run of as many epochs: its pacing changes no result), and no spare or forked worker outlives the
    launcher."""
    straight = shared_straight(tmp_path_factory, CLIENT, *EPOCHS_6, timeout=TIMEOUT)
    hold = tmp_path / "hold"  # the spared run waits after step 4 until both spares have warmed (at idle priority, as
    hold.touch()  # long as the other work on the host makes it)
    spared = launch(CLIENT, tmp_path / "spared", "spared", *EPOCHS_6, "--step-sleep", "0.25", "--hold", f"{hold}:4",
                    launcher=RUN, env=_tmp_env(tmp_path / "tmp"), max_restarts=2)  # one per replacement
    lines, reader = _reader(spared)
    try:
        # the spare started with the workers goes to their priority after a moment; the next one stays at idle priority
        # (for up to 30 s: a busy host)
        first = _await_line(lines, spared, r"the warm spare \(pid (\d+)\) is ready after [\d.]+ s, [\d.]+ s after this "
                            r"attempt's workers started \((started with the workers|warmed at the workers' priority)",
                            0, 120)
        os.kill(int(first.group(1)), signal.SIGKILL)
        _await_line(lines, spared, r"the warm spare \(pid %s\) ended with signal 9 \(SIGKILL\); starting another"
                    % first.group(1), 0, 60)
        how = "idle priority" if idle_possible() else "the workers' priority"
        second = _await_line(lines, spared, r"the warm spare \(pid (\d+)\) is ready after [\d.]+ s, [\d.]+ s after this "
                             r"attempt's workers started \(warmed at %s"
                             % how, len(lines) - 1, 120)
        hold.unlink()
        rank1 = [e for e in _events(tmp_path / "spared", "spared", 1) if e["event"] == "start"][-1]["pid"]
        os.kill(rank1, signal.SIGKILL)
        forked = r"rank 1 \(local rank 1, pid %d\) died \(signal 9 \(SIGKILL\)\); started it again alone as " \
            r"pid (\d+) \(replacement %d, forked by the warm spare \(pid %s\)\)"
        one = _await_line(lines, spared, forked % (rank1, 1, second.group(1)), 0, 60)
        deadline = time.monotonic() + 60  # the replacement trains (its own start), then it is killed too
        while not [e for e in _events(tmp_path / "spared", "spared", 1) if e["pid"] == int(one.group(1))
                   and e["event"] == "start"]:
            assert time.monotonic() < deadline and spared.poll() is None, "the replacement never started training"
            time.sleep(0.05)
        os.kill(int(one.group(1)), signal.SIGKILL)
        two = _await_line(lines, spared, forked % (int(one.group(1)), 2, second.group(1)), 0, 60)
    finally:
        hold.unlink(missing_ok=True)
        out = _ended(spared, reader, lines)
    assert spared.returncode == 0, out[-4000:]
    ends = {"straight": results(straight, "straight"), "spared": results(tmp_path / "spared", "spared")}
    for r in range(2):
        _same(ends["straight"][r][1], ends["spared"][r][1])
    assert len({second.group(1), one.group(1), two.group(1)}) == 3  # two forks; the spare itself was no worker
    assert ends["spared"][1][0]["pid"] == int(two.group(1))
    assert {e["pid"] for e in _events(tmp_path / "spared", "spared", 0)} == {ends["spared"][0][0]["pid"]}
    mine = str(tmp_path / "tmp")
    left = []
    for entry in os.listdir("/proc"):  # a spare (or anything) started for this run, still alive
        try:
            if entry.isdigit() and f"TMPDIR={mine}".encode() in Path(f"/proc/{entry}/environ").read_bytes():
                left.append(entry)
        except OSError:
            continue
    assert not left, f"processes of the run left behind: {left}"


@pytest.mark.timeout(600)  # the shared straight run (made here or awaited), then its own runs
def test_a_kill_inside_a_save_and_a_killed_replacement_still_end_bitwise(tmp_path, tmp_path_factory, reaped):
    """Rank 1 SIGKILLed while its in-memory save's background part runs: the survivors resume from a complete step
    (never the half-replicated one) with the replacement. And a replacement SIGKILLed as soon as it starts (a death
    during the recovery): the agent starts another, and the run still ends bitwise (as the session's shared straight
    run: the pacing changes no result)."""
    ref = results(shared_straight(tmp_path_factory, CLIENT, timeout=TIMEOUT), "straight")
    args = ("--step-sleep", "0.1")
    procs = {"save": launch(CLIENT, tmp_path / "save", "save", *args, "--kill", "1:9", "--kill-in-save",
                            launcher=(*RUN, "--spares", "0"), max_restarts=3)}
    twice = launch(CLIENT, tmp_path / "twice", "twice", *args, "--kill", "1:9", launcher=(*RUN, "--spares", "0"),
                   max_restarts=3)
    reaped.extend(procs.values())
    lines, reader = _reader(twice)
    try:
        first = _await_line(lines, twice, r"started it again alone as pid (\d+) \(replacement 1\)", 0, 120)
        os.kill(int(first.group(1)), signal.SIGKILL)
    finally:
        out = _ended(twice, reader, lines)
    assert twice.returncode == 0, out[-4000:]
    logs = succeeded(finish(procs, TIMEOUT))
    for tag in ("save", "twice"):
        for r, (res, params) in enumerate(results(tmp_path / tag, tag)):
            _same(ref[r][1], params)
            assert res["end"] == 24 and res["attempt"] == 0, (tag, res)  # torchrun restarted nothing
    starts = [e for e in _events(tmp_path / "save", "save", 0) if e["event"] == "start"]
    assert [e["generation"] for e in starts] == [0, 1] and starts[1]["step"] in (8, 9), starts
    assert "started it again alone" in logs["save"]
    assert f"rank 1 (local rank 1, pid {first.group(1)}) died (signal 9 (SIGKILL)); started it again alone as pid" \
        in out and "(replacement 2)" in out, out[-4000:]


@pytest.mark.timeout(400)
def test_a_crash_loop_ends_in_the_restart_loop_guard(tmp_path):
    """Rank 1 SIGKILLed at the same step in every process (a replacement included): each death is replaced until
    the survivors' in-process loop sees the same step fail health.max_restarts_without_progress times and
    escalates; torchrun's restarts then end in the restart-loop guard (or run out), and the job fails, bounded."""
    proc = launch(CLIENT, tmp_path / "loop", "loop", "--kill", "1:5", "--always", "--max-no-progress", "2",
                  launcher=(*RUN, "--spares", "0"), max_restarts=4)
    (code, out), = finish({"loop": proc}, TIMEOUT).values()
    assert code != 0, out[-4000:]
    assert "(replacement 1)" in out and "2 faults in a row after resuming from step 4" in out, out[-6000:]
    assert "exited with a code" not in out or "every worker is stopped and started again" in out
    assert "RestartLoopError" in out or "no --max-restarts is left" in out, out[-4000:]
