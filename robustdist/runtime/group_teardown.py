"""Destroy a process group without letting a DDP module free it last (a hang at teardown).

``destroy_process_group()`` only unregisters a group: every ``DistributedDataParallel`` module built on it keeps
it alive through its C++ ``Reducer``. When such a module is freed later, the Reducer can drop the group's last
reference with the GIL held (pybind11 frees it without releasing the GIL), and ``~ProcessGroupGloo`` then joins
a gloo worker that is itself waiting for the GIL to free the Python tensors of an earlier collective (DDP's
construction broadcast, say). Each waits on the other for ever, with no Python frame past the line that freed
the module. A script's own ``DistributedDataParallel`` (what Ray's ``prepare_model`` hands a script) freed after
``h.close()`` hangs so (torch 2.13, gloo): the main thread in ``~Reducer -> ~ProcessGroup -> ~ProcessGroupGloo ->
std::thread::join``, a gloo worker in ``~AsyncBroadcastWork -> decref_pyobject -> take_gil``.

:func:`pin_ddp_modules` gives every live DDP module one more reference to the group's Python
object, stored as its last attribute, so it is released after the Reducer (and the Logger that holds the
Reducer): the group's last owner is then that Python object, whose destructor releases the GIL before
destroying the group (torch >= 2.8). The pin is freed with the module, so nothing outlives it.
:func:`destroy_default_group` pins, then destroys the default group; robustdist destroys every default group
it created that way.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from robustdist.runtime import dist as _dist

__all__ = ["GROUP_PIN", "destroy_default_group", "live_ddp_modules", "pin_ddp_modules", "pin_module",
           "retire_ddp_modules"]

log = logging.getLogger(__name__)

GROUP_PIN = "_robustdist_group_after_reducer"
"""The attribute a DDP module's pin is stored under (its last attribute)."""


def pin_module(module: Any, group: Any) -> None:
    """Store ``group`` as ``module``'s last attribute (re-inserted if it was already there)."""
    attrs = module.__dict__
    attrs.pop(GROUP_PIN, None)
    attrs[GROUP_PIN] = group


def _ddp_classes() -> list[type]:
    """torch's DistributedDataParallel and every subclass of it defined so far."""
    classes, todo = [], [_TorchDDP]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


def live_ddp_modules() -> int:
    """How many DDP modules (any subclass) are alive in this process (one garbage-collector referrer pass)."""
    return _each_ddp_module(lambda ref, attrs: True)


def pin_ddp_modules() -> int:
    """Pin every live DDP module's group (whichever group it is on) as its last attribute; returns how many.

    ``destroy_process_group()`` tears down every group, not only the default one, and a group another library
    destroys later (Ray Train's) needs the same, so every DDP module is pinned, not only those on the default
    group. Found as the referrers of the DDP classes (an instance refers to its class): one garbage-collector
    pass over the tracked objects, 29-33 ms with 284k-315k objects here (benchmarks/findings.md T1), so a DDP
    module robustdist never saw (the script's own, the one Ray's ``prepare_model`` made) is pinned too."""
    def pin(ref: Any, attrs: dict[str, Any]) -> bool:
        group = attrs.get("process_group")
        if group is not None and "reducer" in attrs:
            pin_module(ref, group)
            return True
        return False

    return _each_ddp_module(pin)


def _each_ddp_module(visit: Callable[[Any, dict[str, Any]], bool]) -> int:
    """Call ``visit(module, module.__dict__)`` on every live DDP module; returns how many visits returned True."""
    classes = _ddp_classes()
    exact = set(classes)
    count = 0
    referrers = gc.get_referrers(*classes)
    try:
        for ref in referrers:
            if type(ref) not in exact:  # a dict or module naming the class, a subclass itself
                continue
            count += bool(visit(ref, ref.__dict__))
    finally:
        # The list holds the calling frames' objects: a frame -> list -> frame cycle would keep an old group,
        # and with it rank 0's store server, alive until the next collection, where a rank re-initialising at
        # once could reach it.
        referrers.clear()
        del referrers
    return count


class _Retired:
    """Stands in for a retired DDP module's Reducer and Logger: any use raises, saying why."""

    def __init__(self, why: str) -> None:
        self._why = why

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(self._why)


def retire_ddp_modules(why: str) -> int:
    """Make every live DDP module unusable and free its ``Reducer``; returns how many (in-process recovery, after
    the default group and every other is destroyed: each of them belongs to a group that is gone).

    A DDP module keeps its Reducer's autograd hooks on the parameters it shares with the next generation's DDP,
    and a Reducer that was waiting for gradients when a fault cut a ``backward()`` would run them at the next
    backward, on the destroyed group. The Reducer removes its hooks when it is freed: its two owners, the
    module's ``reducer`` and ``logger`` attributes, are replaced by a stand-in whose use raises ``why``
    (RuntimeError), so a module kept from before (a training function's own variable) fails loudly instead of
    training on nothing. Pinned first (:func:`pin_module`), so the Reducer never frees the group last; then the
    module's ``process_group`` and pin go too, so a retired module keeps neither the group nor its store alive
    (rank 0's store server then closes, and the next generation serves a fresh one)."""
    def retire(ref: Any, attrs: dict[str, Any]) -> bool:
        if "reducer" not in attrs or isinstance(attrs["reducer"], _Retired):
            return False
        if GROUP_PIN not in attrs and attrs.get("process_group") is not None:
            pin_module(ref, attrs["process_group"])
        stand_in = _Retired(why)
        attrs["logger"] = stand_in  # it holds the Reducer too
        attrs["reducer"] = stand_in
        # The Reducer is gone, so the group may go now: its Python object, the last owner, releases the GIL as it
        # destroys it. Nothing of the module then holds the group, or the store under it.
        attrs["process_group"] = stand_in
        attrs.pop(GROUP_PIN, None)
        return True

    return _each_ddp_module(retire)


def destroy_default_group() -> None:
    """Pin every DDP module's group (:func:`pin_ddp_modules`), then destroy the default group and with it every
    other (a no-op without one)."""
    if not _dist.is_up():
        return
    start = time.perf_counter()
    pinned = pin_ddp_modules()
    dist.destroy_process_group()
    log.debug("default group destroyed (%d DDP module(s) pinned their group) in %.3f s", pinned,
              time.perf_counter() - start)
