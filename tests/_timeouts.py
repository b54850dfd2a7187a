"""A test that runs past a ``method="thread"`` timeout under pytest-xdist is reported with its stacks.

pytest-timeout's thread method ends the whole process (``os._exit``) once it has written the test's captured
output and every thread's stack to the terminal. In an xdist worker that terminal is not the run's: the report
is lost, and the controller can only say "worker crashed while running" the test. Here the worker writes the
same facts to a file in the run's own temporary directory before it exits, and the controller appends that file
to the crashed test's report, so the run's failure names the timeout and shows where every thread was.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import threading
from typing import Any

import pytest

MAX_REPORT_BYTES = 256 * 1024


def report_path(run_tmp: str, nodeid: str) -> str:
    return os.path.join(run_tmp, "timeouts", hashlib.sha256(nodeid.encode()).hexdigest()[:24] + ".txt")


def set_timer(item: pytest.Item, settings: Any, run_tmp: str | None) -> bool | None:
    """pytest-timeout's ``pytest_timeout_set_timer`` for the thread method in an xdist worker; None elsewhere
    (pytest-timeout's own timer then runs)."""
    if settings.method != "thread" or not hasattr(item.config, "workerinput") or not run_tmp:
        return None
    timer = threading.Timer(settings.timeout, _timed_out, (item, settings.timeout, report_path(run_tmp, item.nodeid)))
    timer.name = f"tests._timeouts {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # what pytest-timeout's cancel hook calls
    timer.start()
    return True


def _timed_out(item: pytest.Item, timeout: float, path: str) -> None:
    """Write what the test was doing, then end the worker as pytest-timeout's thread method does."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"the test ran past its {timeout:g} s timeout (pytest-timeout, method \"thread\"), so its "
                    f"worker (pid {os.getpid()}) was ended; where every thread was:\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
    finally:
        os._exit(1)


def describe_crash(run_tmp: str | None, nodeid: str, report: pytest.TestReport) -> None:
    """The controller's ``pytest_handlecrashitem``: the crashed test's report gains the timeout report its worker
    wrote, if it wrote one."""
    if not run_tmp:
        return
    try:
        with open(report_path(run_tmp, nodeid), errors="replace") as f:
            text = f.read(MAX_REPORT_BYTES)
    except OSError:  # no timeout report: the worker died of something else
        return
    report.longrepr = f"{report.longrepr}\n{text}"
