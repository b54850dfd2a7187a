"""A copy's file restored where it lies: its structure loaded with ``torch.load(mmap=True)``, then each tensor's bytes
copied from the mapped file into their destination and summed as they are copied (:mod:`.sums`).

A tensor's destination is the live tensor it restores where there is one of the same dtype and shape (a module's
parameter, an optimizer's state: :func:`destinations`), so a restore copies each byte once, into memory already
in use; otherwise new memory. Until :meth:`Mapped.fill` has run and the sum agreed with ``meta.json``, nothing of
the copy is trusted but its structure: the checks against the live objects run on it (its tensors are views of the
file), and a copy that does not fit is verified in full (:meth:`Mapped.verify`) before it is called unfit rather
than corrupt.

The file is checked as any read of the tier is (confined, exact size, a torch zip whose pickle is scanned before
``torch.load`` sees it); every non-empty data record must be one tensor storage of exactly its size, and the bytes
outside them (headers, the pickle) are summed when the file is opened. Copies are never edited in place, so the
mapping sees the bytes the file was written with. A process of the same user that edits the file while it is being
loaded can make ``torch.load`` read a pickle other than the one scanned (as with the durable tier, which also scans
and then loads from the file; ``weights_only`` still refuses code, and the sum then fails) or, by truncating it
under the mapping, crash the reader (``SIGBUS``): no more than such a process can do anyway.
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from robustdist.checkpoint import _payload, _schema
from robustdist.checkpoint._safeio import check_torch_zip, open_in
from robustdist.checkpoint._schema import weights_only_reason
from robustdist.checkpoint.local import layout, sums
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError

__all__ = ["Mapped", "destinations", "usable"]

_PROC_FD = "/proc/self/fd"


def usable() -> bool:
    """Whether this system can map a file it opened confined (by its descriptor's ``/proc`` path)."""
    return os.path.isdir(_PROC_FD)


@dataclass(eq=False)
class _Storage:
    offset: int
    nbytes: int
    source: torch.Tensor
    """The storage's bytes in the mapped file, as a uint8 tensor."""
    refs: list[tuple[Any, Any, torch.Tensor]] = field(default_factory=list)
    """``(container, key, tensor)`` for each tensor of the structure on this storage."""


@dataclass
class Mapped:
    """One file of a copy, loaded over a mapping of it (:func:`load`)."""

    value: Any
    where: str
    expected: int
    """The file's checksum, as ``meta.json`` records it."""
    digest: sums.Digest
    """The sums of what has been checked so far: the bytes outside the storages, then each storage copied."""
    storages: list[_Storage]
    empties: list[tuple[Any, Any, torch.Tensor]] = field(default_factory=list)
    """The tensors of no bytes (given tensors of their own: a view of the mapping would keep all of it alive)."""
    filled: bool = False
    touched: bool = False
    """Whether :meth:`fill_live` may have written into a live tensor (also when it then failed)."""

    def fill_new(self, live: dict[int, torch.Tensor]) -> None:
        """Copy every storage without a live tensor to go into (``live``: ``id`` of a tensor of the structure -> the
        live tensor it restores) into new memory, summing it; the structure then holds the copies. Their sums are
        judged with the rest's (:meth:`fill_live`)."""
        for s in list(self.storages):
            if _live_target(s, live) is not None:
                continue
            fresh = torch.empty(s.nbytes, dtype=torch.uint8)
            digest = sums.Digest()
            sums.copy_summed(fresh, s.source, s.offset, digest)
            self.digest.merge(digest)  # only a storage copied whole counts (verify() sums the rest from the file)
            self.storages.remove(s)
            storage = fresh.untyped_storage()
            for container, key, t in s.refs:
                view = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
                container[key] = view if type(t) is torch.Tensor else torch.nn.Parameter(
                    view, requires_grad=t.requires_grad)
        for container, key, t in self.empties:
            empty = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
            container[key] = empty if type(t) is torch.Tensor else torch.nn.Parameter(empty,
                                                                                     requires_grad=t.requires_grad)
        self.empties = []

    def fill_live(self, live: dict[int, torch.Tensor]) -> None:
        """Copy the remaining storages straight into their live tensors, summing them, then check the file's sum
        (CheckpointCorruptError when it differs); the structure then holds the live tensors. Call after
        :meth:`fill_new`."""
        before = self.digest.copy()
        for s in self.storages:
            dst = _live_target(s, live)
            assert dst is not None
            self.touched = True
            sums.copy_summed(dst.detach().reshape(-1).view(torch.uint8), s.source, s.offset, self.digest)
        if self.digest.value() != self.expected:
            for s in self.storages:
                before.add(s.source.numpy(), s.offset)
            if before.value() == self.expected:  # the file is right: what was written into did not hold still
                raise CheckpointError(f"{self.where}: the live tensors changed while the copy was written into them "
                                      "(another thread writing them?); expected them untouched during a restore. "
                                      "Fix: let no other thread write the model or optimizer while resume() runs.")
            raise CheckpointCorruptError(f"{self.where}: its checksum differs from its meta.json (the bytes changed)")
        for s in self.storages:
            s.refs[0][0][s.refs[0][1]] = _live_target(s, live)
        self.storages, self.filled = [], True

    def verify(self) -> bool:
        """Whether the file's bytes agree with ``meta.json`` (read from the mapping; copies nothing), before
        :meth:`fill_new`."""
        digest = self.digest.copy()
        for s in self.storages:
            digest.add(s.source.numpy(), s.offset)
        return self.filled or digest.value() == self.expected


def _live_target(s: _Storage, live: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The live tensor to copy storage ``s`` into: only where one tensor covers the whole storage."""
    if len(s.refs) != 1:
        return None
    t = s.refs[0][2]
    dst = live.get(id(t))
    if dst is None or t.storage_offset() != 0 or not t.is_contiguous() or t.numel() * t.element_size() != s.nbytes:
        return None
    return dst


def _fits(saved: torch.Tensor, live: Any) -> bool:
    return (isinstance(live, torch.Tensor) and type(live) in (torch.Tensor, torch.nn.Parameter)
            and live.device.type == "cpu" and live.layout == torch.strided and not live.is_quantized
            and not live.is_nested and not live.is_conj() and not live.is_neg() and live.dtype == saved.dtype
            and live.shape == saved.shape and live.is_contiguous() and live.numel() > 0)


def _pairs(saved: Any, live: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(saved tensor, live tensor)`` at the same place of two structures of dicts, lists and tuples."""
    if isinstance(saved, torch.Tensor):
        if _fits(saved, live):
            yield saved, live
    elif isinstance(saved, dict) and isinstance(live, dict):
        for k, v in saved.items():
            if k in live:
                yield from _pairs(v, live[k])
    elif isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        for v, w in zip(saved, live):
            yield from _pairs(v, w)


def destinations(entries: list[tuple[str, Any, Any]]) -> dict[int, torch.Tensor]:
    """For ``(name, live object, saved state)`` of entries whose saved state was checked against the live object
    (modules, optimizers: restoring them copies each tensor into, or hands it to, its place): ``id`` of each saved
    tensor -> the live tensor it restores, where dtype and shape agree. A live tensor two places share is no
    destination (each place would be written)."""
    out: dict[int, torch.Tensor] = {}
    seen: dict[int, int] = {}
    for name, live, saved in entries:
        kind, state = _payload.entry_state(name, live)
        if kind not in ("module", "stateful"):
            continue
        for s, t in _pairs(saved, state):
            key = t.untyped_storage().data_ptr()
            seen[key] = seen.get(key, 0) + 1
            out[id(s)] = t
    return {k: t for k, t in out.items() if seen[t.untyped_storage().data_ptr()] == 1}


# ---------------------------------------------------------------------- opening
def _records(fh: Any, where: str) -> list[tuple[int, int]]:
    """``(data offset, size)`` of each non-empty data record (``<archive>/data/<key>``, any key, any case: torch
    looks records up without regard to case) of the torch zip ``fh``."""
    out = []
    with zipfile.ZipFile(fh) as archive:
        members = archive.infolist()
    for m in members:
        parts = m.filename.lower().split("/")
        if len(parts) != 3 or parts[1] != "data" or not m.file_size:
            continue
        fh.seek(m.header_offset)
        head = fh.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise CheckpointCorruptError(f"{where}: not a torch zip file (no local header for {m.filename!r:.80})")
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        out.append((m.header_offset + 30 + name_len + extra_len, m.file_size))
    out.sort()
    if any(a + n > b for (a, n), (b, _) in zip(out, out[1:])):
        raise CheckpointCorruptError(f"{where}: not a torch zip file (two of its data records overlap)")
    return out


class _Declined(Exception):
    """The structure holds what this path does not copy: the caller reads the file instead."""


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensor(v) for v in value)


def _tensors(value: Any) -> Iterator[tuple[Any, Any, torch.Tensor]]:
    """``(container, key, tensor)`` for every tensor in a structure of dicts and lists; _Declined for a tensor in a
    tuple (which cannot take its destination in place) or of a kind other than a plain strided one."""
    if isinstance(value, dict) and any(_holds_tensor(k) for k in value):
        raise _Declined
    for key, v in list(value.items()) if isinstance(value, dict) else enumerate(value):
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided or v.is_quantized or v.is_nested or type(v) not in (torch.Tensor,
                                                                                           torch.nn.Parameter):
                raise _Declined
            yield value, key, v
        elif isinstance(v, (dict, list)):
            yield from _tensors(v)
        elif isinstance(v, tuple) and _holds_tensor(v):
            raise _Declined


def load(holding: layout.Holding, name: str, where: str) -> Mapped | None:
    """File ``name`` of the copy ``holding``, checked and loaded over a mapping; None when it holds tensors of a kind
    this path does not copy (sparse, quantized, nested) or the mapping itself failed: the caller reads the file
    instead."""
    entry = holding.files[name]
    layout.check_room(holding, name)
    with open_in(holding.root, f"{holding.relative}/{name}", size=entry["size"]) as fh:
        check_torch_zip(fh, where, values=_schema.MAX_PAYLOAD_VALUES, payload=True)
        layout.check_dense(fh, entry["size"], where)
        try:
            records = _records(fh, where)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise CheckpointCorruptError(f"{where}: not a torch zip file ({str(e)[:200]})") from None
        try:
            found = torch.load(f"{_PROC_FD}/{fh.fileno()}", mmap=True, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise CheckpointCorruptError(f"{where}: refused to load: {weights_only_reason(e)}; nothing was executed") \
                from e
        except Exception:  # the mapping itself failed (no /proc, memory not committed...): read the file instead
            return None
        _schema.check_size(where, found, _schema.MAX_PAYLOAD_VALUES)
        expected = layout.expected_sum(holding, name)
        if not isinstance(found, dict):  # no tensors to copy: unbind names what it is
            return Mapped(found, where, expected, sums.Digest(), [], filled=True)
        groups: dict[int, _Storage] = {}
        empties = []
        try:
            for container, key, t in _tensors(found):
                storage = t.untyped_storage()
                if storage.nbytes() == 0:
                    empties.append((container, key, t))
                    continue
                ptr = storage.data_ptr()
                if ptr not in groups:
                    groups[ptr] = _Storage(0, storage.nbytes(), torch.empty(0, dtype=torch.uint8).set_(storage))
                groups[ptr].refs.append((container, key, t))
        except _Declined:
            return None
        storages = [groups[p] for p in sorted(groups)]
        if len(storages) != len(records) or any(s.nbytes != size for s, (_, size) in zip(storages, records)) or \
                len({p - off for p, (off, _) in zip(sorted(groups), records)}) > 1:
            raise CheckpointCorruptError(f"{where}: its tensors are not its data records one to one (a torch file "
                                         "this tier did not write)")
        for s, (off, _) in zip(storages, records):
            s.offset = off
        digest = _sum_outside(fh, entry["size"], records, where)
    return Mapped(found, where, expected, digest, storages, empties)


def _sum_outside(fh: Any, size: int, records: list[tuple[int, int]], where: str) -> sums.Digest:
    """The sums of the bytes of ``fh`` outside ``records`` (read from the file, a chunk at a time)."""
    digest, at = sums.Digest(), 0
    for off, n in [*records, (size, 0)]:
        fh.seek(at)
        while at < off:
            chunk = fh.read(min(off - at, sums.BLOCK))
            if not chunk:
                raise CheckpointCorruptError(f"{where}: shorter than its directory says")
            digest.add(chunk, at)
            at += len(chunk)
        at = off + n
    return digest
