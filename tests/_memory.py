"""Peak memory of one call, measured in the pytest worker that runs it.

``ru_maxrss`` only ever grows: in a worker that earlier tests took to 1 GiB, a call that allocates 900 MiB does not
move it, so a bound on its growth cannot fail. The kernel's high-water mark can be reset instead (writing ``5`` to
``/proc/self/clear_refs``, Linux >= 4.0): :func:`peak_growth` resets it, runs the call, and returns how far the
peak rose above the resident size at the start, whatever the worker did before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def peak_growth(fn: Callable[[], Any]) -> int:
    """Bytes by which ``fn()`` raised this process's peak resident size above its resident size before the call."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark (VmHWM) becomes the current resident size
    before = _status_kib("VmRSS")
    assert _status_kib("VmHWM") <= before + 1024, "the peak was not reset (a kernel without clear_refs 5?)"
    fn()
    return (_status_kib("VmHWM") - before) << 10
