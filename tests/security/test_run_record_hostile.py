"""The run record (``<checkpoint dir>/.robustdist-run.json``) is input: runs never mix, and a broken or
hostile record is a named error, never adopted, overwritten or followed outside the directory.

Also the watchdog's training-thread naming (a thread other than the main one beats, as under Ray Train V2).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from robustdist import CheckpointError, harden
from robustdist.checkpoint._run_owner import RUN_RECORD, RunIdentity, claim
from robustdist.health.step_guard import Watchdog
from robustdist.runtime.dist import Collectives

ONE = Collectives(None, 0, 1, timeout=10, arrival_timeout=10, error=CheckpointError)


def _record(directory):
    return json.loads((directory / RUN_RECORD).read_text())


def test_first_run_records_itself_and_the_same_run_resumes(tmp_path):
    claim(str(tmp_path), RunIdentity("trial-a", "c1", "Ray"), 0, ONE)
    assert _record(tmp_path) == {"format": 1, "run": "trial-a", "config": "c1", "source": "Ray"}
    claim(str(tmp_path), RunIdentity("trial-a", "c1", "Ray"), 0, ONE)  # a restart of the same run
    claim(str(tmp_path), RunIdentity(None, None), 0, ONE)  # an unnamed job is not compared
    assert _record(tmp_path)["run"] == "trial-a"


@pytest.mark.parametrize("theirs, ours, differ", [
    (("trial-a", "c1"), ("trial-b", "c1"), "run"),
    (("trial-a", "c1"), ("trial-a", "c2"), "config"),
    (("trial-a", "c1"), ("trial-b", "c2"), "run, config"),
])
def test_another_run_is_refused_naming_both(tmp_path, theirs, ours, differ):
    claim(str(tmp_path), RunIdentity(*theirs, "Ray"), 0, ONE)
    before = (tmp_path / RUN_RECORD).read_bytes()
    with pytest.raises(CheckpointError) as e:
        claim(str(tmp_path), RunIdentity(*ours, "Ray"), 0, ONE)
    text = str(e.value)
    assert f"belongs to run {theirs[0]!r}" in text and f"but this is run {ours[0]!r}" in text
    assert f"(they differ in: {differ})" in text and "Fix:" in text
    assert (tmp_path / RUN_RECORD).read_bytes() == before  # the record is never taken over


def test_a_named_run_fills_in_what_an_unnamed_one_left(tmp_path):
    claim(str(tmp_path), RunIdentity("job", None), 0, ONE)
    claim(str(tmp_path), RunIdentity("job", "c9", "Ray"), 0, ONE)
    assert _record(tmp_path)["config"] == "c9"


@pytest.mark.parametrize("content", [
    b"", b"{", b"\xff\xfe", b"[]", b'{"format": 2, "run": "x"}', b'{"format": 1, "run": 5}',
    b'{"format": 1, "run": "' + b"a" * 5000 + b'"}', b"[" * 100000 + b"]" * 100000,
    b'{"format": 1, "run": "x"}' + b" " * (70 << 10),
    b'\xef\xbb\xbf{"format": 1, "run": "x"}', '{"format": 1, "run": "x"}'.encode("utf-16"),
    b'{"format": 1, "run": "\xed\xa0\x80"}',  # a lone surrogate
])
def test_a_malformed_record_is_refused_not_adopted(tmp_path, content):
    (tmp_path / RUN_RECORD).write_bytes(content)
    with pytest.raises(CheckpointError, match="the run record is unreadable.*Fix: if this directory's checkpoints"):
        claim(str(tmp_path), RunIdentity("mine", "c"), 0, ONE)
    assert (tmp_path / RUN_RECORD).read_bytes() == content


def test_links_and_directories_in_place_of_the_record_are_refused(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"format": 1, "run": "mine", "config": "c", "source": "x"}))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / RUN_RECORD)  # a record that points outside the directory is not followed
    with pytest.raises(CheckpointError, match="unreadable"):
        claim(str(ckpt), RunIdentity("mine", "c"), 0, ONE)
    os.unlink(ckpt / RUN_RECORD)
    (ckpt / RUN_RECORD).mkdir()
    with pytest.raises(CheckpointError, match="unreadable"):
        claim(str(ckpt), RunIdentity("mine", "c"), 0, ONE)


def test_harden_refuses_another_jobs_directory_before_reading_it(tmp_path):
    model = torch.nn.Linear(2, 1)
    cfg = {"checkpoint": {"dir": str(tmp_path), "run_name": "job-a"}, "health": {"hang_timeout": None}}
    with harden(model, None, cfg) as h:
        h.save(1, force=True)
    with pytest.raises(CheckpointError, match="belongs to run 'job-a'.*but this is run 'job-b'"):
        harden(model, None, {**cfg, "checkpoint": {"dir": str(tmp_path), "run_name": "job-b"}})
    with harden(model, None, cfg) as h:  # job-a itself resumes
        assert h.resume() == 1


def test_run_name_is_validated():
    from robustdist import ConfigError

    for bad in ("", "../x", "a/b", "a" * 101, "..", 5):
        with pytest.raises(ConfigError, match="checkpoint.run_name"):
            harden(torch.nn.Linear(2, 1), None, {"checkpoint": {"dir": "/tmp/x", "run_name": bad}})


def test_the_hang_report_names_the_thread_that_beats(tmp_path):
    dog = Watchdog(1.0, dump_dir=tmp_path, rank=0, world_size=1)
    stop = threading.Event()

    def training():  # like Ray Train V2's TrainingThread: the main thread is elsewhere
        dog.beat(7)
        stop.wait(30)

    worker = threading.Thread(target=training, name="TrainingThread(train_fn)")
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while not dog.reports and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join()
        dog.close()
    assert dog.reports, "no hang reported"
    dump = open(dog.reports[0].dump_path).read()
    assert "training thread TrainingThread(train_fn) in wait (threading.py:" in dump.splitlines()[0]


# ---------------------------------------------------------------------------------------------- Ray's checkpoint
def _ray_copy(tmp_path, step):
    """A checkpoint as Ray Train hands it back: a directory holding one robustdist step's files."""
    import shutil

    from ray.train import Checkpoint

    source = tmp_path / "other"
    with harden(torch.nn.Linear(2, 1), None, {"checkpoint": {"dir": str(source)}, "health": {"hang_timeout": None}}) as h:
        h.save(step, force=True, metrics={"loss": 0.5})
    copy = tmp_path / "ray" / f"step_{step:010d}-abc"
    shutil.copytree(source / f"step_{step:010d}", copy)
    return copy, Checkpoint.from_directory(str(copy))


@pytest.fixture
def hardened(tmp_path):
    pytest.importorskip("ray")
    torch.manual_seed(0)
    h = harden(torch.nn.Linear(2, 1), None, {"checkpoint": {"dir": str(tmp_path / "ckpt")},
                                             "health": {"hang_timeout": None}})
    h.save(3, force=True)
    yield h
    h.close()


def test_a_newer_valid_ray_checkpoint_is_resumed_with_its_metrics(hardened, tmp_path):
    _, checkpoint = _ray_copy(tmp_path, 6)
    assert hardened._load(missing_ok=True, ray_checkpoint=checkpoint, ray_step=6) == 6
    assert hardened.last_loaded.source == "ray" and hardened.last_metrics == {"step": 6, "loss": 0.5}


@pytest.mark.parametrize("damage", ["manifest", "payload", "link"])
def test_a_damaged_ray_checkpoint_falls_back_to_robustdists_own(hardened, tmp_path, damage, caplog):
    from robustdist.ray import train as _ray_train

    copy, checkpoint = _ray_copy(tmp_path, 6)
    if damage == "manifest":
        (copy / "manifest.json").write_text('{"format": 1, "step": "six"}')
        step, why = _ray_train.checkpoint_step(checkpoint)
        assert step is None and "CheckpointCorruptError" in why
    elif damage == "payload":
        data = bytearray((copy / "replicated.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (copy / "replicated.pt").write_bytes(bytes(data))
    else:
        outside = tmp_path / "outside.pt"
        (copy / "replicated.pt").rename(outside)
        os.symlink(outside, copy / "replicated.pt")
    caplog.set_level("WARNING")
    assert hardened._load(missing_ok=True, ray_checkpoint=checkpoint, ray_step=6) == 3
    assert hardened.last_loaded.source == "durable"
    assert "failed to load" in caplog.text and "falling back to robustdist's own" in caplog.text


def test_a_checkpoint_dir_that_is_a_link_you_made_keeps_working(tmp_path):
    (tmp_path / "lustre").mkdir()
    os.symlink(tmp_path / "lustre", tmp_path / "scratch")  # /scratch -> /lustre/...: the link is yours, resolved once
    cfg = {"checkpoint": {"dir": str(tmp_path / "scratch" / "ckpt"), "run_name": "job-a"},
           "health": {"hang_timeout": None}}
    with harden(torch.nn.Linear(2, 1), None, cfg) as h:
        h.save(1, force=True)
    with harden(torch.nn.Linear(2, 1), None, cfg) as h:  # the same run's restart: its record is readable
        assert h.resume() == 1 and h.checkpointer.directory == str(tmp_path / "lustre" / "ckpt")


def test_close_releases_everything_even_when_the_report_to_ray_fails(tmp_path, monkeypatch):
    from robustdist.ray import train as _ray_train

    h = harden(torch.nn.Linear(2, 1), None, {"checkpoint": {"dir": str(tmp_path)}, "health": {"hang_timeout": 30}})
    h.ray = _ray_train.RayTrain("run", None, 0)  # as inside Ray Train (async: reported at the next save or close)
    h.config = h.config.replace(checkpoint={"async_save": True})

    def broken(*args, **kwargs):
        raise OSError("storage unreachable")

    monkeypatch.setattr(_ray_train, "report", broken)
    h.save(1, force=True)
    with pytest.raises(OSError, match="storage unreachable"):
        h.close()
    assert not h.watchdog._thread.is_alive()  # the watchdog was stopped anyway
    with harden(torch.nn.Linear(2, 1), None, {"checkpoint": {"dir": str(tmp_path)}}) as again:  # the lock is free
        assert again.resume() == 1


def _fake_ray(monkeypatch, h, checkpoint, run="mine"):
    """Only the Ray Train context is faked (it needs a Train worker); the resume path is the real one."""
    from robustdist.checkpoint._run_owner import RunIdentity
    from robustdist.ray import train as _ray_train

    h.ray = _ray_train.RayTrain(run, None, 0)
    h.identity = RunIdentity(run, None, "Ray Train RunConfig.name")
    monkeypatch.setattr(_ray_train, "latest_checkpoint", lambda: checkpoint)
    reported: list = []
    monkeypatch.setattr(_ray_train, "report_metrics", reported.append)
    return reported


def test_rays_checkpoint_of_another_run_is_not_resumed(hardened, tmp_path, monkeypatch, caplog):
    import shutil

    from ray.train import Checkpoint

    other = tmp_path / "other-run"
    with harden(torch.nn.Linear(2, 1), None, {"checkpoint": {"dir": str(other), "run_name": "theirs"},
                                              "health": {"hang_timeout": None}}) as h:
        h.save(9, force=True)
    shutil.copytree(other / "step_0000000009", tmp_path / "ray-9")
    caplog.set_level("WARNING")
    reported = _fake_ray(monkeypatch, hardened, Checkpoint.from_directory(str(tmp_path / "ray-9")))
    assert hardened.resume() == 3  # its own step, not the other run's newer one
    assert "not resumed from: it belongs to run 'theirs'" in caplog.text
    hardened.close()  # resumed and reported nothing since: its own metrics are reported again
    assert reported == [{"step": 3}]


def test_a_valid_ray_copy_wins_over_a_corrupt_own_newest(hardened, tmp_path, monkeypatch):
    import shutil

    from ray.train import Checkpoint

    hardened.save(6, force=True)
    shutil.copytree(tmp_path / "ckpt" / "step_0000000006", tmp_path / "ray-6")
    data = bytearray((tmp_path / "ckpt" / "step_0000000006" / "replicated.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "ckpt" / "step_0000000006" / "replicated.pt").write_bytes(bytes(data))
    reported = _fake_ray(monkeypatch, hardened, Checkpoint.from_directory(str(tmp_path / "ray-6")))
    assert hardened.resume() == 6 and hardened.last_loaded.source == "ray"
    hardened.close()
    assert reported == [{"step": 6}]


@pytest.mark.processes
def test_the_config_fingerprint_is_stable_and_bounded():
    import subprocess
    import sys

    import numpy as np

    from robustdist.ray.train import fingerprint

    assert fingerprint({"bs": np.int64(16)}) != fingerprint({"bs": np.int64(64)})
    assert fingerprint({"lr": 0.1, "n": 2}) == fingerprint({"n": 2, "lr": 0.1})
    loop: dict = {}
    loop["a"] = loop
    loop["b"] = loop
    started = time.monotonic()
    fingerprint(loop)  # a self-referencing config is cut off, not walked forever
    assert time.monotonic() - started < 5
    code = ("from robustdist.ray.train import fingerprint\nclass K: pass\n"
            "print(fingerprint({K(): 1, 'lr': object()}))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
            for _ in range(2)}
    assert len(runs) == 1  # objects (keys or values) count by type, never by a repr holding an address


def test_an_unwritable_directory_is_named_on_every_rank_not_a_collective_failure(tmp_path, monkeypatch):
    from robustdist.checkpoint import _run_owner

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_run_owner, "_create", refuse)
    with pytest.raises(CheckpointError) as e:
        claim(str(tmp_path), RunIdentity("mine", "c"), 0, ONE)
    text = str(e.value)
    assert f"could not record or check the run record in {tmp_path} (PermissionError:" in text
    assert "expected a writable checkpoint directory. Fix: check its permissions and free space." in text
