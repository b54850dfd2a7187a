"""The liveness rule (robustdist.runtime.liveness.Changes): a record that stopped changing, on the reader's clock."""

from __future__ import annotations

import threading

from robustdist.runtime.liveness import Changes


def test_a_record_is_lost_once_seen_unchanged_for_more_than_the_limit_whatever_its_value():
    changes = Changes(3.0)
    changes.see({0: 100.0, 1: -1e9}, now=10.0)  # the values are tokens: a wall time far off is no verdict
    changes.see({0: 101.0, 1: -1e9 + 1}, now=11.0)
    changes.see({0: 102.0, 1: -1e9 + 1}, now=14.0)
    assert changes.quiet(now=14.0) == {0: 0.0, 1: 3.0}
    assert changes.stopped(now=14.0) == []  # exactly the limit is not more than it
    assert changes.stopped(now=14.5) == [1]
    changes.see({1: -1e9 + 2}, now=14.5)  # it wrote again: alive; rank 0 unread this time keeps its clock
    assert changes.stopped(now=14.5) == [] and changes.quiet(now=15.0) == {0: 1.0, 1: 0.5}
    assert changes.stopped(now=17.1) == [0]


def test_a_rank_never_seen_is_not_judged_and_a_new_one_starts_its_clock_when_first_seen():
    changes = Changes(1.0)
    changes.see({0: "a"}, now=0.0)
    changes.see({0: "b", 2: "x"}, now=5.0)
    assert changes.stopped(now=5.5) == [] and 1 not in changes.quiet(now=5.5)
    assert changes.stopped(now=6.5) == [0, 2]


def test_a_reader_held_past_its_gap_judges_nobody_for_that_pause():
    changes = Changes(2.0, gap=1.5)
    changes.see({0: 1, 1: 1}, now=0.0)
    changes.see({0: 2, 1: 1}, now=1.0)
    changes.see({0: 2, 1: 1}, now=10.0)  # this reader was stopped for 9 s: nobody's record could be seen change
    assert changes.stopped(now=10.0) == [] and changes.quiet(now=10.0) == {0: 0.0, 1: 0.0}
    changes.see({0: 3, 1: 1}, now=11.0)
    assert changes.stopped(now=12.5) == [1]  # a record that stays unchanged afterwards is still found


def test_two_threads_looking_at_once_keep_one_consistent_clock():
    changes = Changes(5.0)
    errors: list[BaseException] = []

    def look(offset: int) -> None:
        try:
            for i in range(2000):
                changes.see({r: (offset, i) for r in range(8)}, now=float(i))
                changes.quiet(now=float(i))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=look, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and set(changes.quiet(now=2000.0)) == set(range(8))
