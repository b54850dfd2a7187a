"""Exceptions and warnings raised by robustdist.

Every exception derives from :class:`RobustDistError`; where a stdlib type is the natural one to catch
(a bad config value is a ``ValueError``), the class derives from both, so existing ``except`` clauses keep
working::

    Exception
    └── RobustDistError
        ├── ConfigError (+ ValueError)          a config value, key or file is invalid
        ├── MissingDependencyError (+ ImportError)  an optional extra is not installed
        ├── UnsupportedVersionError             the installed torch or Ray cannot run what was asked
        ├── TopologyError                       ranks, sizes or devices don't add up
        ├── InitError                           process-group init, barrier or smoke test failed
        ├── CheckpointError
        │   ├── CheckpointCorruptError          a checkpoint file is missing, malformed or fails verification
        │   ├── CheckpointVersionError (+ UnsupportedVersionError)  only a newer torch can read it: upgrade
        │   └── CheckpointBusyError             checkpoints were rotated away while read: retry
        ├── StateDictMismatchError              keys/shapes differ between a state dict and a model
        ├── RankDivergenceError                 ranks hold different parameters or configs
        ├── NonFiniteLossError                  a loss or gradients went NaN/Inf (health.nan_policy='raise')
        ├── HangError                           something waited past its bound
        ├── RestartLoopError                    restart after restart made no progress (a crash loop)
        ├── RecoveryError                       in-process recovery escalated (names the fault)
        └── RanksFailed                         one or more ranks of ``testing.run_ranks`` failed
            └── RanksTimeout (+ HangError)      ranks still running at the harness timeout

    UserWarning
    └── RobustDistWarning                       filter with ``warnings.filterwarnings(..., RobustDistWarning)``
        └── RobustDistDeprecationWarning (+ FutureWarning)  an old robustdist path or name still works, for now

Errors raised in a distributed context carry ``.rank`` (the rank that raised) and, where known, ``.ranks``
(the ranks involved, e.g. the ranks that missed a barrier). When ``rank`` is given, the message starts with
``[rank N]``. Every message says what was found, what was expected, and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

__all__ = [
    "CheckpointBusyError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointVersionError",
    "ConfigError",
    "HangError",
    "InitError",
    "MissingDependencyError",
    "NonFiniteLossError",
    "RankDivergenceError",
    "RanksFailed",
    "RanksTimeout",
    "RecoveryError",
    "RestartLoopError",
    "RobustDistDeprecationWarning",
    "RobustDistError",
    "RobustDistWarning",
    "StateDictMismatchError",
    "TopologyError",
    "UnsupportedVersionError",
]


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``"rank 3"`` or ``"ranks 0, 2"``, for messages that name ranks (internal helper, not exported)."""
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


class RobustDistError(Exception):
    """Root of every robustdist exception.

    Args:
        message: what was found, what was expected, and the fix.
        rank: the rank raising it, when raised inside a distributed job.
        ranks: the ranks involved (e.g. those that never reached a barrier), when known.
    """

    def __init__(self, message: str, *, rank: int | None = None, ranks: Iterable[int] | None = None):
        self.message = message
        self.rank = rank
        self.ranks: tuple[int, ...] | None = tuple(sorted(ranks)) if ranks is not None else None
        prefix = f"[rank {rank}] " if rank is not None else ""
        super().__init__(prefix + message)

    def __reduce__(self):  # keep .rank/.ranks across pickling (multiprocessing, Ray)
        return (_rebuild, (type(self), self.message, self.rank, self.ranks, self.__dict__))


def _rebuild(cls, message, rank, ranks, state):
    obj = cls.__new__(cls)
    RobustDistError.__init__(obj, message, rank=rank, ranks=ranks)
    obj.__dict__.update(state)
    return obj


class ConfigError(RobustDistError, ValueError):
    """A configuration value, key or file is invalid. The message names the field path."""


class MissingDependencyError(RobustDistError, ImportError):
    """An optional dependency (an extra such as ``robustdist[yaml]`` or ``robustdist[ray]``) is missing."""


class UnsupportedVersionError(RobustDistError):
    """The installed torch or Ray lacks what a feature needs (FSDP2 on CPU/gloo, say); the message names the
    version that has it (``robustdist doctor`` lists the tested ones)."""


class TopologyError(RobustDistError):
    """Ranks, world sizes, nodes or visible devices are inconsistent."""


class InitError(RobustDistError):
    """Process-group initialisation, the named barrier, the smoke test or cross-rank agreement failed."""


class CheckpointError(RobustDistError):
    """A checkpoint could not be saved, committed or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated, malformed, unsafe, or fails its checksum."""


class CheckpointVersionError(CheckpointError, UnsupportedVersionError):
    """A checkpoint holds what only a newer torch than the installed one has (a dtype, say): intact, but this torch
    cannot read it. The message names the writer's version and this one; the fix is to upgrade."""


class CheckpointBusyError(CheckpointError):
    """A load found the checkpoints rotated away under it by a writer, repeatedly: retrying is safe."""


class RestartLoopError(RobustDistError):
    """Restart after restart resumed from the same step and none committed a newer one: a crash loop."""


class RecoveryError(RobustDistError):
    """In-process recovery (``recovery.in_process``) escalated: on a rank that did not fault itself, the message
    names the fault (another rank's error, a hang verdict, a lost store) and why the job does not recover in place,
    and the error this rank saw (a collective cut short by the teardown) is its ``__cause__``; or, on every rank,
    a recovery found nothing it could resume from in the same process. The process exits for a restart, as after
    any other fault."""


class StateDictMismatchError(RobustDistError):
    """A state dict and a model disagree on keys, shapes or dtypes."""


class RankDivergenceError(RobustDistError):
    """Ranks that should hold identical state (parameters, configs, versions) do not."""


class NonFiniteLossError(RobustDistError):
    """A loss or the gradients were NaN/Inf at a step; ``.ranks`` names the ranks whose loss was."""


class HangError(RobustDistError):
    """An operation waited past its bound."""


class RanksFailed(RobustDistError):
    """One or more ranks started by :func:`robustdist.testing.run_ranks` raised, exited or died.

    ``failures`` maps each failed rank to a readable description: the formatted traceback for a raise,
    the signal name for a kill, the exit code for an exit without a result.
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None, **kwargs):
        self.failures: dict[int, str] = dict(failures or {})
        kwargs.setdefault("ranks", self.failures.keys())
        super().__init__(message, **kwargs)


class RanksTimeout(RanksFailed, HangError):
    """Ranks were still running when :func:`robustdist.testing.run_ranks` hit its timeout."""


class RobustDistWarning(UserWarning):
    """Every warning robustdist issues; filter it as a category of its own."""


class RobustDistDeprecationWarning(RobustDistWarning, FutureWarning):
    """An old robustdist path or name that still works but will go; the message names the new one.

    A ``FutureWarning`` (shown by default), not a ``DeprecationWarning``: the code that triggers it is often
    not the user's ``__main__`` (a Ray worker runs the setup hook), where a ``DeprecationWarning`` is hidden."""


# Letting go of what a caught exception's frames hold. An exception keeps its traceback, and the traceback every
# frame it passed through, with their locals (a model, a checkpointer, a tier and its buffers, a store); an
# exception that one of those frames holds itself (``except E as e: error = e``, an error passed on to a function
# that then raises) forms a reference cycle, which keeps all of it alive until the next full garbage collection
# (0.15 to 0.2 s with torch imported). drop_locals clears the finished frames' locals; the traceback still names
# every file, line and function. Used where a recovery lets go of a generation (never on a path that ends the
# process: a debugger's post-mortem wants the locals).
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def drop_locals(error: BaseException | None) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback, and in those of its causes and
    contexts (transitively; not an exception group's members) that were raised below the caller: a cause or
    context caught by a frame still on the calling thread's stack (one the caller was handling) is left whole. A
    frame still running (the caller's, a thread's) and a generator's or coroutine's frame (clearing would close
    it) are left as they are."""
    frame, running = inspect.currentframe(), set()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    first = error
    todo, seen = [error], set()
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        tb = error.__traceback__
        if error is not first and tb is not None and id(tb.tb_frame) in running:
            continue  # caught above the caller: not part of what failed below it
        while tb is not None:
            if not tb.tb_frame.f_code.co_flags & _SUSPENDABLE:
                try:
                    tb.tb_frame.clear()
                except RuntimeError:  # still executing
                    pass
            tb = tb.tb_next
        todo += [error.__cause__, error.__context__]
