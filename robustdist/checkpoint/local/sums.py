"""The in-memory tier's checksum: computed at memory speed and additive over byte ranges, so a copy is verified as
its bytes are copied into place.

A file is cut into 1 MiB blocks, each read as a 256 x 1024 matrix of little-endian unsigned 32-bit numbers (4 KiB
rows; a file's last number padded with zeros). Each block keeps the exact sums of its rows and of its columns
(64-bit accumulators: a row sum stays below 2**42, a column sum below 2**40): any range of the file adds its
numbers into the sums of the rows and columns they sit in, wherever the range starts and ends, so a file's sums
are the same whether it was summed whole or range by range (:class:`Digest`): the restore sums each tensor's bytes
right after copying them into their destination, while they are in the cache, and compares once every range is in
(no second pass over the data). The checksum of a block is ``sum_r (2r + 1) row_r + 2**11 x sum_c (2c + 1) col_c``,
an exact integer below 2**62; the file's is ``sum_j 3**(j + 1) x block_j`` modulo the prime ``2**61 - 1``.

What it catches: any change within one 32-bit number; any one or two flipped bits of a block, wherever they are
and whichever way they flip (a block's checksum then changes by a non-zero integer below the prime); a row moved
within a block, a block moved within the file; truncation and extension (the size is checked too). Other damage
passes with a chance of about 2**-32 (two numbers of one block changed just so) or less. It is not tamper-proofing:
whoever can write a copy can write its ``meta.json`` (docs/security.md). Speed: the row and column sums of a block
in the cache take about as long as a CRC-32 of it, and unlike a CRC-32 they add up over ranges
(``benchmarks/findings.md``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["BLOCK", "Digest", "copy_summed", "of"]

ROWS, COLS = 256, 1024
BLOCK = ROWS * COLS * 4
PRIME = (1 << 61) - 1
_ROW_W = np.arange(1, 2 * ROWS, 2, dtype=np.uint64)
_COL_W = np.arange(1, 2 * COLS, 2, dtype=np.uint64)
_COL_SCALE = 1 << 11


class Digest:
    """The row and column sums of the blocks of one file, accumulated range by range (:meth:`add`)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        got = self.blocks.get(j)
        if got is None:
            got = self.blocks[j] = (np.zeros(ROWS, dtype=np.uint64), np.zeros(COLS, dtype=np.uint64))
        return got

    def _number(self, data: memoryview, pos: int) -> None:
        """Bytes ``data`` (within one 32-bit number) at file position ``pos``."""
        value = np.array([int.from_bytes(data, "little") << (8 * (pos % 4))], dtype=np.uint64)
        j, at = divmod(pos // 4, ROWS * COLS)
        rows, cols = self._block(j)
        r, c = divmod(at, COLS)
        rows[r:r + 1] += value
        cols[c:c + 1] += value

    def _numbers(self, numbers: np.ndarray, n: int) -> None:
        """Whole 32-bit numbers starting at number ``n`` of the file, all in one block."""
        j, at = divmod(n, ROWS * COLS)
        rows, cols = self._block(j)
        r, c = divmod(at, COLS)
        if c:  # the rest of a row begun before
            head = numbers[:COLS - c]
            rows[r:r + 1] += np.add.reduce(head, dtype=np.uint64)
            cols[c:c + len(head)] += head
            numbers, r = numbers[len(head):], r + 1
        full = len(numbers) // COLS
        if full:
            matrix = numbers[:full * COLS].reshape(full, COLS)
            rows[r:r + full] += matrix.sum(axis=1, dtype=np.uint64)
            cols += matrix.sum(axis=0, dtype=np.uint64)
        tail = numbers[full * COLS:]
        if len(tail):
            rows[r + full:r + full + 1] += np.add.reduce(tail, dtype=np.uint64)
            cols[:len(tail)] += tail

    def add(self, data: Any, pos: int = 0) -> Digest:
        """Add ``data`` (a bytes-like object), which sits at byte ``pos`` of the file."""
        view = memoryview(data).cast("B")
        end = pos + len(view)
        head = min(-pos % 4, len(view))
        if head:
            self._number(view[:head], pos)
        at = pos + head
        aligned_end = max(at, end - end % 4)
        while at < aligned_end:
            stop = min(aligned_end, (at // BLOCK + 1) * BLOCK)
            self._numbers(np.frombuffer(view[at - pos:stop - pos], dtype="<u4"), at // 4)
            at = stop
        if at < end:
            self._number(view[at - pos:], at)
        return self

    def merge(self, other: Digest) -> None:
        """Add what ``other`` holds (sums of other ranges of the same file)."""
        for j, (rows, cols) in other.blocks.items():
            my_rows, my_cols = self._block(j)
            my_rows += rows
            my_cols += cols

    def copy(self) -> Digest:
        out = Digest()
        out.blocks = {j: (rows.copy(), cols.copy()) for j, (rows, cols) in self.blocks.items()}
        return out

    def value(self) -> int:
        """The checksum of everything added (a number below 2**61)."""
        total = 0
        for j, (rows, cols) in self.blocks.items():
            block = int(np.dot(rows, _ROW_W)) + _COL_SCALE * int(np.dot(cols, _COL_W))
            total += pow(3, j + 1, PRIME) * block
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
