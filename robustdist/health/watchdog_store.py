"""The watchdog's side of the c10d store: liveness heartbeats, and the cross-rank hang report (used by
:mod:`robustdist.health.watchdog`; documented for users in :mod:`robustdist.health`).

Protocol (every rank runs the same code; every key is the same on every rank):

* **Heartbeat.** Key ``robustdist/watchdog/<generation>/<rank>`` holds one small JSON record per rank, rewritten
  every ``interval`` seconds (``min(5, hang_timeout / 4)``) by that rank's heartbeat thread, whether or not
  training beats: one ``set`` per interval per rank, no read. The record says ``alive`` (wall time),
  ``node``/``node_rank`` (:func:`robustdist.runtime.node.node_label`), ``pid``, the training progress (``step``,
  ``seq``: the beat count, ``beat_wall``: the wall time of the last beat), ``where`` (the training thread and its frame,
  set once this rank saw a hang) and ``closed`` (the watchdog was closed). ``<generation>`` counts the
  watchdogs this process created, the same sequence on every rank; nothing counted per node (such as
  ``TORCHELASTIC_RESTART_COUNT``, counted per torchrun agent) enters a key.
* **Watch.** From ``stale_after`` plus half an interval before its hang verdict would come (no beat for
  ``hang_timeout`` minus that) until the verdict, the heartbeat thread also reads every rank's record once an
  interval, after its own write (:class:`Watch`), so that by the verdict it has seen, on its own clock, which
  records stopped changing (the liveness rule, :class:`robustdist.runtime.liveness.Changes`). A rank whose beats
  come closer together than that only writes.
* **Report.** Each rank that sees a hang (every rank, not only rank 0) opens a connection of its own,
  publishes its record with ``where``, and reads every rank's record; it polls for at most ``grace`` seconds
  while a rank that is still alive has not said where it is, and never waits for a lost rank. A rank is
  *lost* when its record was seen unchanged for more than ``stale_after`` (3 intervals), was closed, or was
  never written; lost ranks are named by node, apart from the live ranks that are behind.
* **Bounds.** A c10d store call has no reliable bound: a ``TCPStore`` ``get`` or connect to a host that
  stopped answering waits well past the store's timeout. So the report's store calls run on a thread of their
  own that the detecting thread abandons at its deadline: the stack dump, the report and
  ``hang_action="abort"`` never wait on the store. The heartbeat thread may block, in its write or its look;
  that only delays this rank's heartbeats (and the others then call it lost, which from the store's side it is).
* **Clocks.** Whether a rank is lost is judged on the reader's monotonic clock only. The progress phrases ("last
  beat ... 2 s ago", which live rank waits on which) compare the wall times records carry, so they assume the
  nodes' clocks agree to within a second or so (NTP does).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from robustdist.runtime import _torch_compat, group_sockets
from robustdist.runtime import job_store
from robustdist.runtime.deadline import bounded
from robustdist.runtime.errors import ranks_phrase
from robustdist.runtime.liveness import Changes
from robustdist.runtime.log import get_logger
from robustdist.runtime.stored import Unreadable, json_value

log = get_logger("robustdist.health")

STALE_INTERVALS = 3  # a record seen unchanged for longer than this many heartbeat intervals is lost
_POLL = 0.2  # seconds between reads while waiting for live ranks' hang records
MAX_RECORD_BYTES = 1 << 16  # a heartbeat record is a few hundred bytes


def heartbeat_interval(hang_timeout: float) -> float:
    """Seconds between heartbeats: ``min(5, hang_timeout / 4)``, so a lost rank's record has stopped changing
    well before a hang."""
    return min(5.0, hang_timeout / 4)


# ---------------------------------------------------------------------------------------------- connections
def serves(store: Any) -> bool:
    """Whether this process serves ``store``'s TCPStore (holds the socket listening on its port)."""
    inner = _torch_compat.innermost_store(store)
    port = getattr(inner, "port", None) if isinstance(inner, dist.TCPStore) else None
    return isinstance(port, int) and port > 0 and group_sockets.listens_on(port)


def store_name(store: Any) -> str:
    """``the c10d store at 10.0.0.1:29500`` (or ``the c10d store`` when it has no address)."""
    inner = _torch_compat.innermost_store(store)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return f"the c10d store at {host}:{port}" if host and port else "the c10d store"


class Heartbeat(job_store.StoreThread):
    """The heartbeat thread: ``record(closed)`` published under ``key`` every ``interval`` s until :meth:`stop`,
    then once more with ``closed=True``. Failures are retried on a new connection at the next interval. With a
    ``watch``, it also reads every rank's record once an interval while ``watch.starts_at()`` has passed (it looks
    at that time at least every quarter interval, since a beat or an allowance moves it)."""

    def __init__(self, connect: Callable[[], Any], key: str, interval: float,
                 record: Callable[[bool], dict[str, Any]], *, rank: int, stale_after: float,
                 watch: Watch | None = None):
        super().__init__(connect, f"robustdist-heartbeat-rank{rank}")
        self.key, self.interval, self.rank, self.stale_after = key, interval, rank, stale_after
        self._record, self.watch = record, watch
        self._failing_since: float | None = None
        self._warned = False

    def request_stop(self) -> None:
        """Write nothing more on a new connection, from now on (the closed record still goes, at :meth:`stop`)."""
        self._stop.set()

    def stop(self, wait: float) -> None:
        """Ask the thread to publish its closed record and end; wait at most ``wait`` s."""
        self._end(wait)

    def _run(self) -> None:
        client = None
        due = time.monotonic()
        while True:
            if time.monotonic() >= due:
                client = self._publish(client, closed=False)
                due = time.monotonic() + self.interval
            wake = due
            if self.watch is not None:
                starts = self.watch.starts_at()
                if time.monotonic() >= starts:
                    client = self._look(client)
                else:
                    wake = min(wake, starts, time.monotonic() + self.interval / 4)
            if self._stop.wait(max(0.0, wake - time.monotonic())):
                break
        if client is not None:  # the closed record only on a connection made before the stop (see _publish)
            self._publish(client, closed=True)

    def _publish(self, client: Any, *, closed: bool) -> Any:
        try:
            client = self._client(client)
            if client is None:
                return None
            client.set(self.key, json.dumps(self._record(closed)))
        except Exception as e:  # retried on a new connection: the old one may be mid-reply
            self._failed(e)
            return None
        if self._warned:
            log.warning("watchdog heartbeats reach the c10d store again", all_ranks=True)
        self._failing_since, self._warned = None, False
        return client

    def _look(self, client: Any) -> Any:
        """One look, on a new connection if the write failed (a skipped look would read as a pause of this
        reader's, and restart every clock)."""
        if self.watch is None:
            return client
        try:
            client = self._client(client)
            if client is None:
                return None
            self.watch.look(client)
        except Exception as e:  # read again on a new connection at the next interval
            log.debug("watchdog heartbeat read failed: %s: %s", type(e).__name__, e)
            return None
        return client

    def _failed(self, e: Exception) -> None:
        now = time.monotonic()
        self._failing_since = self._failing_since if self._failing_since is not None else now
        failing = now - self._failing_since
        if failing >= self.stale_after and not self._warned and not self._stop.is_set():
            self._warned = True
            log.warning("rank %d: the watchdog could not write its heartbeat to the c10d store for %.0f s (%s: %s); "
                        "expected one write every %g s. The other ranks will report this rank lost. Fix: check this "
                        "node's link to the store's host (rank 0's node, usually).", self.rank, failing,
                        type(e).__name__, str(e)[:200], self.interval, all_ranks=True)
        else:
            log.debug("watchdog heartbeat failed: %s: %s", type(e).__name__, e)


# ---------------------------------------------------------------------------------------------- reading
def parse_record(raw: Any) -> dict[str, Any] | None:
    """A heartbeat record from the store, or None when it is not one (the store is the job's own, but a
    record is checked field by field before any of it is used)."""
    try:
        rec = json_value(raw, MAX_RECORD_BYTES)
    except Unreadable:
        return None
    if not isinstance(rec, dict):
        return None
    numbers = ("alive", "beat_wall")
    try:  # an int too large for a float raises OverflowError in isfinite
        if not all(isinstance(rec.get(k), (int, float)) and math.isfinite(rec[k]) for k in numbers):
            return None
    except OverflowError:
        return None
    if not isinstance(rec.get("seq"), int) or not (rec.get("step") is None or isinstance(rec.get("step"), int)):
        return None
    for key in ("node", "where"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            return None
    return rec


def read_records(client: Any, prefix: str, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's heartbeat record that exists: two round trips when every rank has one."""
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    present = list(range(world_size)) if client.check(keys) else [r for r in range(world_size)
                                                                   if client.check([keys[r]])]
    wanted = [keys[r] for r in present]
    try:
        values = client.multi_get(wanted) if wanted else []
    except (AttributeError, NotImplementedError):  # a store without multi_get (a store error is raised)
        values = [client.get(k) for k in wanted]
    records = {}
    for r, raw in zip(present, values):
        rec = parse_record(raw)
        if rec is not None:
            records[r] = rec
    return records


class Watch:
    """Reads every rank's heartbeat record under ``prefix`` (:meth:`look`) and keeps when each last changed on this
    reader's clock (:class:`~robustdist.runtime.liveness.Changes`, bound ``limit``). ``starts_at()`` is the
    monotonic time from which the heartbeat thread reads them (the watchdog's: ``limit`` plus half an interval
    before its hang verdict); the report thread reads them too."""

    def __init__(self, prefix: str, world_size: int, *, limit: float, interval: float,
                 starts_at: Callable[[], float] = lambda: 0.0):
        self.prefix, self.world_size, self.starts_at = prefix, world_size, starts_at
        # the heartbeat looks once an interval, a failed look retried at the next: three intervals without one is a
        # pause of this reader's (stopped, or the store gone), across which nobody is judged
        self.changes = Changes(limit, gap=3 * interval)

    def look(self, client: Any) -> dict[int, dict[str, Any]]:
        records = read_records(client, self.prefix, self.world_size)
        self.changes.see({r: rec["alive"] for r, rec in records.items()})
        return records


@dataclass
class Collected:
    """What the report thread has read so far (it may be abandoned mid-call)."""

    records: dict[int, dict[str, Any]] | None = None
    read_at: float = 0.0  # time.time() of the read
    quiet: dict[int, float] = field(default_factory=dict)  # rank -> seconds its record was seen unchanged
    error: str | None = None
    abandoned: bool = False


def collect(connect: Callable[[], Any], own_key: str, own_record: Callable[[], dict[str, Any]], watch: Watch,
            deadline: float, box: Collected) -> None:
    """The report thread's body: publish this rank's record, then read every rank's until each live rank has
    said where it is, or ``deadline`` (a ``time.monotonic()``) passes. Results go to ``box``."""
    try:
        client = connect()
        if box.abandoned:  # a connect that outlived the report may have reached a later server on the same port
            return
        client.set(own_key, json.dumps(own_record()))
        while not box.abandoned:
            records = watch.look(client)
            box.records, box.read_at, box.quiet = records, time.time(), watch.changes.quiet()
            alive = classify(records, watch.world_size, box.quiet, watch.changes.limit)[0]
            if all(rec.get("where") for rec in alive.values()) or time.monotonic() + _POLL >= deadline:
                return
            time.sleep(_POLL)
    except Exception as e:
        box.error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def gather(connect: Callable[[], Any], own_key: str, own_record: Callable[[], dict[str, Any]], watch: Watch,
           grace: float, *, rank: int) -> Collected:
    """Run :func:`collect` on a thread of its own and return what it read within ``grace`` s (plus half a
    second for the last read); the thread is abandoned, never waited for, past that."""
    box = Collected()
    deadline = time.monotonic() + grace
    _, _, finished = bounded(lambda: collect(connect, own_key, own_record, watch, deadline, box), deadline + 0.5,
                             f"hang-report-rank{rank}")
    box.abandoned = True
    if not finished and box.records is None and box.error is None:
        box.error = "no reply"
    return box


# ---------------------------------------------------------------------------------------------- naming
def classify(records: dict[int, dict[str, Any]], world_size: int, quiet: dict[int, float],
             stale_after: float) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """``(alive records, lost ranks)``: a rank is lost when its record is missing, closed or was seen unchanged
    for more than ``stale_after`` seconds (``quiet``: :meth:`~robustdist.runtime.liveness.Changes.quiet`)."""
    alive = {r: rec for r, rec in records.items()
             if not rec.get("closed") and quiet.get(r, 0.0) <= stale_after and 0 <= r < world_size}
    return alive, [r for r in range(world_size) if r not in alive]


def lost_by_node(records: dict[int, dict[str, Any]], lost: list[int]) -> dict[str, tuple[int, ...]]:
    """The lost ranks grouped by the node their last record named (``"node unknown"`` for ranks never seen)."""
    nodes: dict[str, list[int]] = {}
    for r in lost:
        node = records[r].get("node") if r in records else None
        nodes.setdefault(node or "node unknown", []).append(r)
    return {node: tuple(sorted(ranks)) for node, ranks in nodes.items()}


def describe_lost(records: dict[int, dict[str, Any]], lost: list[int], quiet: dict[int, float],
                  interval: float) -> list[str]:
    """``lost ranks 2, 3 on node 1 (host h, 10.0.0.2): no heartbeat for 12 s or more (expected one every 5 s; the
    last said step 41)``, one phrase per node and kind (lost, closed, never seen). The seconds are how long this
    rank saw the record unchanged: it looks only from shortly before its verdict."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r in lost:
        rec = records.get(r)
        kind = "never" if rec is None else "closed" if rec.get("closed") else "stale"
        node = (rec.get("node") if rec is not None else None) or "node unknown"
        groups.setdefault((kind, node), []).append(r)
    phrases = []
    for (kind, node), ranks in sorted(groups.items(), key=lambda item: min(item[1])):
        if kind == "never":
            phrases.append(f"lost {ranks_phrase(ranks)}, {node}: never sent a heartbeat (dead or frozen before its "
                           "watchdog started, or cut off from the store since)")
            continue
        ages = sorted(round(quiet.get(r, 0.0)) for r in ranks)
        age = f"{ages[0]}" if ages[0] == ages[-1] else f"{ages[0]}-{ages[-1]}"
        steps = sorted({records[r]["step"] for r in ranks if records[r]["step"] is not None})
        last = (f"the last said step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}" if steps else
                "the last came before the first step")
        what = ("closed its watchdog (it left training: finished, or raised)" if kind == "closed" else
                f"no heartbeat for {age} s or more (expected one every {interval:g} s; {last})")
        phrases.append(f"lost {ranks_phrase(ranks)} on {node}: {what}")
    return phrases


def progress(records: dict[int, dict[str, Any]], now: float) -> tuple[list[str], list[int], tuple[int, int]]:
    """``(phrases, ranks behind, best (step, seq))`` comparing the ranks in ``records`` by (step, beats)."""
    order = {r: _progress(rec) for r, rec in records.items()}
    best = max(order.values())
    behind = sorted((r for r in records if order[r] < best), key=lambda r: (order[r], r))
    parts = []
    for r in behind:
        rec = records[r]
        detail = f" (earlier in that step: beat #{rec['seq']} vs #{best[1]})" if order[r][0] == best[0] else ""
        where = f", training thread {rec['where']}" if rec.get("where") else ""
        parts.append(f"rank {r} last beat at step {rec['step']}{detail}, {now - rec['beat_wall']:.0f} s ago{where}")
    if behind:
        parts.append(f"{ranks_phrase(r for r in records if order[r] == best)} at step {_step(best)}")
    return parts, behind, best


def _progress(rec: dict[str, Any]) -> tuple[int, int]:
    """A rank's progress, compared across ranks: (step, beats), a step of None (no step yet) lowest."""
    return (rec["step"] if rec["step"] is not None else -1, rec["seq"])


def _step(best: tuple[int, int]) -> int | None:
    return best[0] if best[0] >= 0 else None


@dataclass
class Findings:
    """What one rank's hang report found: the text and the ranks it names."""

    text: str
    lost: tuple[int, ...] = ()
    lost_nodes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    behind: tuple[int, ...] = ()
    store_reachable: bool = True
    waiting_on: tuple[int, ...] = ()  # live ranks behind this one and silent at least as long (:func:`waited_on`)


def findings(box: Collected, *, rank: int, node: str, world_size: int, interval: float, stale_after: float,
             grace: float, store: str) -> Findings:
    """The report text for ``box`` as read by ``rank`` on ``node``."""
    head = f"hang report from rank {rank} on {node}"
    if box.records is None:
        return Findings(
            f"{head}: {store} did not answer within {grace + 0.5:.1f} s ({box.error or 'no reply'}), so this rank "
            f"cannot tell which ranks are lost; expected a reply within {grace + 0.5:.1f} s. The store's host "
            "(rank 0's node, usually) is down or cut off from this node. Fix: check this node's link to it; with "
            "health.hang_action='abort' this rank exits now and the launcher restarts it once the store is back.",
            store_reachable=False)
    records, now = box.records, box.read_at
    alive, lost = classify(records, world_size, box.quiet, stale_after)
    parts = describe_lost(records, lost, box.quiet, interval)
    behind: list[int] = []
    if alive:
        phrases, behind, best = progress(alive, now)
        if phrases:
            parts += [f"alive but behind: {phrases[0]}", *phrases[1:]] if lost else phrases
        else:
            who = "every rank still alive" if lost else "every rank that published"
            tail = "they wait for the lost ranks" if lost else "compare the stack dumps"
            at = f"at step {_step(best)} (beat #{best[1]})"
            parts.append(f"{ranks_phrase(alive)}, the only one still alive, is {at}" if len(alive) == 1 else
                         f"{who} ({ranks_phrase(alive)}) is {at}: no rank is behind; {tail}")
    suspects = sorted(lost) + behind
    verdict = f" Suspect: {ranks_phrase(suspects)}." if suspects else ""
    nodes = lost_by_node(records, lost)
    return Findings(f"{head}: {'; '.join(parts)}.{verdict}{_fix(records, lost, nodes, behind)}", tuple(lost), nodes,
                    tuple(behind), waiting_on=waited_on(alive, rank))


def waited_on(alive: dict[int, dict[str, Any]], rank: int) -> tuple[int, ...]:
    """The live ranks ``rank`` is probably waiting on: behind it by (step, beats) and silent at least as long
    (their last beat no later than its own). Both, because beat counts alone can mislead: a rank that ran extra
    forwards (an evaluation on rank 0) is ahead by beats though it may be the one stuck, and then its last beat
    is the earlier one."""
    me = alive.get(rank)
    if me is None:
        return ()
    return tuple(sorted(r for r, rec in alive.items()
                        if r != rank and _progress(rec) < _progress(me) and rec["beat_wall"] <= me["beat_wall"]))


def _fix(records: dict[int, dict[str, Any]], lost: list[int], nodes: dict[str, tuple[int, ...]],
         behind: list[int]) -> str:
    if not lost:
        return " Their stack dumps show where each rank is." if behind else ""
    if all(records.get(r, {}).get("closed") for r in lost):
        return (" Fix: a rank left training while the others wait in a collective: run the same steps on every "
                "rank, and see the log of the rank that left for the error that ended it.")
    targets = [n for n in nodes if n != "node unknown"]
    if "node unknown" in nodes:
        targets.append("the nodes of the ranks never seen")
    target = " and ".join([", ".join(targets[:-1]), targets[-1]] if len(targets) > 1 else targets)
    return (f" Fix: bring back {target}: check links and processes (a partitioned or frozen node sends nothing, a "
            "dead one resets its connections at once); with health.hang_action='abort' every rank that can reach "
            "the store exits with code 86 and the launcher restarts the job from the last committed checkpoint.")
