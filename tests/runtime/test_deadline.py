"""``robustdist.runtime.deadline.bounded``: the one helper for a blocking call with a deadline (store
constructors and reads, name lookups, the hang report, the in-memory tier's point-to-point waits)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from robustdist.runtime import deadline
from robustdist.runtime.deadline import bounded


def test_a_call_that_returns_gives_its_value():
    assert bounded(lambda: 42, time.monotonic() + 5, "value") == (42, None, True)


def test_a_call_that_raises_hands_the_error_over_even_a_base_exception():
    def fail() -> None:
        raise SystemExit("ended")

    value, error, finished = bounded(fail, time.monotonic() + 5, "error")
    assert value is None and isinstance(error, SystemExit) and finished


def test_a_call_past_its_deadline_is_left_running_and_the_caller_goes_on():
    release = threading.Event()
    start = time.monotonic()
    value, error, finished = bounded(release.wait, start + 0.3, "late")
    elapsed = time.monotonic() - start
    assert (value, error, finished) == (None, None, False)
    assert 0.25 < elapsed < 2.0, elapsed
    assert any(t.name == "robustdist-late" and t.daemon for t in threading.enumerate())
    release.set()


def test_stop_ends_the_wait_early_and_leaves_the_call_running():
    release, asked = threading.Event(), []

    def stop() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 3

    start = time.monotonic()
    assert bounded(release.wait, start + 30, "stopped", stop=stop) == (None, None, False)
    assert time.monotonic() - start < 5 and len(asked) == 3
    release.set()


def test_a_call_expected_to_end_is_joined_at_exit_for_a_bounded_time():
    """The interpreter waits for a call left running that ends by ``ends_by`` (so it is not ended inside C++
    frames), but never past :data:`EXIT_WAIT_S`, even for one that never ends."""
    script = textwrap.dedent("""
        import sys, time
        from robustdist.runtime.deadline import bounded
        def slow():
            time.sleep(1.0)
            sys.stdout.write("ended\\n"); sys.stdout.flush()
        bounded(slow, time.monotonic() + 0.1, "slow", ends_by=time.monotonic() + 2.0)
        bounded(lambda: time.sleep(3600), time.monotonic() + 0.1, "never", ends_by=time.monotonic() + 3600)
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ended\n", done.stdout  # joined: the slow call finished before the exit
    assert elapsed < deadline.EXIT_WAIT_S + 15, elapsed  # the endless one was given up at the exit bound


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_a_deadline_already_passed_is_not_waited_for(timeout):
    release = threading.Event()
    assert bounded(release.wait, time.monotonic() + timeout, "passed") == (None, None, False)
    release.set()
