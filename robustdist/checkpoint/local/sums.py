"""The in-memory tier's checksum: computed at memory speed and additive over byte ranges, so a copy is verified as
its bytes are copied into place.

A file is cut into 1 MiB blocks, each read as a 256 x 512 matrix of little-endian unsigned 64-bit words (4 KiB
rows; a file's last word padded with zeros). Each block keeps the sums of its rows and of its columns (modulo
2**64): any range of the file adds its words into the sums of the rows and columns they sit in, wherever the range
starts and ends, so a file's sums are the same whether it was summed whole or range by range (:class:`Digest`):
the restore sums each tensor's bytes right after copying them into their destination, while they are in the cache,
and compares once every range is in (no second pass over the data). The checksum is then
``sum over blocks j of (2j + 1) x (sum over rows r of (2r + 1) x row_r + sum over columns c of (2c + 1) x col_c)``
modulo the prime ``2**61 - 1``, the inner sums taken exactly.

What it catches: any change confined to one word (it changes one row sum and one column sum); any change of two
words of one block, whatever the bits (two words share a row or a column, not both), opposite flips of the same bit
and top-bit flips included; a row moved within a block and a block moved within the file (their weights change);
truncation and extension (the size is checked too); random damage with a chance of about 2**-61 to pass. It is
not tamper-proofing: whoever can write a copy can write its ``meta.json`` (docs/security.md). Speed: a row and a
column sum of a block in the cache take about a fifth of a CRC-32's time (``benchmarks/findings.md``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["BLOCK", "Digest", "copy_summed", "of"]

ROWS, COLS = 256, 512
BLOCK = ROWS * COLS * 8
PRIME = (1 << 61) - 1
_ROW_W = np.arange(1, 2 * ROWS, 2, dtype=np.uint64)
_COL_W = np.arange(1, 2 * COLS, 2, dtype=np.uint64)
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def _weighted(sums: np.ndarray, weights: np.ndarray) -> int:
    """``sum(weights * sums)`` exactly (the sums are below 2**64, the weights below 2**10)."""
    return (int(np.dot(sums >> _SHIFT, weights)) << 32) + int(np.dot(sums & _LOW, weights))


class Digest:
    """The row and column sums of the blocks of one file, accumulated range by range (:meth:`add`)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        got = self.blocks.get(j)
        if got is None:
            got = self.blocks[j] = (np.zeros(ROWS, dtype=np.uint64), np.zeros(COLS, dtype=np.uint64))
        return got

    def _word(self, data: memoryview, pos: int) -> None:
        """Bytes ``data`` (within one word) at file position ``pos``."""
        value = np.array([int.from_bytes(data, "little") << (8 * (pos % 8))], dtype=np.uint64)
        j, w = divmod(pos // 8, ROWS * COLS)
        rows, cols = self._block(j)
        r, c = divmod(w, COLS)
        rows[r:r + 1] += value
        cols[c:c + 1] += value

    def _words(self, words: np.ndarray, w: int) -> None:
        """Whole words starting at word ``w`` of the file, all in one block."""
        j, at = divmod(w, ROWS * COLS)
        rows, cols = self._block(j)
        r, c = divmod(at, COLS)
        if c:  # the rest of a row begun before
            head = words[:COLS - c]
            rows[r:r + 1] += np.add.reduce(head, dtype=np.uint64)
            cols[c:c + len(head)] += head
            words, r = words[len(head):], r + 1
        full = len(words) // COLS
        if full:
            matrix = words[:full * COLS].reshape(full, COLS)
            rows[r:r + full] += matrix.sum(axis=1, dtype=np.uint64)
            cols += matrix.sum(axis=0, dtype=np.uint64)
        tail = words[full * COLS:]
        if len(tail):
            rows[r + full:r + full + 1] += np.add.reduce(tail, dtype=np.uint64)
            cols[:len(tail)] += tail

    def add(self, data: Any, pos: int = 0) -> Digest:
        """Add ``data`` (a bytes-like object), which sits at byte ``pos`` of the file."""
        view = memoryview(data).cast("B")
        end = pos + len(view)
        head = min(-pos % 8, len(view))
        if head:
            self._word(view[:head], pos)
        at = pos + head
        aligned_end = max(at, end - end % 8)
        while at < aligned_end:
            stop = min(aligned_end, (at // BLOCK + 1) * BLOCK)
            self._words(np.frombuffer(view[at - pos:stop - pos], dtype="<u8"), at // 8)
            at = stop
        if at < end:
            self._word(view[at - pos:], at)
        return self

    def copy(self) -> Digest:
        out = Digest()
        out.blocks = {j: (rows.copy(), cols.copy()) for j, (rows, cols) in self.blocks.items()}
        return out

    def value(self) -> int:
        """The checksum of everything added (a number below 2**61)."""
        total = 0
        for j, (rows, cols) in self.blocks.items():
            total += (2 * j + 1) * (_weighted(rows, _ROW_W) + _weighted(cols, _COL_W))
        return total % PRIME


def of(data: Any) -> int:
    """The checksum of ``data`` (a bytes-like object) as a whole file."""
    return Digest().add(data).value()


def copy_summed(dst: torch.Tensor, src: torch.Tensor, pos: int, digest: Digest) -> None:
    """Copy ``src`` into ``dst`` (contiguous uint8 CPU tensors of one size), a block at a time, adding each block of
    ``dst`` to ``digest`` right after it is written (``src`` being at byte ``pos`` of its file)."""
    n = dst.numel()
    done = 0
    out = dst.numpy()
    with torch.no_grad():
        while done < n:
            stop = min(n, (pos + done) // BLOCK * BLOCK + BLOCK - pos)
            dst[done:stop].copy_(src[done:stop])
            digest.add(out[done:stop], pos + done)
            done = stop
