"""The checkpointer's collectives: an arrival check that names absent ranks, and bounded, named wrappers.

``save()``, ``load()`` (and so ``Hardened.save``/``resume``) are collective: every rank of the checkpointer's
group must call them, in the same order. A script that saves only on rank 0 (as the pytorch/examples DDP
tutorial does) would otherwise leave rank 0 waiting in a broadcast for the whole collective timeout while
the other ranks train on. So each call first *arrives*: the rank sets ``robustdist/ckpt/<token>/<seq>/<op>/
<rank>`` in the job's c10d store and waits, at most ``arrival_timeout`` seconds, for every rank's key of the
same call. A rank that does not arrive in time is named (with the call it is in instead, if any), on every
rank that did, with the rule ("save() is collective: call it on every rank"). A rank that arrives after the
others gave up sees their ``abandoned`` mark and raises too, instead of entering a collective alone.

After such an error, or a failed collective, the ranks' call sequences may no longer match, so the
checkpointer refuses further calls (create a new one, normally by restarting the job).

Without a c10d store (a group made from a custom store that torch does not expose) the arrival check is
skipped and only the collectives' own timeout bounds the wait.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from robustdist.errors import CheckpointError, ranks_phrase
from robustdist.process_group import default_store

T = TypeVar("T")
OPS = ("save", "load")


class Collectives:
    """Bounded, named collectives over the checkpointer's group (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world_size: int, *, timeout: float, arrival_timeout: float):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.timeout, self.arrival_timeout = timeout, arrival_timeout
        self.broken: str | None = None
        self._seq = 0
        self._last_op = ""
        self._store = default_store() if world_size > 1 else None
        self.token = uuid.uuid4().hex[:12]
        if world_size > 1:  # one token per checkpointer, the same on every rank (no stale keys from other runs)
            self.token = self.broadcast(self.token, "setup")

    def check_usable(self) -> None:
        if self.broken is not None:
            raise CheckpointError(f"this checkpointer's ranks fell out of step earlier ({self.broken}); expected "
                                  "every rank to make the same calls. Fix: restart the job (or create a new "
                                  "AtomicCheckpointer on every rank).", rank=self.rank)

    # ------------------------------------------------------------------ arrival
    def arrive(self, op: str) -> None:
        """Wait until every rank has reached ``op`` (the same call); raise naming those that have not."""
        self.check_usable()
        if self.world_size == 1 or self._store is None:
            return
        self._seq += 1
        self._last_op, op_before = op, self._last_op
        base = f"robustdist/ckpt/{self.token}/{self._seq}"
        try:
            self._wait_for_all(op, base)
        except CheckpointError:
            raise
        except Exception as e:  # the store went away: rank 0 (its host, usually) exited
            self._fail(f"the job's c10d store stopped answering while this rank waited in {op}() "
                       f"({type(e).__name__}: {str(e)[:200]}); the rank hosting it (rank 0, usually) probably exited",
                       op, [])
        if self.rank == 0 and self._seq > 1:  # every rank is past the previous call now: drop its keys
            previous = f"robustdist/ckpt/{self.token}/{self._seq - 1}"
            for key in [f"{previous}/{op_before}/{r}" for r in range(self.world_size)]:
                try:
                    self._store.delete_key(key)
                except Exception:  # a store without delete_key only keeps a few bytes more
                    break

    def _wait_for_all(self, op: str, base: str) -> None:
        store = self._store
        if store.check([f"{base}/abandoned"]):
            self._fail(f"the other ranks stopped waiting for {op}() before this rank arrived (each waits "
                       f"{self.arrival_timeout:g} s)", op, [])
        store.set(f"{base}/{op}/{self.rank}", "1")
        keys = [f"{base}/{op}/{r}" for r in range(self.world_size)]
        start = time.monotonic()
        delay = 0.001
        while not store.check(keys):
            gave_up = store.check([f"{base}/abandoned"])
            if gave_up or time.monotonic() - start > self.arrival_timeout:
                if store.check(keys):  # the last rank arrived just now
                    break
                store.set(f"{base}/abandoned", str(self.rank))
                self._fail_absent(op, base)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if store.check([f"{base}/abandoned"]):
            self._fail(f"another rank stopped waiting for {op}() just as this rank arrived", op, [])

    def _fail_absent(self, op: str, base: str) -> None:
        store = self._store
        missing = [r for r in range(self.world_size) if not store.check([f"{base}/{op}/{r}"])]
        elsewhere = [f"rank {r} is in {other}() instead" for r in missing for other in OPS
                     if other != op and store.check([f"{base}/{other}/{r}"])]
        where = f" ({'; '.join(elsewhere)})" if elsewhere else ""
        self._fail(f"{ranks_phrase(missing)} did not reach {op}() within {self.arrival_timeout:g} s{where}; expected "
                   f"all {self.world_size} ranks", op, missing)

    def _fail(self, found: str, op: str, missing: list[int]) -> None:
        self.broken = found
        slow = f" if {ranks_phrase(missing)} {'is' if len(missing) == 1 else 'are'} only slow" if missing else ""
        raise CheckpointError(
            f"{op}() is collective: call it on every rank. {found[0].upper()}{found[1:]}. Fix: call {op}() on every "
            f"rank, not under `if rank == 0:` (robustdist writes from the right ranks itself), or raise "
            f"checkpoint.arrival_timeout{slow} (e.g. evaluating on one rank before saving).",
            rank=self.rank, ranks=missing)

    # ------------------------------------------------------------------ collectives
    def run(self, what: str, fn: Callable[[], T]) -> T:
        """Run a collective; turn its failure into a CheckpointError saying when and what failed."""
        start = time.monotonic()
        try:
            return fn()
        except Exception as e:
            elapsed = time.monotonic() - start
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            self.broken = f"the {what} collective failed"
            raise CheckpointError(
                f"the checkpoint's {what} collective failed after {elapsed:.1f} s (bound {self.timeout:g} s): "
                f"{type(e).__name__}: {first}. Expected every rank of the checkpointer's group in it; another rank "
                "probably died or left the call. Fix: see the other ranks' logs for their error.",
                rank=self.rank) from e

    def broadcast(self, obj: T, what: str) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        self.run(what, lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def all_gather(self, obj: T, what: str) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        everyone: list[Any] = [None] * self.world_size
        self.run(what, lambda: dist.all_gather_object(everyone, obj, group=self.group))
        return everyone
