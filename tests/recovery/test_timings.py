"""Each in-process recovery's phases (``robustdist.recovery.timings``): the parts the loop times, and detection
computed from other ranks' words in the store, which may be anything."""

from __future__ import annotations

import types

from robustdist.recovery.faults import Fault
from robustdist.recovery.timings import Clock, Recovery, detection, history


def _watch(seen: object, *walls: object) -> object:
    why = {r: ({"rank": r, "wall": w} if w != "not a dict" else w) for r, w in enumerate(walls)}
    return types.SimpleNamespace(fault=Fault(0, len(walls), why), seen_at=seen)


def test_detection_is_the_watch_s_time_from_the_first_declaration_and_zero_for_the_own_fault():
    assert detection(_watch(105.25, 105.0, 104.5), own=False) == 0.75
    assert detection(_watch(105.25, 105.0), own=True) == 0.0
    assert detection(_watch(100.0, 100.5), own=False) == 0.0  # another node's clock ahead: never negative


def test_detection_from_unusable_words_is_unknown_not_an_error():
    for walls in ([10 ** 400], [float("nan")], [float("inf")], ["105.0"], ["not a dict"], [None], [True and []]):
        assert detection(_watch(105.0, *walls), own=False) is None, walls
    assert detection(_watch(None, 105.0), own=False) is None  # the watch never saw it (the rank's own error)
    assert detection(types.SimpleNamespace(), own=False) is None
    assert detection(_watch(105.5, 10 ** 400, 105.0), own=False) == 0.5  # the usable ones count


def test_a_record_is_kept_and_described_once_restored_or_failed():
    before = len(history())
    clock = Clock(Recovery(3, 1, own=False, what="ValueError: boom", detect_s=0.002))
    clock.record.teardown_s = clock.lap()
    clock.record.rebuild_s = 0.25
    h = types.SimpleNamespace(last_loaded=types.SimpleNamespace(source="memory", from_process=True))
    clock.restored(h, 40)
    failed = Clock(Recovery(4, 1, own=True, what="OSError: x"))
    failed.restored(h, None)
    done = history()[before:]
    assert [(r.generation, r.step, r.source, r.from_process) for r in done] == [(3, 40, "memory", True),
                                                                               (4, None, "failed", False)]
    text = done[0].describe()
    assert text.startswith("rank 1: in-process recovery into generation 3 (another rank's fault): detection 0.002 s")
    assert "rebuild 0.250 s" in text and "(step 40, memory, from this process)" in text
    assert "detection 0.000 s" in done[1].describe() or "detection -" in done[1].describe()
