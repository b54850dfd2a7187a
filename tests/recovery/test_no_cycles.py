"""A closed part of a generation goes with its last reference, not at the next garbage collection.

In-process recovery lets go of the closed generation's parts and runs a full garbage collection (0.15 to 0.2 s
with torch imported: a third of a recovery) only where a reference cycle still holds one of them
(robustdist/recovery/loop.py). So the parts themselves must form no cycle once closed, on the paths a fault
takes: a background save that failed and raised its error from ``wait()`` or ``close()`` while the recovery
has interrupted the waits (its finished frames' locals are then dropped; otherwise kept, for a debugger), a
Hardened object let go of (``run_in_process`` makes one per generation), and a watchdog with its
heartbeat thread; and the failed attempt's own frames (the training function's), whose locals the loop drops
(:func:`robustdist.runtime.errors.drop_locals`). Each case runs with the automatic collector off, so a cycle
would keep the object alive."""

from __future__ import annotations

import gc
import os
import traceback
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from robustdist import harden
from robustdist.checkpoint import AtomicCheckpointer, LocalTier, _faults
from robustdist.health import Watchdog
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import CheckpointError, drop_locals

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        _faults.HOOK = None


def _failing_at(point: str):
    def hook(name: str) -> None:
        if name == point:
            raise OSError(f"injected failure at {point}")
    return hook


def _raised(call: Callable[[], object]) -> str:
    """What ``call`` raised (a CheckpointError), caught as the recovery loop catches it: nothing kept of it."""
    try:
        call()
    except CheckpointError as e:
        return str(e)
    return ""


def _state() -> dict[str, object]:
    model = nn.Linear(4, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def _in_a_recovery(call: Callable[[], object]) -> str:
    """``_raised(call)`` while a recovery has interrupted the waits, as the loop's teardown closes the parts."""
    _dist.interrupt_waits("a fault in a test's recovery generation")
    try:
        return _raised(call)
    finally:
        _dist.resume_waits()


def test_a_checkpointer_whose_background_save_failed_goes_with_its_last_reference(tmp_path, no_collector):
    ckpt = AtomicCheckpointer(tmp_path / "ckpt", async_save=True)
    _faults.HOOK = _failing_at("files_written")
    assert ckpt.save(1, _state()).done.wait(30)  # failed in the background
    assert "injected failure at files_written" in _in_a_recovery(ckpt.wait)
    ref = weakref.ref(ckpt)
    del ckpt
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def test_an_in_memory_tier_whose_background_part_failed_goes_with_its_last_reference(tmp_path, no_collector):
    tier = LocalTier(os.fspath(tmp_path / "shm"), lineage="test")
    _faults.HOOK = _failing_at("local_own_committed")
    assert tier.save(1, _state()).done.wait(30)
    assert "injected failure at local_own_committed" in _in_a_recovery(tier.close)  # after the tier's cleanup
    ref = weakref.ref(tier)
    del tier
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def _kept_in_a_recovery(call: Callable[[], object]) -> CheckpointError:
    """The CheckpointError ``call`` raised while a recovery has interrupted the waits, kept (a report, say)."""
    _dist.interrupt_waits("a fault in a test's recovery generation")
    try:
        call()
    except CheckpointError as e:
        return e
    finally:
        _dist.resume_waits()
    raise AssertionError("expected a CheckpointError")


def test_a_kept_background_error_keeps_neither_its_checkpointer_nor_its_tier_nor_their_snapshots(tmp_path,
                                                                                                 no_collector):
    """Once the caller's frames are cleared, nothing of a kept error holds its owner or the snapshot: the background
    part's frames had their locals dropped, and no closure of the thread holds them."""
    ckpt = AtomicCheckpointer(tmp_path / "ckpt", async_save=True)
    tier = LocalTier(os.fspath(tmp_path / "shm"), lineage="test")
    state = _state()
    weight = weakref.ref(state["model"].weight)  # type: ignore[union-attr]
    _faults.HOOK = _failing_at("files_written")
    assert ckpt.save(1, state).done.wait(30)
    _faults.HOOK = _failing_at("local_own_committed")
    assert tier.save(1, state).done.wait(30)
    kept = [_kept_in_a_recovery(ckpt.wait), _kept_in_a_recovery(tier.close)]
    assert "injected failure at files_written" in str(kept[0])
    assert "injected failure at local_own_committed" in str(kept[1])
    for error in kept:  # the caller's own frames (wait, close) hold the objects as ``self`` until cleared
        traceback.clear_frames(error.__traceback__)
    refs = [weakref.ref(ckpt), weakref.ref(tier)]
    del ckpt, tier, state
    assert [r() is None for r in refs] == [True, True], [type(x).__name__ for r in refs if r() is not None for x in gc.get_referrers(r())]
    assert weight() is None
    assert len(kept) == 2


def test_outside_a_recovery_a_background_error_keeps_its_frames_locals(tmp_path, no_collector):
    ckpt = AtomicCheckpointer(tmp_path / "ckpt", async_save=True)
    _faults.HOOK = _failing_at("files_written")
    assert ckpt.save(1, _state()).done.wait(30)
    try:
        ckpt.wait()
    except CheckpointError as e:
        error: BaseException | None = e
    frames, tb = [], error.__traceback__ if error is not None else None
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert any(f.f_code.co_name != "wait" and "self" in f.f_locals for f in frames), [f.f_code for f in frames]


def test_a_closed_watchdog_with_a_heartbeat_goes_with_its_last_reference(no_collector):
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    dog = Watchdog(600, store=store, rank=0, world_size=2)  # two ranks: a heartbeat thread publishes this one
    assert dog._heartbeat is not None
    dog.attach(nn.Linear(2, 2))
    dog.beat(1)
    dog.close()
    ref = weakref.ref(dog)
    del dog
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


class _Held:
    """Stands for what a training function's frame holds (a model, a batch, a store)."""


def _train_step(held: _Held) -> None:
    try:
        raise ValueError("a fault in the step")
    except ValueError as e:
        kept = e  # noqa: F841 - an error held by a frame on its own traceback: a cycle
        raise


def _suspended():
    try:
        raise KeyError("caught inside a generator, which then yields")
    except KeyError as e:
        yield e
    yield "still usable"


def test_drop_locals_frees_what_a_failed_call_s_frames_held_and_leaves_running_frames_alone(no_collector):
    held = _Held()
    ref = weakref.ref(held)
    error: BaseException | None = None
    try:
        _train_step(held)
    except ValueError as e:
        error = e
    del held
    assert ref() is not None  # the cycle holds the step's frame, and with it what it held
    drop_locals(error)
    assert ref() is None
    assert error is not None and "_train_step" in "".join(traceback.format_tb(error.__traceback__))
    gen = _suspended()
    inner = next(gen)
    drop_locals(inner)  # its traceback's frame is the suspended generator's: not cleared (that would close it)
    assert next(gen) == "still usable"


def test_a_hardened_object_let_go_of_goes_with_its_last_reference(tmp_path, no_collector):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    h = harden(model, None, {"checkpoint": {"dir": str(tmp_path / "ckpt")}, "health": {"nan_policy": "rollback"},
                             "recovery": {"in_process": True}}, optimizer=optimizer)
    h.close(keep_local=True)
    h.generations().let_go()  # as the recovery loop does with each generation's object (run_in_process makes one each time)
    ref = weakref.ref(h)
    del h
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def _earlier(held: _Held) -> None:
    raise KeyError("being handled when the attempt began")


def test_drop_locals_leaves_an_exception_the_caller_was_handling_whole(no_collector):
    held = _Held()
    try:
        _earlier(held)
    except KeyError as before:  # the caller's own: the new failure chains it as its context
        handled = before
        error: BaseException | None = None
        try:
            _train_step(_Held())
        except ValueError as e:
            error = e
    assert error is not None and error.__context__ is handled
    drop_locals(error)  # clears the failed step's frames, not the frames of the caller's own exception
    assert error.__traceback__ is not None and error.__traceback__.tb_next is not None
    assert error.__traceback__.tb_next.tb_frame.f_locals == {}  # _train_step's, finished: cleared
    earlier = handled.__traceback__.tb_next  # _earlier's frame, finished, but not part of the failed attempt
    assert earlier is not None and earlier.tb_frame.f_locals.get("held") is held
