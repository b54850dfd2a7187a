"""File primitives for crash-safe checkpoints: checksum-while-writing, fsync, directory fsync, the job lock.

Checksums are CRC-32 (zlib): they detect corruption and truncation (every error burst up to 32 bits, any
other change with probability 1 - 2**-32 per file) several times faster than SHA-256, which was the slowest
part of a save on this project's CI machine (figures: benchmarks/RESULTS.md, P2). They are
not a defence against tampering: whoever can rewrite a checkpoint file can rewrite its manifest too; the
boundary is how files are read (docs/security.md: confined, bounded, ``weights_only=True``). Manifests
written with SHA-256 (robustdist 0.1.0) still verify.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from robustdist.checkpoint._confined import Confined, os_error  # noqa: F401 - os_error re-exported
from robustdist.checkpoint._safeio import open_in
from robustdist.runtime.errors import CheckpointError
from robustdist.runtime.log import get_logger

log = get_logger(__name__)
_CHUNK = 8 << 20
_OVERLAP_MIN = 1 << 20  # writes this large are hashed on a helper thread while the file write runs


class Crc32:
    """``hashlib``-style running CRC-32 (zlib releases the GIL on large buffers)."""

    name = "crc32"

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class HashingWriter:
    """A write-only binary file that computes its CRC-32 and size while writing, and fsyncs on close.

    A large buffer is hashed on a helper thread *during* its file write (both release the GIL), and
    ``write`` returns only when both are done, so the buffer (which torch may free afterwards) is never used
    later and the digest stays in order. Hashing then costs almost nothing beyond the write itself.
    """

    def __init__(self, folder: Confined, name: str, on_write: Callable[[int], None] | None = None):
        self.path = os.path.join(folder.path, name)
        self._fh: BinaryIO = folder.open_new(name)  # closed in close()
        self._sha = Crc32()
        self.size = 0
        self._on_write = on_write
        self.error: BaseException | None = None  # torch's zip writer can mask it with its own message
        self._pool: ThreadPoolExecutor | None = None
        self._flusher: ThreadPoolExecutor | None = None
        self._flushing: Any = None

    def _write_and_hash(self, view: memoryview) -> None:
        if len(view) < _OVERLAP_MIN:
            self._fh.write(view)
            self._sha.update(view)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="robustdist-checksum")
            self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="robustdist-fsync")
        hashing = self._pool.submit(self._sha.update, view)
        try:
            self._fh.write(view)
        finally:
            hashing.result()
        # start writing back what is written so far while torch serialises the next record, so the final
        # fsync has little left to do (one flush in flight at a time)
        if self._flushing is None or self._flushing.done():
            self._fh.flush()
            self._flushing = self._flusher.submit(os.fdatasync, self._fh.fileno())

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self._write_and_hash(view)
        except BaseException as e:
            self.error = e
            raise
        self.size += len(view)
        if self._on_write is not None:
            try:
                self._on_write(self.size)
            except BaseException as e:
                self.error = e
                raise
        return len(view)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> tuple[int, str]:
        """Flush, fsync and close; return ``(size, crc32 hex)``."""
        try:
            if self._flushing is not None:
                self._flushing.result()  # an early flush's error (EIO, ENOSPC) is this file's error
            self._fh.flush()
            os.fsync(self._fh.fileno())
        finally:
            self.abort()
        return self.size, self._sha.hexdigest()

    def abort(self) -> None:
        for pool in (self._pool, self._flusher):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._flusher = None
        if self._flushing is not None and self._flushing.done() and self._flushing.exception() is not None:
            self.error = self.error or self._flushing.exception()
        try:
            self._fh.close()
        except OSError:
            pass


def digest_stream(fh: BinaryIO, digest: Any) -> int:
    """Feed what is left of ``fh`` to ``digest`` (:class:`Crc32` or a ``hashlib`` object); the bytes read."""
    size = 0
    while chunk := fh.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size


def _digest_file(path: str, digest: Any) -> tuple[int, str]:
    with open_in(os.path.dirname(path), os.path.basename(path)) as fh:
        size = digest_stream(fh, digest)
    return size, digest.hexdigest()


def crc32_file(path: str) -> tuple[int, str]:
    return _digest_file(path, Crc32())


def sha256_file(path: str) -> tuple[int, str]:
    """For manifests written by robustdist 0.1.0."""
    return _digest_file(path, hashlib.sha256())


def checksum_entry(path: str) -> dict[str, Any]:
    size, digest = crc32_file(path)
    return {"size": size, "crc32": digest}


def fsync_dir(path: str) -> None:
    """Make renames and creations inside ``path`` durable (a failure is a :class:`CheckpointError`)."""
    with Confined(path) as folder:
        folder.sync(strict=True)


LOCK = ".lock"
_held: dict[str, Any] = {}  # POSIX locks do not conflict within one process: track this process's own


class DirLock:
    """An exclusive ``fcntl`` lock on ``<dir>/.lock``, naming its holder (pid, host) in the file.

    The kernel drops the lock when the holder dies, so a stale lock from a crashed job is recovered simply
    by taking it again. :meth:`release` empties the file while still holding the lock, so a released lock
    names no holder (the file itself stays: removing it would race with a process that has just opened it).
    """

    def __init__(self, directory: str, *, patience: float = 0.0):
        self.path = os.path.join(directory, LOCK)
        self.patience = patience
        """Seconds to keep trying for a lock another process holds before it is refused (0: at once)."""
        self._fh: Any = None

    def acquire(self) -> None:
        key = os.path.realpath(self.path)
        holder = _held.get(key)  # one lookup: another thread may release it in between
        if holder is not None and holder is not self:
            raise CheckpointError(f"{os.path.dirname(self.path)} is already being written by another "
                                  f"AtomicCheckpointer in this process (pid {os.getpid()}); expected one writer per "
                                  "directory. Fix: reuse that checkpointer, or close() it first.")
        with Confined(os.path.dirname(self.path)) as folder:
            fh = folder.open_lock(LOCK)
        deadline = time.monotonic() + self.patience
        try:
            while True:
                try:
                    fcntl.lockf(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.1)
        except OSError as e:
            fh.seek(0)
            holder = fh.read(200).strip() or "unknown holder"
            fh.close()
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise CheckpointError(
                    f"{os.path.dirname(self.path)} is locked by another job ({holder}); expected one job writing a "
                    "checkpoint directory at a time. Fix: give this job its own checkpoint.dir, or stop the other "
                    "job. (A lock whose holder died is released by the kernel and taken over automatically.)"
                ) from e
            raise
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        fh.flush()
        self._fh = fh
        _held[key] = self

    def ensure(self) -> None:
        """Take the lock unless this object holds it already."""
        if self._fh is None:
            self.acquire()

    def release(self) -> None:
        """Empty the lock file (under the lock: nobody else can be writing it), then unlock and close it."""
        if self._fh is not None:
            _held.pop(os.path.realpath(self.path), None)
            try:
                try:
                    self._fh.seek(0)
                    self._fh.truncate()
                    self._fh.flush()
                except OSError as e:  # the lock is still released; only the holder line may stay
                    log.warning("could not clear the lock file %s: %s", self.path, e)
                fcntl.lockf(self._fh, fcntl.LOCK_UN)
            finally:
                self._fh.close()
                self._fh = None
