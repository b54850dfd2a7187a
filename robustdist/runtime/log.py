"""Rank-aware logging and warnings.

``get_logger("robustdist.<module>")`` returns a :class:`logging.LoggerAdapter` that prefixes every message
with ``[rank N/W]``. On ranks other than 0, INFO (and DEBUG) records are demoted to DEBUG, so a 64-rank job
logs its progress once; WARNING and above are logged on every rank, since a problem on rank 37 matters.
Pass ``all_ranks=True`` to a call to keep its level everywhere.

Nothing here configures handlers: the application decides where records go (``logging.basicConfig``).

``warn(message)`` issues a :class:`~robustdist.runtime.errors.RobustDistWarning`; with ``once=<key>`` only the first
warning for that key in this process is issued, so a cause that repeats every iteration warns once.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Hashable, MutableMapping
from typing import Any

from robustdist.runtime.errors import RobustDistWarning

__all__ = ["RankLoggerAdapter", "current_rank", "get_logger", "warn"]


def current_rank() -> tuple[int, int]:
    """This process's ``(rank, world_size)``: from the process group if one exists, else the launcher env.

    Cheap enough to call per log record; never raises (``(0, 1)`` when nothing is known).
    """
    try:
        from robustdist.runtime import dist as _dist

        if _dist.is_up():
            return _dist.rank(), _dist.world_size()
    except Exception:  # a half-destroyed group must not break logging
        pass
    for rank_var, world_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        try:
            return int(os.environ[rank_var]), int(os.environ[world_var])
        except (KeyError, ValueError):
            continue
    return 0, 1


class RankLoggerAdapter(logging.LoggerAdapter):
    """Adds the ``[rank N/W]`` prefix and logs INFO and below on rank 0 only (elsewhere at DEBUG)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        rank, world = current_rank()
        return f"[rank {rank}/{world}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
        if not all_ranks and level < logging.WARNING and current_rank()[0] != 0:
            level = logging.DEBUG
        if self.isEnabledFor(level):
            msg, kwargs = self.process(msg, kwargs)
            kwargs.setdefault("stacklevel", 2)
            self.logger.log(level, msg, *args, **kwargs)

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        self.log(logging.ERROR, msg, *args, **kwargs)


def get_logger(name: str) -> RankLoggerAdapter:
    """The rank-aware logger for ``name`` (use ``__name__``; it lives under ``robustdist.``)."""
    if not name.startswith("robustdist"):
        name = f"robustdist.{name}"
    return RankLoggerAdapter(logging.getLogger(name), {})


def logging_configured() -> bool:
    """Whether a record from a robustdist logger reaches a real handler (the script or a framework configured
    logging). Without one, Python prints only WARNING and above, so INFO news a user must see is raised to
    WARNING."""
    logger: logging.Logger | None = logging.getLogger("robustdist")
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


# robustdist's own directory (this file is robustdist/runtime/log.py): frames inside it are not the user's.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

_warned: set[Hashable] = set()
_warned_lock = threading.Lock()


def user_stacklevel() -> int:
    """The ``stacklevel`` that points at the first caller outside robustdist, for a :func:`warn` (or a
    ``warnings.warn``) made by the function that calls this one."""
    import contextlib
    import sys

    frame, level = sys._getframe(1), 1
    package = PACKAGE_DIR
    passthrough = os.path.abspath(contextlib.__file__)  # `with robustdist.distributed():` enters through it
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(package)
                                 or os.path.abspath(frame.f_code.co_filename) == passthrough):
        frame, level = frame.f_back, level + 1
    return max(level - 1, 1) if frame is None else level


def warn(message: str, *, once: Hashable | None = None, stacklevel: int = 2) -> bool:
    """Issue a :class:`RobustDistWarning` (with the rank prefix). Returns whether it was issued.

    Args:
        message: what was found, what robustdist did about it, and how to silence it.
        once: a key; only the first call with a given key warns in this process.
        stacklevel: as for :func:`warnings.warn`, counted from the caller of ``warn``.
    """
    if once is not None:
        with _warned_lock:
            if once in _warned:
                return False
            _warned.add(once)
    rank, world = current_rank()
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    warnings.warn(prefix + message, RobustDistWarning, stacklevel=stacklevel + 1)
    return True
