"""Opening files of an untrusted checkpoint directory: confined, regular files only, bounded.

A checkpoint directory is input (copied between clusters, pulled from buckets, written by other jobs).
Every read of a file inside a step directory goes through :func:`open_in`, which

* takes a *relative* name of plain components (no ``..``, no absolute path, no empty or ``.`` part),
* walks from the step directory one component at a time with ``O_NOFOLLOW`` (a symbolic link anywhere
  below the step directory, the step directory itself included, is refused, so nothing outside it is
  opened),
* opens with ``O_NONBLOCK`` and refuses whatever ``fstat`` says is not a regular file (a FIFO, a device such
  as ``/dev/zero``, a socket, a directory), so an open or a read never blocks,
* checks the size before reading (:func:`open_in` with ``size=`` or ``max_size=``).

Every refusal is a :class:`~robustdist.runtime.errors.CheckpointCorruptError` naming the file and the problem.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import struct
import zipfile
from typing import Any, BinaryIO

from robustdist.checkpoint._pickle_scan import scan
from robustdist.checkpoint._schema import MAX_PICKLE_TREE
from robustdist.runtime.errors import CheckpointCorruptError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def kind_of(mode: int) -> str:
    """What a ``st_mode`` is, in words."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_name(name: object) -> list[str]:
    """The components of a relative file name from a manifest or DCP metadata, or CheckpointCorruptError."""
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 1024:
        raise CheckpointCorruptError(f"file name {name!r:.100} is not a plain relative name")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CheckpointCorruptError(f"file name {name!r:.100} leaves the step directory (absolute, '..' or empty "
                                     "parts); expected a name inside it")
    return parts


def _open_dir(path: str, dir_fd: int | None, shown: str) -> int:
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENOTDIR:  # O_DIRECTORY | O_NOFOLLOW on a link: say it is a link
            try:
                if stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode):
                    e = OSError(errno.ELOOP, "symbolic link")
            except OSError:
                pass
        raise _refusal(shown, e, "a directory") from None


def _refusal(shown: str, e: OSError, wanted: str) -> CheckpointCorruptError:
    if e.errno == errno.ENOENT:
        return CheckpointCorruptError(f"{shown}: missing")
    if e.errno in (errno.ELOOP, errno.EMLINK):
        return CheckpointCorruptError(f"{shown}: is a symbolic link; refused (expected {wanted} inside the "
                                      "checkpoint, never a link that may point outside it)")
    if e.errno == errno.ENOTDIR:
        return CheckpointCorruptError(f"{shown}: is not {wanted}")
    return CheckpointCorruptError(f"{shown}: unreadable ({e.strerror or e})")


def open_in(step_dir: str, name: str, *, size: int | None = None, max_size: int | None = None) -> BinaryIO:
    """Open ``<step_dir>/<name>`` for reading, confined and bounded (see the module docstring).

    ``size``: the exact size the manifest records; ``max_size``: an upper bound where no size is recorded.
    The caller closes the returned file.
    """
    parts = check_name(name)
    shown = os.path.join(step_dir, name)
    fd = _open_dir(step_dir, None, step_dir)
    try:
        for i, part in enumerate(parts[:-1]):
            inner = _open_dir(part, fd, os.path.join(step_dir, *parts[: i + 1]))
            os.close(fd)
            fd = inner
        try:
            file_fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
        except OSError as e:
            raise _refusal(shown, e, "a regular file") from None
    finally:
        os.close(fd)
    try:
        st = os.fstat(file_fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{shown}: is {kind_of(st.st_mode)}; expected a regular file")
        if size is not None and st.st_size != size:
            raise CheckpointCorruptError(f"{shown}: {st.st_size} bytes, expected {size} (truncated or extended)")
        if max_size is not None and st.st_size > max_size:
            raise CheckpointCorruptError(f"{shown}: {st.st_size} bytes, more than the {max_size} allowed")
        return os.fdopen(file_fd, "rb")
    except BaseException:
        os.close(file_fd)
        raise


def read_in(step_dir: str, name: str, *, max_size: int) -> bytes:
    """The whole content of a small file (a manifest, DCP metadata), read with :func:`open_in`."""
    with open_in(step_dir, name, max_size=max_size) as fh:
        # read(n) takes n bytes of memory up front: ask for what the file holds (one more, to see it grow)
        data = fh.read(min(os.fstat(fh.fileno()).st_size, max_size) + 1)
    if len(data) > max_size:
        raise CheckpointCorruptError(f"{os.path.join(step_dir, name)}: grew past the {max_size} bytes allowed "
                                     "while being read")
    return data


def lexists_dir(path: str) -> bool:
    """True when ``path`` is a real directory (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


class _Window(io.RawIOBase):
    """A read-only view of ``length`` bytes of ``base`` at ``offset`` (correct for every ``seek`` whence)."""

    def __init__(self, base: BinaryIO, offset: int, length: int):
        super().__init__()
        self.base, self.offset, self.length, self.pos = base, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = min(max(base + offset, 0), self.length)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(self.length - self.pos, 0)]
        self.base.seek(self.offset + self.pos)
        n = self.base.readinto(view) or 0
        self.pos += n
        return n


def check_torch_zip(fh: BinaryIO, where: str, *, offset: int = 0, length: int | None = None,
                    values: int = MAX_PICKLE_TREE, payload: bool = False) -> None:
    """A torch file (or a slice of one) must be a zip that starts at its first byte (torch.load reads anything else
    as a legacy pickle, which this check would not have scanned) and whose members are all stored uncompressed and
    add up to no more than its own size: torch.save never compresses, and a compressed member is a decompression
    bomb (1 KiB inflating to 1 MiB, a 64 MiB file to 64 GiB). Its pickle is scanned (:mod:`._pickle_scan`) with
    ``values`` as the bound on the tree any value stands for (a robustdist payload: the values its schema allows);
    ``payload``: a robustdist payload, which never calls what :data:`._pickle_scan.PAYLOAD_REFUSED` names."""
    if length is None:
        length = os.fstat(fh.fileno()).st_size - offset
    fh.seek(offset)
    head = fh.read(4)
    fh.seek(offset)
    if head != b"PK\x03\x04":  # torch.load reads a file not starting so as a legacy pickle: not what is checked here
        raise CheckpointCorruptError(f"{where}: not a torch zip file (it does not start with a zip header: found "
                                     f"{head!r}; torch.load would read whatever precedes a zip as a legacy pickle)")
    _check_directory(fh, offset, length, where)
    try:
        with zipfile.ZipFile(io.BufferedReader(_Window(fh, offset, length))) as archive:
            members = archive.infolist()
            _check_members(members, length, where)
            _check_layout(members, archive.start_dir, where)
            record = _the_pickle(members, where)
            data = _stored_bytes(fh, offset, record, where)
            empty = _empty_records(members, record)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError) as e:
        raise CheckpointCorruptError(f"{where}: not a torch zip file ({str(e)[:200]})") from None
    finally:
        fh.seek(offset)
    scan(data, where, values, payload=payload, empty_keys=empty)


_EOCD = struct.Struct("<4sHHHHIIH")  # the end-of-central-directory record
_Z64_LOCATOR = struct.Struct("<4sIQI")
_Z64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_MAX_CD_ENTRY = 46 + 1024 + 64  # a central directory entry: fixed part, a name, a zip64 extra
_MAX_LOCAL_OVERHEAD = 30 + 256 + (64 << 10)
"""A local header's fixed part, its extras (zip64, torch's alignment padding: torch.utils.serialization's
``storage_alignment`` may be set up to 64 KiB) and a data descriptor."""


def _check_directory(fh: BinaryIO, offset: int, length: int, where: str) -> None:
    """Read the zip's end records from its last bytes and check its central directory *before* ``zipfile`` reads
    it (``zipfile`` reads as many bytes as the end record declares: a sparse file claiming a central directory of
    gigabytes would cost gigabytes): the directory must end where torch puts it (right before the zip64 end
    record, or the end record), and be no bigger than its entries can be."""
    tail_len = min(length, _EOCD.size + 0xFFFF + _Z64_LOCATOR.size + _Z64_EOCD.size)
    fh.seek(offset + length - tail_len)
    tail = fh.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        raise CheckpointCorruptError(f"{where}: not a torch zip file (no end-of-central-directory record)")
    _, _, _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    eocd = length - (len(tail) - at)
    end_of_cd = eocd
    if at >= _Z64_LOCATOR.size and tail[at - _Z64_LOCATOR.size:at - _Z64_LOCATOR.size + 4] == b"PK\x06\x07":
        _, _, z64_at, _ = _Z64_LOCATOR.unpack_from(tail, at - _Z64_LOCATOR.size)
        rel = z64_at - (length - len(tail))
        if not 0 <= rel <= len(tail) - _Z64_EOCD.size or tail[rel:rel + 4] != b"PK\x06\x06":
            raise CheckpointCorruptError(f"{where}: not a torch zip file (its zip64 end record is not where its "
                                         "locator says)")
        _, _, _, _, _, _, _, entries, cd_size, cd_offset = _Z64_EOCD.unpack_from(tail, rel)
        end_of_cd = z64_at
    if comment or cd_offset + cd_size != end_of_cd or cd_size > entries * _MAX_CD_ENTRY \
            or entries > length // 30:
        raise CheckpointCorruptError(
            f"{where}: not a torch zip file (its central directory of {cd_size} bytes for {entries} entries at byte "
            f"{cd_offset} does not end at its end record, byte {end_of_cd}, or is larger than its entries can be)")


def _check_layout(members: list[zipfile.ZipInfo], start_dir: int, where: str) -> None:
    """torch writes its members back to back, then the central directory: a gap (a hole of a sparse file, bytes
    no member accounts for) is not a file torch wrote."""
    end = 0
    for m in sorted(members, key=lambda m: m.header_offset):
        if m.header_offset > end:
            raise CheckpointCorruptError(f"{where}: not a torch zip file ({m.header_offset - end} bytes before "
                                         f"{m.filename!r:.80} belong to no member)")
        end = max(end, m.header_offset + _MAX_LOCAL_OVERHEAD + len(m.filename.encode()) + m.compress_size)
    if start_dir > end:
        raise CheckpointCorruptError(f"{where}: not a torch zip file ({start_dir - end} bytes before its central "
                                     "directory belong to no member)")


def _the_pickle(members: list[zipfile.ZipInfo], where: str) -> zipfile.ZipInfo:
    """The record ``torch.load`` unpickles: ``data.pkl`` under the archive name (the first member's first path
    part), which torch looks up *without regard to case*. Two names equal but for case are refused (the scan
    would check one and torch might read the other: ``archive/DATA.PKL`` beside a harmless ``archive/x/data.pkl``
    was a way past the scan), as is any other count of candidates than one."""
    lowered: dict[str, str] = {}
    for m in members:
        other = lowered.setdefault(m.filename.lower(), m.filename)
        if other != m.filename:
            raise CheckpointCorruptError(f"{where}: holds {other!r:.80} and {m.filename!r:.80}, names equal but for "
                                         "case (torch reads records without regard to case); torch.save never writes "
                                         "such a pair")
    prefix = members[0].filename.split("/", 1)[0].lower() if members else ""
    pickles = [m for m in members if m.filename.lower() in (f"{prefix}/data.pkl", "data.pkl")]
    stray = [m.filename for m in members if m.filename.lower().endswith("data.pkl") and m not in pickles]
    if len(pickles) != 1 or stray:
        raise CheckpointCorruptError(f"{where}: holds {len(pickles)} data.pkl records under its archive name "
                                     f"{prefix!r:.80} and {len(stray)} elsewhere; expected exactly one")
    return pickles[0]


def _empty_records(members: list[zipfile.ZipInfo], record: zipfile.ZipInfo) -> frozenset[str]:
    """The storage keys whose record (``<archive>/data/<key>``, beside the pickle) is empty: torch caches a storage
    it made only when it holds data, so each use of such a key makes a new one (the scan charges each)."""
    folder = (record.filename[: -len("data.pkl")] + "data/").lower()  # torch finds records without regard to case
    return frozenset(m.filename[len(folder):] for m in members
                     if m.file_size == 0 and m.filename.lower().startswith(folder))


def _stored_bytes(fh: BinaryIO, offset: int, m: zipfile.ZipInfo, where: str) -> bytes:
    """A stored member's bytes, read from after its local header, without checking its CRC-32 (torch may be told
    not to compute one: ``torch.utils.serialization.config.save.compute_crc32 = False``; the manifest's checksum
    covers the file)."""
    fh.seek(offset + m.header_offset)
    head = fh.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise CheckpointCorruptError(f"{where}: not a torch zip file (no local header for {m.filename!r:.80})")
    name_len, extra_len = struct.unpack_from("<HH", head, 26)
    fh.seek(offset + m.header_offset + 30 + name_len + extra_len)
    data = fh.read(m.file_size)
    if len(data) != m.file_size:
        raise CheckpointCorruptError(f"{where}: not a torch zip file ({m.filename!r:.80} is cut short)")
    return data


def _check_members(members: list[zipfile.ZipInfo], length: int, where: str) -> None:
    compressed = [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise CheckpointCorruptError(f"{where}: holds compressed members ({compressed[0]!r:.80}); torch.save never "
                                     "compresses, so this is refused (a compressed member can inflate without bound)")
    declared = sum(m.file_size for m in members)
    if declared > length:
        raise CheckpointCorruptError(f"{where}: its members declare {declared} bytes in a {length}-byte file")
