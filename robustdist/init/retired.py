"""Default groups robustdist destroyed, kept referenced so that their last owner cannot deadlock the process.

``destroy_process_group()`` unregisters a group; the C++ group object lives on while anything holds it, and a
DDP model's ``Reducer`` does. When the model is freed later, the Reducer drops that last reference with the
GIL held (pybind11 frees the Reducer without releasing it), and ``~ProcessGroupGloo`` joins the group's worker
threads. A worker that is still disposing of a collective whose tensors Python created (``all_gather_object``,
a Python ``all_reduce``) needs the GIL to release those tensors: each waits on the other, for ever, with no
Python frame to show for it. It is a race that hits when the model dies within milliseconds of such a
collective, as when ``h.close()`` ends a function whose return frees the model; measured here (torch 2.13,
gloo, 2 ranks, the step guard's all_gather then close), it hung in most runs.

robustdist keeps a Python reference to each default group it destroys. Whichever goes last then decides the
destruction: the model's Reducer, after this reference is dropped (the worker then long finished), or this
reference, whose Python destructor releases the GIL before destroying the group (torch >= 2.8). The references
are dropped when robustdist next creates a group and at interpreter exit, so a job that re-initialises keeps at
most one old group, and the sockets of a group whose model is gone close at the next init or at exit.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

__all__ = ["keep", "release"]

_lock = threading.Lock()
_kept: list[Any] = []
_exit_hook = False


def keep(group: Any) -> None:
    """Hold ``group`` (a destroyed default group's Python object) until :func:`release`."""
    global _exit_hook
    if group is None:
        return
    with _lock:
        _kept.append(group)
        if not _exit_hook:  # registered at first use, not at import: no side effect for a script that never closes
            atexit.register(release)
            _exit_hook = True


def release() -> int:
    """Drop the references :func:`keep` holds; returns how many. The drop itself releases the GIL in torch's
    destructor, and the groups' workers finished their collectives long before."""
    with _lock:
        groups = list(_kept)
        _kept.clear()
    count = len(groups)
    del groups
    return count
