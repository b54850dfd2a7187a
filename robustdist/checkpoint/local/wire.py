"""Moving the in-memory tier's bytes between ranks: point-to-point over the tier's own gloo group.

Each message is a fixed header (how many blobs, then each blob's size and checksum, :mod:`.sums`) followed by the
blobs, each under its own tag. The receiver allocates from the header, checks every checksum on arrival, and names
the sender
when anything is late or wrong. Every wait is bounded by the tier's timeout (gloo honours ``wait(timeout)``
for point-to-point work), so a peer that died mid-transfer is an error naming it, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from robustdist.checkpoint.local import sums
from robustdist.runtime import _serialization_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.deadline import bounded
from robustdist.runtime.errors import CheckpointError

__all__ = ["Blob", "as_tensor", "exchange", "nbytes", "serialise"]

MAX_BLOBS = 2
_HEADER = 1 + 2 * MAX_BLOBS


def as_tensor(data: Any) -> torch.Tensor:
    """A uint8 CPU tensor over ``data`` (a bytearray or writable buffer): no copy."""
    return torch.frombuffer(data, dtype=torch.uint8) if len(memoryview(data)) else torch.empty(0, dtype=torch.uint8)


def _sum(t: torch.Tensor) -> int:
    return sums.of(t.numpy())


@dataclass(frozen=True, eq=False)
class Blob:
    """Bytes as a uint8 tensor with their checksum (:mod:`.sums`), computed once: the same number goes into the
    header a peer checks and into the ``meta.json`` of the copy written from it (a save beside training pays each
    one)."""

    tensor: torch.Tensor
    checksum: int

    @classmethod
    def of(cls, data: Any) -> Blob:
        """``data`` (a bytearray or writable buffer) without a copy, and its checksum."""
        t = as_tensor(data)
        return cls(t, _sum(t))

    def view(self) -> memoryview:
        return memoryview(self.tensor.numpy())


def _wait(works: list[tuple[Any, str]], timeout: float, rank: int, what: str) -> None:
    """Wait for ``works`` (bounded by ``timeout`` each) on a helper thread, and give up at once when an in-process
    recovery interrupts the waits: gloo does not always wake a point-to-point wait whose transfer is under way when
    its connections are shut down (benchmarks/findings.md, P10), so only the helper is left with such a wait (the
    timeout still ends it) and the caller goes on."""
    where: dict[str, str] = {}

    def run() -> str | None:
        for work, peer in works:
            where["peer"] = peer
            if work.wait(timedelta(seconds=timeout)) is False:
                return peer
        return None

    end = time.monotonic() + timeout * len(works) + 5.0  # gloo ends each wait by its timeout first
    late, error, finished = bounded(run, end, f"local-wait-{rank}", stop=_dist.interrupted, ends_by=end + 5.0)
    if not finished and (reason := _dist.interrupted()) is not None:
        raise CheckpointError(f"the in-memory checkpoint {what} with {where.get('peer', 'its peer')} was given up: "
                              f"{reason}. Expected when the job recovers in place (its wait is left to end on "
                              "its own). Fix: none; the recovery resumes from the newest complete step.",
                              rank=rank)
    if error is not None:  # gloo raises on timeout or a closed connection
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise CheckpointError(f"the in-memory checkpoint {what} with {where.get('peer', 'its peer')} failed "
                              f"({type(error).__name__}: {first}); expected it within {timeout:g} s. The peer "
                              "probably died. Fix: see its log; the restarted job recovers from the newest complete "
                              "step.", rank=rank) from error
    if not finished or late is not None:
        raise CheckpointError(f"the in-memory checkpoint {what} with {late or where.get('peer', 'its peer')} did not "
                              f"finish within {timeout:g} s; expected the peer to take part. Fix: see its log.",
                              rank=rank)


def exchange(group: Any, rank: int, sends: dict[int, list[Blob]], receive_from: list[int], *,
             timeout: float, what: str) -> dict[int, list[Blob]]:
    """Send ``sends[dst]`` (up to two blobs each) to every ``dst`` and receive from every rank in
    ``receive_from``; return what each sender sent, checked (each blob with the checksum it was checked against). Every rank of a pair must call it. Not started while waits are interrupted (an in-process recovery
    shut the group's connections)."""
    if (reason := _dist.interrupted()) is not None:
        raise CheckpointError(f"{what} was not started: {reason}. Expected when the job recovers in place.",
                              rank=rank)
    works: list[tuple[Any, str]] = []
    keep: list[torch.Tensor] = []
    for dst, blobs in sends.items():
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = len(blobs)
        for i, blob in enumerate(blobs):
            header[1 + 2 * i], header[2 + 2 * i] = blob.tensor.numel(), blob.checksum
        keep.append(header)
        works.append((dist.isend(header, dst, group=group, tag=0), f"rank {dst}"))
        for i, blob in enumerate(blobs):
            if blob.tensor.numel():
                works.append((dist.isend(blob.tensor, dst, group=group, tag=1 + i), f"rank {dst}"))
    headers = {src: torch.zeros(_HEADER, dtype=torch.int64) for src in receive_from}
    recv_works = [(dist.irecv(h, src, group=group, tag=0), f"rank {src}") for src, h in headers.items()]
    _wait(recv_works, timeout, rank, f"{what} (header)")
    received: dict[int, list[torch.Tensor]] = {}
    data_works = []
    for src, h in headers.items():
        count = int(h[0])
        if not 0 <= count <= MAX_BLOBS or any(int(h[1 + 2 * i]) < 0 for i in range(count)):
            raise CheckpointError(f"rank {src} sent a malformed in-memory checkpoint header {h.tolist()}; expected "
                                  f"up to {MAX_BLOBS} sizes. Fix: run the same robustdist version on every rank.",
                                  rank=rank)
        received[src] = [torch.empty(int(h[1 + 2 * i]), dtype=torch.uint8) for i in range(count)]
        for i, buf in enumerate(received[src]):
            if buf.numel():
                data_works.append((dist.irecv(buf, src, group=group, tag=1 + i), f"rank {src}"))
    _wait(data_works, timeout, rank, what)
    _wait(works, timeout, rank, what)
    checked: dict[int, list[Blob]] = {}
    for src, bufs in received.items():
        checked[src] = []
        for i, buf in enumerate(bufs):
            if (got := _sum(buf)) != int(headers[src][2 + 2 * i]):
                raise CheckpointError(f"the in-memory checkpoint {what} from rank {src} arrived with a checksum other "
                                      "than the one it sent; expected the bytes it sent. Fix: check the network.",
                                      rank=rank)
            checked[src].append(Blob(buf, got))
    return checked


def nbytes(value: Any) -> int:
    """About how many bytes ``value`` (tensors in dicts, lists and tuples) holds: what a local save sizes."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 64


class _Sink:
    """A write-only file for ``torch.save`` that grows a ``bytearray``. Not ``BytesIO.getbuffer()``: a view of a
    BytesIO that a garbage-collected cycle outlives crashes CPython 3.12.1 ("deallocated BytesIO object has
    exported buffers", then a segfault, with torch 2.15)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: Any) -> int:
        self.data += chunk
        return len(memoryview(chunk))

    def flush(self) -> None:
        pass


def serialise(obj: Any) -> memoryview:
    """``torch.save`` of ``obj`` into memory: the bytes a local copy holds. Without the zip records' own CRC-32s
    (most of torch.save's time for large tensors): each blob has one checksum of its own (:class:`Blob`), checked on
    every read and on every receipt."""
    sink = _Sink()
    _serialization_compat.save_without_record_crcs(obj, sink)
    return memoryview(sink.data)  # no copy: the view keeps the bytearray alive
