"""robustdist.ray.tune's watch on a trial's thread, without Ray: a Hardened made in a trial is closed (once) when
the thread that made it ends; take_over() in the next trial waits for that, but never for the calling thread's
own (a trial that hardens twice); a closed one is not kept alive by the registry."""

from __future__ import annotations

import threading
import time
import weakref

from robustdist.ray import tune


class FakeHardened:
    """What the watch uses of a Hardened: closed, close(), checkpointer, identity, tune."""

    def __init__(self) -> None:
        self.closed, self.closes, self.checkpointer, self.identity, self.tune = False, 0, None, None, object()

    def close(self) -> None:
        time.sleep(0.2)  # a close that takes a moment: take_over must wait for it
        self.closes += 1
        self.closed = True


def test_a_trials_hardened_is_closed_when_its_thread_ends_and_the_next_trial_waits_for_it():
    made: list[FakeHardened] = []
    own_wait: list[float] = []
    release = threading.Event()

    def trial() -> None:
        h = FakeHardened()
        tune.opened(h)
        tune.opened(h)  # registered twice (a recovery's next generation): watched once
        made.append(h)
        start = time.monotonic()
        tune.take_over(timeout=5.0)  # a second harden in the same trial: nothing of its own to wait for
        own_wait.append(time.monotonic() - start)
        release.wait(10)

    thread = threading.Thread(target=trial, name="trial-1")
    thread.start()
    while not own_wait:
        time.sleep(0.01)
    assert own_wait[0] < 1.0
    assert not made[0].closed  # its thread still runs
    release.set()
    thread.join(10)
    tune.take_over(timeout=5.0)  # the next trial: waits until the first's close is done
    h = made[0]
    assert h.closed and h.closes == 1 and h.tune is None  # closed once, and nothing of it reports to Tune
    ref = weakref.ref(h)
    made.clear()
    del h
    assert ref() is None  # the registry let go of it


def test_a_hardened_the_script_closed_is_left_alone():
    made: list[FakeHardened] = []

    def trial() -> None:
        h = FakeHardened()
        tune.opened(h)
        h.close()
        made.append(h)

    thread = threading.Thread(target=trial)
    thread.start()
    thread.join(10)
    tune.take_over(timeout=5.0)
    assert made[0].closes == 1 and not tune._open  # not closed a second time


def test_retire_removes_every_own_step_and_names_one_it_cannot(tmp_path, monkeypatch):
    import pytest
    import torch

    from robustdist.checkpoint import AtomicCheckpointer, _cleanup
    from robustdist.runtime.errors import CheckpointError

    with AtomicCheckpointer(tmp_path / "a") as ckpt:
        for step in (4, 8):
            ckpt.save(step, {"w": torch.ones(2)})
        assert tune.retire(ckpt) == [4, 8] and ckpt.steps() == []
    with AtomicCheckpointer(tmp_path / "b") as ckpt:
        ckpt.save(4, {"w": torch.ones(2)})
        monkeypatch.setattr(_cleanup, "trash", lambda directory, step: None)  # a rename that failed (warned there)
        with pytest.raises(CheckpointError, match=r"its own steps \[4\] in .* could not be set aside .*expected them "
                                                  r"gone.*Fix: make the directory writable"):
            tune.retire(ckpt)
