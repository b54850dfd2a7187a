"""The restart-loop guard (``robustdist.health.restart_guard``): a crash loop is stopped at ``resume()`` with the step,
the attempts and their errors; a job that makes progress between restarts is never stopped.

The record is input too (the checkpoint directory is shared and may be tampered with): garbage, links, FIFOs
and huge files are replaced or skipped, never trusted, never followed, never a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from robustdist.health import restart_guard as guard
from robustdist.runtime.errors import CheckpointError
from robustdist.testing.ranks import free_port

pytestmark = pytest.mark.timeout(300)  # torchrun restarts import torch each time: slow when the machine is busy
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _job(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")


def _attempt(d: str, attempt: int, step: int | None, limit: int) -> str | None:
    """What ``Hardened.resume`` does on rank 0: count the attempt, then (if it may go on) note the step."""
    message = guard.begin(d, attempt=attempt, limit=limit)
    if message is None:
        guard.resumed(d, step)
    return message


def test_a_limit_of_one_names_the_one_attempt(tmp_path):
    d = str(tmp_path)
    assert _attempt(d, 0, None, 1) is None
    guard.mark_progress(d, 4)
    assert _attempt(d, 1, 4, 1) is None
    guard.record_error(d, 1, 0, RuntimeError("boom"))
    message = _attempt(d, 2, 4, 1)
    assert message is not None
    assert message.startswith("restart attempt 1 resumed from step 4 (or crashed while resuming) and committed no "
                              "newer checkpoint; this is attempt 2."), message
    assert "attempt 1 rank 0: RuntimeError: boom" in message

def test_fires_after_n_attempts_in_a_row_without_progress(tmp_path):
    d = str(tmp_path)
    assert _attempt(d, 0, None, 3) is None  # fresh run, then it crashes
    guard.mark_progress(d, 10)  # ... after committing step 10
    for attempt in (1, 2, 3):
        assert _attempt(d, attempt, 10, 3) is None
        if attempt == 1:
            guard.record_error(d, 1, 0, RuntimeError("CUDA error: an illegal memory access"))
        guard.record_error(d, attempt, 1, ValueError(f"bad batch in attempt {attempt}"))
    message = _attempt(d, 4, 10, 3)
    assert message is not None
    assert "3 restart attempts in a row (1, 2, 3) resumed from step 10" in message
    assert "this is attempt 4" in message
    assert "attempt 3 rank 1: ValueError: bad batch in attempt 3" in message
    assert "attempt 1 rank 0: RuntimeError: CUDA error" in message
    assert "health.max_restarts_without_progress" in message
    # and again at every further restart (each fails at resume, within seconds)
    assert _attempt(d, 5, 10, 3) is not None


def test_crashes_while_loading_count_too(tmp_path):
    """An attempt that dies inside the load (an OOM, a hang abort) never notes a step: it still counts."""
    d = str(tmp_path)
    assert _attempt(d, 1, 10, 2) is None
    assert guard.begin(d, attempt=2, limit=2) is None  # ... and dies while loading
    message = guard.begin(d, attempt=3, limit=2)
    assert message is not None and "(1, 2) resumed from step 10 (or crashed while resuming)" in message


def test_never_fires_while_restarts_make_progress(tmp_path):
    d = str(tmp_path)
    step = None
    for attempt in range(12):
        assert _attempt(d, attempt, step, 2) is None
        step = (step or 0) + 5
        guard.mark_progress(d, step)


def test_a_commit_after_the_resume_counts_even_if_a_later_resume_lands_on_the_same_step(tmp_path):
    """The in-memory copy of step 20 was lost with a node: the job resumes from 10 again, but it did progress."""
    d = str(tmp_path)
    assert _attempt(d, 1, 10, 1) is None
    guard.mark_progress(d, 20)
    assert _attempt(d, 2, 10, 1) is None
    assert _attempt(d, 3, 10, 1) is not None


def test_a_fresh_launch_or_another_job_starts_a_new_count(tmp_path, monkeypatch):
    d = str(tmp_path)
    for attempt in (1, 2):
        assert _attempt(d, attempt, 10, 2) is None
    assert _attempt(d, 0, 10, 2) is None  # relaunched by hand
    assert _attempt(d, 1, 10, 2) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert _attempt(d, 2, 10, 2) is None
    assert json.loads((tmp_path / guard.RECORD).read_text())["attempts"] == [2]


def _plant(path: Path, kind: str) -> None:
    if kind == "garbage":
        path.write_bytes(b"\xff\x00{not json")
    elif kind == "wrong_types":
        path.write_text(json.dumps({"job": "job-a", "step": "10", "attempts": [1, 2, 3], "progress": False}))
    elif kind == "huge":
        path.write_text(json.dumps({"job": "job-a", "step": 10, "attempts": [1], "progress": False,
                                    "pad": "x" * (1 << 20)}))
    elif kind == "symlink":
        path.symlink_to("/etc/passwd")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        raise AssertionError(kind)


def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for pid in range(os.getpid() - 5, os.getpid() + 5):  # the names an older version used
        (tmp_path / f"{guard.RECORD}.tmp-{pid}").symlink_to(victim)
    assert _attempt(str(tmp_path), 1, 3, 2) is None
    assert victim.read_text() == "precious"
    assert json.loads((tmp_path / guard.RECORD).read_text())["attempts"] == [1]


@pytest.mark.parametrize("kind", ["garbage", "wrong_types", "huge", "symlink", "fifo", "directory"])
def test_a_hostile_record_is_replaced_never_trusted(tmp_path, kind, caplog):
    record = tmp_path / guard.RECORD
    _plant(record, kind)
    passwd = Path("/etc/passwd").read_bytes()
    if kind == "directory":  # not ours to delete, and a guard that cannot count is not silently off
        with pytest.raises(CheckpointError, match=r"restart-loop guard cannot write its record: .*"
                           r"\.robustdist-restarts\.json: is a directory.*Fix: remove the directory"):
            _attempt(str(tmp_path), 3, 10, 1)
        assert record.is_dir()
        return
    assert _attempt(str(tmp_path), 3, 10, 1) is None  # a new record, not [1, 2, 3]
    assert Path("/etc/passwd").read_bytes() == passwd
    assert not record.is_symlink() and record.is_file()
    assert json.loads(record.read_text()) == {"job": "job-a", "step": 10, "attempts": [3], "progress": False}
    assert "restart record" in caplog.text


@pytest.mark.parametrize("attempts", [[0, 0, 0], [3, 2, 1], [1, 1]])
def test_a_forged_record_whose_attempts_do_not_increase_is_replaced_not_obeyed(tmp_path, attempts, caplog):
    """{"attempts": [0, 0, 0], "progress": false} would otherwise stop a healthy job at its first restart."""
    (tmp_path / guard.RECORD).write_text(json.dumps({"job": "job-a", "step": 10, "attempts": attempts,
                                                     "progress": False}))
    assert _attempt(str(tmp_path), 1, 10, 2) is None
    assert json.loads((tmp_path / guard.RECORD).read_text())["attempts"] == [1]
    assert "is not one robustdist writes" in caplog.text


def test_an_error_file_planted_as_a_hard_link_is_replaced_not_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("precious")
    d = tmp_path / "ckpt"
    (d / guard.ERRORS).mkdir(parents=True)
    os.link(victim, d / guard.ERRORS / "attempt_1_rank_0.txt")
    guard.record_error(str(d), 1, 0, RuntimeError("boom"))
    assert victim.read_text() == "precious"
    assert (d / guard.ERRORS / "attempt_1_rank_0.txt").read_text() == "RuntimeError: boom"


def test_an_errors_folder_planted_as_a_link_is_neither_written_nor_emptied_through(tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "attempt_7_rank_0.txt").write_text("someone else's file")
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / guard.ERRORS).symlink_to(outside, target_is_directory=True)
    guard.record_error(str(d), 1, 0, RuntimeError("boom"))  # never raises: an exception is already leaving
    assert "could not record the error" in caplog.text and "symbolic link" in caplog.text
    assert sorted(p.name for p in outside.iterdir()) == ["attempt_7_rank_0.txt"]
    (d / guard.RECORD).write_text(json.dumps({"job": "job-a", "step": 10, "attempts": [1], "progress": True}))
    assert _attempt(str(d), 2, 10, 2) is None  # progress: a new record, which clears the errors folder...
    assert (outside / "attempt_7_rank_0.txt").read_text() == "someone else's file"  # ...never through a link
    (d / guard.RECORD).write_text(json.dumps({"job": "job-a", "step": 10, "attempts": [1, 2], "progress": False}))
    message = _attempt(str(d), 3, 10, 2)
    assert message is not None and "someone else" not in message and "none recorded" in message


def test_hostile_error_files_are_bounded_and_never_followed(tmp_path):
    d = str(tmp_path)
    for attempt in (1, 2):
        assert _attempt(d, attempt, 4, 2) is None
    errors = tmp_path / guard.ERRORS
    errors.mkdir(exist_ok=True)
    (errors / "attempt_1_rank_0.txt").symlink_to("/etc/passwd")
    (errors / "attempt_2_rank_0.txt").write_text("x" * (10 << 20))
    os.mkfifo(errors / "attempt_2_rank_1.txt")
    (errors / "attempt_2_rank_2.txt").write_text("Traceback\nOSError: disk on fire\n")
    message = _attempt(d, 3, 4, 2)
    assert message is not None and "attempt 2 rank 2: OSError: disk on fire" in message
    assert "root:" not in message and "xxxx" not in message


JOB = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch import nn
    from robustdist import harden
    from robustdist.runtime.errors import RestartLoopError

    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    def note(**kw):
        with open(os.path.join(out, f"events-{rank}.jsonl"), "a") as f:
            f.write(json.dumps(kw) + "\\n")
    cfg = {"checkpoint": {"dir": os.path.join(out, "ckpt"), "every_n_steps": 2},
           "health": {"hang_timeout": None, "max_restarts_without_progress": 1}}
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    h = harden(model, None, cfg)
    with h:
        opt = torch.optim.SGD(h.model.parameters(), lr=0.1)
        try:
            step = h.resume(optimizer=opt) or 0
        except RestartLoopError as e:
            note(attempt=h.attempt, event="guard", message=str(e))
            raise
        note(attempt=h.attempt, event="resumed", step=step)
        crash_at = 3 if mode == "loop" else 3 + 2 * h.attempt if h.attempt < 2 else None
        while step < 9:
            h.model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            h.save(step)
            if step == crash_at and rank == 1:
                raise RuntimeError(f"boom at step {step} in attempt {h.attempt}")
        note(attempt=h.attempt, event="done", step=step)
""")


def _torchrun(tmp_path: Path, mode: str, restarts: int) -> list[dict]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--monitor-interval=0.2", str(script), str(tmp_path), mode]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    events = []
    for path in sorted(tmp_path.glob("events-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines()]
    assert events, out.decode()[-3000:]
    return events


@pytest.mark.processes
def test_a_crash_loop_under_torchrun_is_stopped_with_the_step_and_errors(tmp_path):
    """With max_restarts_without_progress=1, attempt 1 resumes from step 2 and crashes at 3 again: attempt 2 is
    stopped at resume() with the step and attempt 1's error, read from the record its predecessor process wrote
    (the count over several attempts is pinned above, on the same record)."""
    events = _torchrun(tmp_path, "loop", restarts=3)
    stopped = [e for e in events if e["event"] == "guard"]
    assert stopped, events
    assert min(e["attempt"] for e in stopped) == 2  # attempt 1 resumed from step 2 and crashed at 3
    for e in [e for e in stopped if e["attempt"] == 2]:
        assert ("restart attempt 1 resumed from step 2 (or crashed while resuming) and committed no newer "
                "checkpoint; this is attempt 2") in e["message"]
        assert "RuntimeError: boom at step 3 in attempt 1" in e["message"]
    assert {e["attempt"] for e in stopped} == {2, 3}  # every further restart stops at resume too
    assert not [e for e in events if e["event"] == "done"]


@pytest.mark.processes
def test_restarts_that_make_progress_finish_the_job(tmp_path):
    """Each restart commits a step past the one it resumed from: two restarts in a row, more than the limit of 1,
    and the job is never stopped."""
    events = _torchrun(tmp_path, "progress", restarts=3)
    assert not [e for e in events if e["event"] == "guard"], events
    done = [e for e in events if e["event"] == "done"]
    assert [(e["attempt"], e["step"]) for e in done] == [(2, 9), (2, 9)]
    resumed = sorted({(e["attempt"], e["step"]) for e in events if e["event"] == "resumed"})
    assert resumed == [(0, 0), (1, 2), (2, 4)]
