"""The hang :class:`Watchdog` (documented in :mod:`robustdist.health`, which exports it)."""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from robustdist.health import watchdog_store as ws
from robustdist.runtime import dist as _dist
from robustdist.runtime import job_store
from robustdist.runtime import node as _node
from robustdist.runtime.errors import ConfigError, HangError, ranks_phrase
from robustdist.runtime.log import get_logger

log = get_logger("robustdist.health")

HANG_EXIT_CODE = 86
"""Exit code of a process the watchdog aborts (``action="abort"``): distinct from crashes (1), signals (<0 or
128+n) and ``timeout(1)`` (124), so a launcher's logs show that the watchdog, not a bug, ended the worker."""

ACTIONS = ("dump", "abort")
_generation = 0  # same sequence on every rank, so the store keys of successive watchdogs never collide


@dataclass
class HangReport:
    """One hang the watchdog saw on this rank.

    ``summary`` (the cross-rank naming) and the fields after it are set on every rank of a multi-rank job with
    a store; ``lost`` are the ranks with no live heartbeat (dead, frozen, partitioned, or closed), grouped by
    node label in ``lost_nodes``; ``behind`` are live ranks behind the others; ``store_reachable`` is False
    when the store did not answer within the report's bound (then nothing is named), None without a report.
    """

    rank: int
    step: int | None
    idle_seconds: float
    dump_path: str | None
    summary: str | None
    detected_at: float  # time.time() when the report was complete
    lost: tuple[int, ...] = ()
    lost_nodes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    behind: tuple[int, ...] = ()
    store_reachable: bool | None = None
    waiting_on: tuple[int, ...] = ()  # live ranks this one probably waits on (behind it, silent as long)


class Watchdog:
    """Dump stacks, name the lost and the slow ranks, and optionally abort when no ``beat`` arrives within
    ``hang_timeout``.

    Args:
        hang_timeout: seconds without a beat that count as a hang (> 0).
        dump_dir: where ``hang-rank<r>-<pid>.txt`` files go (created if missing; None: stderr only).
        store: a c10d store shared by the ranks (default: the default group's, when one exists).
        action: "dump" (keep waiting after reporting) or "abort" (exit with :data:`HANG_EXIT_CODE`).
        rank, world_size: default from the process group (0 and 1 without one).
        grace: at most this many seconds, a rank that saw a hang waits for the live ranks' hang records (where
            their training thread is) before reporting; it never waits for lost ranks (default min(2, hang_timeout
            / 2)). The whole report, store included, is bounded by ``grace`` plus half a second.
        hand_over: with ``action="abort"``, called with the :class:`~robustdist.runtime.errors.HangError` first; when it
            returns True (inside Ray Train: the error was handed to the controller, which tears the worker group
            down and restarts it), the process exits only if it is still alive ``hand_over_grace`` seconds later.

    The training thread is the thread that calls :meth:`beat` (the main thread under torchrun, Ray Train V2's
    ``TrainingThread`` in a Ray worker): the report names it and where it is, not the process's main thread.

    Armed from construction: a hang before the first beat (a stuck first collective) is caught too. With a
    store and more than one rank, a heartbeat thread publishes this rank's liveness from construction to
    :meth:`close` (see :mod:`robustdist.health.watchdog_store` for the protocol).
    """

    def __init__(self, hang_timeout: float, *, dump_dir: str | os.PathLike[str] | None = None, store: Any = None,
                 action: str = "dump", rank: int | None = None, world_size: int | None = None,
                 grace: float | None = None, hand_over: Callable[[BaseException], bool] | None = None,
                 hand_over_grace: float = 60.0):
        if isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float)) or not hang_timeout > 0:
            raise ConfigError(f"hang_timeout={hang_timeout!r}; expected seconds > 0. Fix: pass e.g. 600, or do not "
                              "create a Watchdog (health.hang_timeout=None disables it).")
        if action not in ACTIONS:
            raise ConfigError(f"action={action!r}; expected one of {ACTIONS}. Fix: pass one of those.")
        global _generation
        _generation += 1
        self.hang_timeout, self.action = float(hang_timeout), action
        self.dump_dir = os.fspath(dump_dir) if dump_dir is not None else None
        self.rank, self.world_size = _rank_world(rank, world_size)
        self.store = store if store is not None else _dist.default_store()
        self.grace = min(2.0, self.hang_timeout / 2) if grace is None else float(grace)
        self._prefix = f"robustdist/watchdog/{_generation}"  # the same on every rank (no per-node counter)
        self._node, self._node_rank = _node.node_label(), _node.node_rank()
        self._interval = ws.heartbeat_interval(self.hang_timeout)
        self._stale_after = ws.STALE_INTERVALS * self._interval
        self._step: int | None = None
        self._hand_over, self._hand_over_grace = hand_over, float(hand_over_grace)
        self._hang_callback: Callable[[HangReport], None] | None = None
        self._beater = threading.get_ident()  # the thread that beats: the training thread, once it has beaten
        self._seq = 0
        self._last = time.monotonic()
        self._where: str | None = None  # the main thread's frame while a reported hang lasts
        self._fired_seq: int | None = None
        self._fired_at = 0.0  # time.monotonic() of the last hang reported
        self.reports: list[HangReport] = []
        self._stop = threading.Event()
        self._tick = min(1.0, self.hang_timeout / 10)
        self._hooks: list[Any] = []
        self._allowance = 0.0  # extra seconds while a bounded long operation (a checkpoint save) runs
        self._connect = job_store.connector(self.store, timeout=max(2.0, min(10.0, self._stale_after)))
        watch_from = weakref.WeakMethod(self._watch_from)  # no watchdog <-> watch cycle (see close())
        self._watch = ws.Watch(self._prefix, self.world_size, limit=self._stale_after, interval=self._interval,
                               starts_at=lambda: method() if (method := watch_from()) is not None else math.inf)
        self._heartbeat: ws.Heartbeat | None = None
        if self.store is not None and self.world_size > 1:
            self._heartbeat = ws.Heartbeat(self._connect, self._key, self._interval, self._record, rank=self.rank,
                                           stale_after=self._stale_after, watch=self._watch).start()
        self._thread = threading.Thread(target=self._run, name=f"robustdist-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    @property
    def _key(self) -> str:
        return f"{self._prefix}/{self.rank}"

    def _watch_from(self) -> float:
        """When the heartbeat thread starts reading every rank's record: the bound plus half an interval before this
        rank's hang verdict would come, so that the verdict's report knows which records stopped changing; never
        once that verdict is given, until beats resume."""
        if self._fired_seq is not None and self._fired_seq == self._seq:
            return math.inf
        return self._last + self.hang_timeout + self._allowance - self._stale_after - self._interval / 2

    def _record(self, closed: bool = False) -> dict[str, Any]:
        """This rank's heartbeat record (see :mod:`robustdist.health.watchdog_store`)."""
        now, last = time.time(), self._last
        return {"alive": now, "node": self._node, "node_rank": self._node_rank, "pid": os.getpid(),
                "step": self._step, "seq": self._seq, "beat_wall": now - (time.monotonic() - last),
                "where": self._where, "closed": closed}

    @property
    def heartbeats(self) -> tuple[str, float, float] | None:  # (key prefix, interval s, stale after s), or None
        return (self._prefix, self._interval, self._stale_after) if self._heartbeat is not None else None

    @property
    def hand_over(self) -> Callable[[BaseException], bool] | None:
        """The ``hand_over`` it was made with (Ray Train's, inside a Train worker): in-process recovery hands a
        stuck rank's error over the same way before its process exits."""
        return self._hand_over

    def on_hang(self, callback: Callable[[HangReport], None] | None) -> None:
        """Call ``callback(report)`` on the watchdog's thread at each hang verdict, after the dump and the report
        (in-process recovery declares a fault there). With ``action="abort"`` the process then exits only if this
        watchdog is still open ``hand_over_grace`` seconds later (a recovery closes it first). None removes it."""
        self._hang_callback = callback

    def attach(self, model: Any) -> Watchdog:
        """Beat at every forward start and backward start of ``model`` (a hook on its first output that needs a
        gradient), so a rank stuck between them is told apart from ranks already waiting in the next
        collective. :meth:`close` removes the hooks. Returns ``self``."""
        self._hooks += [model.register_forward_pre_hook(_ForwardBeat(self)),
                        model.register_forward_hook(_OutputBeat(self))]
        return self

    # ------------------------------------------------------------------ the training loop's side
    def beat(self, step: int | None = None) -> None:
        """Record progress. Cheap: attribute writes and one monotonic clock read; no I/O, no collectives."""
        if step is not None:
            self._step = step
        self._beater = threading.get_ident()
        self._seq += 1
        self._last = time.monotonic()

    def _beat_from_autograd(self) -> None:
        """A beat from a backward hook: autograd may run it on a device thread of its own (CUDA), which is not
        the training thread, so the thread the report names is left as it is."""
        self._seq += 1
        self._last = time.monotonic()

    @contextlib.contextmanager
    def allow(self, seconds: float, what: str) -> Iterator[None]:
        """Within this block, a silence of up to ``seconds`` (the operation's own bound, e.g. the checkpoint
        timeout) is not a hang: a healthy save of a large model on slow storage must not be reported, or
        killed with ``hang_action="abort"``. Beats on entry and exit."""
        self.beat()
        previous, self._allowance = self._allowance, max(self._allowance, float(seconds))
        log.debug("watchdog: allowing up to %g s for %s", self.hang_timeout + self._allowance, what)
        try:
            yield
        finally:
            self._allowance = previous
            self.beat()

    def close(self) -> None:
        """Stop the threads (bounded waits: the heartbeat's last write, "closed", gets at most 1 s) and remove
        the hooks :meth:`attach` installed. Idempotent."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._heartbeat is not None:  # first: a connection made during the join may reach a later store
            self._heartbeat.request_stop()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._tick + self.grace + 10)
        if self._heartbeat is not None:
            self._heartbeat.stop(wait=1.0)
        # do not keep a destroyed group's store alive; and no watchdog <-> heartbeat cycle (its record is this
        # object's): a closed watchdog goes with its last reference, not at the next garbage collection
        self.store = self._heartbeat = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self._check()
            except Exception:  # the watchdog must never die silently
                log.error("watchdog check failed:\n%s", traceback.format_exc(), all_ranks=True)

    def _check(self) -> None:
        """One tick of the detecting thread: no store I/O here (the heartbeat thread does it), so a store that
        does not answer never delays detection."""
        now, seq, last = time.monotonic(), self._seq, self._last
        idle = now - last
        if idle < self.hang_timeout + self._allowance:
            if self._fired_seq is not None and seq != self._fired_seq:
                log.warning("beats resumed at step %s after the hang reported above", self._step, all_ranks=True)
                self._fired_seq, self._where = None, None
            return
        if self._fired_seq == seq:
            return
        self._fired_seq, self._fired_at = seq, now
        self._on_hang(seq, idle)

    def _on_hang(self, seq: int, idle: float) -> None:
        header = (f"robustdist watchdog: rank {self.rank} (pid {os.getpid()}, {self._node}) had no beat for "
                  f"{idle:.1f} s (hang_timeout {self.hang_timeout:g} s); last step {self._step}, beat #{seq}")
        self._where = _thread_where(self._beater)
        header += f"; training thread {self._where or '(gone)'}"
        path = self._dump(header)  # first, and local: nothing below can delay it
        found = self._report() if self._heartbeat is not None else None
        summary = found.text if found is not None else None
        log.error("%s. Stacks dumped to %s.%s", header, path or "stderr",
                  f"\n{summary}" if summary else "", all_ranks=True)
        if summary and path:
            _append(path, "\n" + summary + "\n")
        report = HangReport(self.rank, self._step, idle, path, summary, time.time())
        if found is not None:
            report.lost, report.lost_nodes, report.behind = found.lost, found.lost_nodes, found.behind
            report.store_reachable, report.waiting_on = found.store_reachable, found.waiting_on
        self.reports.append(report)
        handled = False
        callback = self._hang_callback
        if callback is not None and not self._stop.is_set():
            try:
                callback(report)
                handled = True
            except Exception:
                log.error("the watchdog's hang callback raised:\n%s", traceback.format_exc(), all_ranks=True)
        if self.action == "abort":
            self._abort(report, header, summary, seq, handled=handled)

    def _abort(self, report: HangReport, header: str, summary: str | None, seq: int | None = None,
               handled: bool = False) -> None:
        error = HangError(f"{header}.{f' {summary}' if summary else ''} Stacks: {report.dump_path or 'stderr'}. "
                          "health.hang_action='abort' ended this worker so that the job restarts from its last "
                          "checkpoint.", rank=self.rank)
        if self._stop.is_set():  # close() is under way: the training thread got past the silence
            return
        if handled:  # the callback (in-process recovery) acts first; exit only if it did not end the hang
            log.error("health.hang_action='abort': the hang is handed to in-process recovery; exiting with code %d "
                      "if it has not torn this generation down in %g s", HANG_EXIT_CODE, self._hand_over_grace,
                      all_ranks=True)
            if self._stop.wait(self._hand_over_grace):
                return
            self._exit()
        if self._hand_over is not None and report.waiting_on:
            # A rank waiting in a collective on a stuck peer stops beating too. The launcher shows the first error
            # it sees, so the ranks this one waits on (live, their own watchdogs firing now) hand theirs over first.
            defer = self.grace + 2 * self._tick
            log.warning("health.hang_action='abort': this rank probably waits on %s; acting on this rank's hang in "
                        "%.1f s, after theirs", ranks_phrase(report.waiting_on), defer, all_ranks=True)
            if self._stop.wait(defer):
                return  # closed meanwhile: the training thread got past the silence (its collective ended)
            if seq is not None and self._seq != seq:
                log.warning("beats resumed at step %s while waiting; not acting on the hang", self._step,
                            all_ranks=True)
                return
        if self._hand_over is not None and self._hand_over(error):
            log.error("health.hang_action='abort': handed the hang to the launcher as this rank's error; exiting "
                      "with code %d if this process is still alive in %g s", HANG_EXIT_CODE, self._hand_over_grace,
                      all_ranks=True)
            if self._stop.wait(self._hand_over_grace):
                return  # closed meanwhile (the launcher tore the worker down gracefully)
        self._exit()

    def _exit(self) -> None:
        """Exit with :data:`HANG_EXIT_CODE`. The rank that serves the store exits last: the other ranks' watchdogs
        fire within about two ticks of this one (each at its own last beat plus ``hang_timeout``) and their reports
        read the store for at most ``grace`` plus half a second; without the store they could not name the lost
        ranks. A launcher that stops the group at the first exit (torchrun) cuts this short."""
        left = self._fired_at + 2 * self._tick + self.grace + 0.5 - time.monotonic()
        if left > 0 and ws.serves(self.store):
            log.error("health.hang_action='abort': this rank serves the store; exiting with code %d in %.1f s, once "
                      "the other ranks' hang reports have read it", HANG_EXIT_CODE, left, all_ranks=True)
            time.sleep(left)
        log.error("health.hang_action='abort': exiting with code %d so the launcher restarts this worker",
                  HANG_EXIT_CODE, all_ranks=True)
        _flush()
        os._exit(HANG_EXIT_CODE)

    def _dump(self, header: str) -> str | None:
        stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
        try:
            stream.write(header + "\n")
            stream.flush()
            faulthandler.dump_traceback(stream, all_threads=True)
        except (OSError, ValueError, AttributeError):
            pass
        if self.dump_dir is None:
            return None
        path = os.path.join(self.dump_dir, f"hang-rank{self.rank}-{os.getpid()}.txt")
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(path, "a") as f:
                f.write(header + "\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            return path
        except OSError as e:
            log.error("could not write the stack dump to %s: %s", path, e, all_ranks=True)
            return None

    def _report(self) -> ws.Findings:
        """Publish this rank's record and read every rank's, on a thread of its own, for at most ``grace`` plus
        half a second; name the lost ranks by node and the live ranks behind
        (:mod:`robustdist.health.watchdog_store`)."""
        box = ws.gather(self._connect, self._key, self._record, self._watch, self.grace, rank=self.rank)
        return ws.findings(box, rank=self.rank, node=self._node, world_size=self.world_size,
                           interval=self._interval, stale_after=self._stale_after, grace=self.grace,
                           store=ws.store_name(self.store))


def summarise(records: dict[int, dict[str, Any]], world_size: int, now: float) -> str:
    """``rank 1 last beat at step 120, 610 s ago; ranks 0, 2, 3 at step 121`` (plus never-published ranks):
    the progress naming alone, without heartbeats (the hang report adds the lost ranks, by node)."""
    missing = [r for r in range(world_size) if r not in records]
    if not records:
        return f"no rank published a beat ({ranks_phrase(missing)} never did): the store is unreachable or every " \
               "rank hung before its first publish."
    parts, behind, best = ws.progress(records, now)
    if not behind:
        parts.append(f"every rank that published is at step {best[0] if best[0] >= 0 else None} (beat #{best[1]}): "
                     "no rank is behind; compare the stack dumps")
    if missing:
        parts.append(f"{ranks_phrase(missing)} never published (dead, or frozen before the watchdog could run)")
    suspects = behind + missing
    verdict = f"Suspect: {ranks_phrase(suspects)}. " if suspects else ""
    return f"hang report: {'; '.join(parts)}. {verdict}Their stack dumps show where each rank is."


class _ForwardBeat:
    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog

    def __call__(self, module: Any, args: Any) -> None:
        self.watchdog.beat()


class _OutputBeat(_ForwardBeat):
    def __call__(self, module: Any, args: Any, output: Any) -> None:  # type: ignore[override]
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(_BackwardBeat(self.watchdog))


class _BackwardBeat(_ForwardBeat):
    def __call__(self, grad: Any) -> None:  # type: ignore[override]
        self.watchdog._beat_from_autograd()


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for value in values:
        found = _first_grad_tensor(value)
        if found is not None:
            return found
    return None


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    return (rank if rank is not None else _dist.rank()), (world_size if world_size is not None else _dist.world_size())


def _thread_where(ident: int) -> str | None:
    """``TrainingThread(train_fn) in train_fn (script.py:42)``: the named thread and its innermost frame."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    name = next((t.name for t in threading.enumerate() if t.ident == ident), f"thread {ident}")
    code = frame.f_code
    return f"{name} in {code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"


def _append(path: str, text: str) -> None:
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError:
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
