"""Writing and deleting inside a directory robustdist does not trust: one rule for every file it writes.

The checkpoint directory (and the in-memory tier's) is input: copied between clusters, shared, possibly
written by someone hostile. :mod:`._safeio` confines what robustdist *reads* there; this module confines what it
*writes and deletes*, by one rule:

* the directory the user configured is opened once (its own path followed as the user gave it); every name
  below it is resolved from that descriptor one component at a time with ``O_NOFOLLOW | O_DIRECTORY``, so a
  link at any level below is refused, never followed;
* a file is created only under a name robustdist chose, with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (whatever is
  planted at that name, a file, a symbolic link or a hard link to a file elsewhere, makes the create fail: it
  is never written through), and is published by a rename inside the same directory (a rename replaces a link,
  it never follows one) or by a hard link when the name must not exist yet;
* deletes go through the same descriptor and only of names the caller's pattern says robustdist writes; a
  directory at such a name is not deleted but refused.

Every failure is a :class:`~robustdist.runtime.errors.CheckpointError` naming the path and the fix, never a raw
``OSError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import uuid
from types import TracebackType
from typing import BinaryIO, TextIO

from robustdist.checkpoint._safeio import kind_of
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError

__all__ = ["Confined", "fix_for", "os_error"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_NAMES = 100_000  # a directory listing bigger than this is not one robustdist made
_MAX_DEPTH = 8  # robustdist's own trees are at most 4 levels deep
_NAME = re.compile(r"[^/\x00]{1,255}")  # one path component (robustdist's names, or a framework's file name)


def fix_for(e: OSError) -> str:
    """The fix for an ``OSError`` of a write in a checkpoint directory, in words."""
    return {errno.EACCES: "make it writable by this user", errno.EPERM: "make it writable by this user",
            errno.EROFS: "use a directory on a writable filesystem", errno.ENOSPC: "free space on its filesystem",
            errno.EDQUOT: "free space (the disk quota is full)",
            errno.ENAMETOOLONG: "use a shorter checkpoint directory path",
            errno.ENOENT: "check that the directory exists and was not removed while the job runs"}.get(
                e.errno or 0, "check the directory's permissions, free space and filesystem")


def os_error(path: str, e: OSError, doing: str, *, rank: int | None = None) -> CheckpointError:
    """A :class:`CheckpointError` for an ``OSError`` while ``doing`` something at ``path``, with the fix."""
    return CheckpointError(f"{path}: could not {doing} ({type(e).__name__}: {e.strerror or e}). Fix: {fix_for(e)}.",
                           rank=rank)


def _plain(name: str) -> str:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"{name!r} is not one path component")  # a bug in robustdist, not input
    return name


class Confined:
    """An open directory; files below it are read, written and deleted by the rule in the module docstring.

    ``Confined(root)`` opens the configured directory (``create=True``: made, with its parents, when missing);
    :meth:`sub` walks (and creates) one level further without following links. Close it (it is a context
    manager) to release the descriptor.
    """

    def __init__(self, root: str, *, create: bool = False, what: str = "the directory",
                 _fd: int | None = None) -> None:
        self.path = root
        if _fd is not None:
            self._fd = _fd
            return
        if create:
            try:
                os.makedirs(root, exist_ok=True)
            except OSError as e:
                raise self._error(root, e, f"create {what}") from None
        try:
            self._fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's path, followed
        except OSError as e:
            raise self._error(root, e, f"open {what}") from None

    @classmethod
    def at(cls, path: str) -> Confined:
        """The directory ``path`` opened as :meth:`sub` of its parent: the parent as the user gave it, the last
        component never through a link (for a directory robustdist made inside the configured one)."""
        parent, name = os.path.split(path)
        with cls(parent or ".") as folder:
            return folder.sub(name)

    # --------------------------------------------------------------------------------------------- walking
    def sub(self, name: str, *, create: bool = False, fresh: bool = False, mode: int = 0o755) -> Confined:
        """The directory ``name`` inside this one (never through a link); ``create``: made when missing;
        ``fresh``: made now, and refused when anything is already at ``name``."""
        shown = self._shown(_plain(name))
        if fresh:
            try:
                os.mkdir(name, mode, dir_fd=self._fd)
            except OSError as e:
                raise self._error(shown, e, "create the directory") from None
        elif create:
            self.mkdir(name, mode)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self._fd)
        except OSError as e:
            if e.errno == errno.ENOTDIR and self.kind(name) == "a symbolic link":  # O_NOFOLLOW on a link
                e = OSError(errno.ELOOP, "symbolic link")
            raise self._error(shown, e, "open the directory", wanted="a directory") from None
        return Confined(shown, _fd=fd)

    def mkdir(self, name: str, mode: int = 0o755) -> bool:
        """Make the directory ``name`` here unless something is already at ``name`` (True when it was made).
        Whatever is there is left for :meth:`sub` or the caller's checks to judge."""
        try:
            os.mkdir(_plain(name), mode, dir_fd=self._fd)
        except FileExistsError:
            return False
        except OSError as e:
            raise self._error(self._shown(name), e, "create the directory") from None
        return True

    def lstat(self, name: str) -> os.stat_result | None:
        """The status of what is at ``name`` (a link's own, never its target's); None when nothing is."""
        try:
            return os.stat(_plain(name), dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error(self._shown(name), e, "inspect it") from None

    def stat(self) -> os.stat_result:
        """This directory's own status (of the directory opened, whatever its path names now)."""
        return os.fstat(self._fd)

    def names(self) -> list[str]:
        """The names in this directory (at most a bound's worth: more is not a directory robustdist made)."""
        try:
            found = os.listdir(self._fd)
        except OSError as e:
            raise self._error(self.path, e, "list the directory") from None
        return found[:_MAX_NAMES]

    def kind(self, name: str) -> str | None:
        """What is at ``name`` (:func:`._safeio.kind_of` words), not following a link; None when nothing is."""
        try:
            return kind_of(os.stat(_plain(name), dir_fd=self._fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error(self._shown(name), e, "inspect it") from None

    # --------------------------------------------------------------------------------------------- reading
    def read(self, name: str, *, max_size: int) -> bytes | None:
        """The content of the regular file ``name`` (not a link, FIFO or device), at most ``max_size`` bytes;
        None when there is nothing at ``name``. Anything else is a :class:`CheckpointCorruptError`."""
        shown = self._shown(_plain(name))
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self._fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK):
                raise CheckpointCorruptError(f"{shown}: is a symbolic link; refused (expected a regular file "
                                             "robustdist wrote)") from None
            raise CheckpointCorruptError(f"{shown}: unreadable ({e.strerror or e})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointCorruptError(f"{shown}: is {kind_of(st.st_mode)}; expected a regular file")
            if st.st_size > max_size:
                raise CheckpointCorruptError(f"{shown}: {st.st_size} bytes, more than the {max_size} allowed")
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(max_size + 1)
        if len(data) > max_size:
            raise CheckpointCorruptError(f"{shown}: grew past the {max_size} bytes allowed while being read")
        return data

    # --------------------------------------------------------------------------------------------- writing
    def write(self, name: str, data: bytes, *, durable: bool = True) -> None:
        """Make ``name`` hold ``data``: a new file under a random name, then renamed over ``name`` (whatever was
        there, a file or a link, is replaced, never written through). A directory at ``name`` is refused."""
        shown = self._shown(_plain(name))
        tmp = self._new(name, data, durable)
        try:
            os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as e:
            self._discard(tmp)
            raise self._error(shown, e, "replace it") from None
        if durable:
            self.sync()

    def create(self, name: str, data: bytes) -> bool:
        """Make ``name`` hold ``data`` only if nothing is at ``name`` (a hard link of a complete file, so no reader
        sees it half-written and two writers cannot both succeed). False when something already is."""
        shown = self._shown(_plain(name))
        tmp = self._new(name, data, True)
        try:
            os.link(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as e:
            raise self._error(shown, e, "create it") from None
        finally:
            self._discard(tmp)
        self.sync()
        return True

    def open_new(self, name: str, *, mode: int = 0o644) -> BinaryIO:
        """A new file ``name`` open for writing (``O_EXCL | O_NOFOLLOW``: a file or link planted there is refused,
        never written through). The caller closes it."""
        try:
            fd = os.open(_plain(name), _NEW_FLAGS, mode, dir_fd=self._fd)
        except OSError as e:
            raise self._error(self._shown(name), e, "create it") from None
        return os.fdopen(fd, "wb")

    def put(self, name: str, data: bytes | bytearray | memoryview, *, durable: bool = False,
            mode: int = 0o644) -> int:
        """Create the file ``name`` holding ``data``, where nothing may be yet (:meth:`open_new`). For a fresh
        directory (:meth:`sub`) no reader looks into before it is renamed into place, or a name unique to the
        writer. A failed write leaves nothing behind. Returns the bytes written."""
        fh = self.open_new(name, mode=mode)
        try:
            with fh:
                written = fh.write(data)
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
        except OSError as e:
            self._discard(name)  # created with O_EXCL just now: this name is this writer's own
            raise self._error(self._shown(name), e, "write it") from None
        return written

    def open_lock(self, name: str) -> TextIO:
        """Open, or create, the lock file ``name`` for reading and writing: never through a link, never a FIFO,
        device or directory, never a file with more than one name (a hard link to a file elsewhere would have
        the lock holder's line written into it). Nothing is written by opening it."""
        shown = self._shown(_plain(name))
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                         dir_fd=self._fd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR):  # not the file: the place
                raise os_error(shown, e, "open the lock file") from None
            raise CheckpointError(f"{shown}: cannot open the lock file ({e.strerror or e}); expected a regular file "
                                  "(a symbolic link is refused). Fix: remove it; robustdist recreates it.") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = f"not a regular file (mode {stat.filemode(st.st_mode)})" if not stat.S_ISREG(st.st_mode) \
                else f"a hard link ({st.st_nlink} names share it, possibly outside the directory)"
            raise CheckpointError(f"{shown}: the lock file is {what}; expected one robustdist created. Fix: remove "
                                  "it; robustdist recreates it.")
        return os.fdopen(fd, "r+", encoding="utf-8", errors="replace")

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, both in this directory (a link at either name is moved or replaced, never
        followed)."""
        try:
            os.rename(_plain(src), _plain(dst), src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as e:
            raise self._error(self._shown(src), e, f"rename it to {dst}") from None

    def adopt(self, fh: BinaryIO, name: str) -> None:
        """Give the open file ``fh`` the new name ``name`` here: a hard link to that very inode (through
        ``/proc/self/fd``, so not to whatever is at its old name now), or, where the filesystem cannot link, a
        copy into a file created with ``O_EXCL | O_NOFOLLOW``. Something already at ``name`` is refused."""
        shown = self._shown(_plain(name))
        try:
            proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(str(fh.fileno()), name, src_dir_fd=proc, dst_dir_fd=self._fd, follow_symlinks=True)
                return
            finally:
                os.close(proc)
        except FileExistsError as e:
            raise self._error(shown, e, "create it") from None
        except OSError:  # no /proc, or another filesystem: copy from the descriptor
            pass
        try:
            fd = os.open(name, _NEW_FLAGS, 0o644, dir_fd=self._fd)
        except OSError as e:
            raise self._error(shown, e, "create it") from None
        with os.fdopen(fd, "wb") as out:
            fh.seek(0)
            shutil.copyfileobj(fh, out, 1 << 20)

    def remove(self, name: str, pattern: re.Pattern[str]) -> bool:
        """Delete ``name`` when it matches ``pattern`` (the names robustdist writes here) and is a file or a link
        (the link itself; what it points at is untouched). A directory there is refused. False when nothing was
        there."""
        shown = self._shown(_plain(name))
        if not pattern.fullmatch(name):
            raise ValueError(f"{shown} is not a name robustdist writes here ({pattern.pattern})")
        try:
            os.unlink(name, dir_fd=self._fd)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise self._error(shown, e, "remove it") from None
        return True

    def remove_tree(self, name: str, pattern: re.Pattern[str]) -> bool:
        """Delete ``name`` (it must match ``pattern``) and, when it is a directory, everything below it: each level
        is opened from its parent's descriptor with ``O_NOFOLLOW``, a link anywhere is deleted as a link (what it
        points at is untouched), and nothing is ever reached by a path. False when nothing was there; a tree
        deeper than robustdist makes, or a failure, is a :class:`CheckpointError`."""
        shown = self._shown(_plain(name))
        if not pattern.fullmatch(name):
            raise ValueError(f"{shown} is not a name robustdist writes here ({pattern.pattern})")
        if self.kind(name) is None:
            return False
        self._remove_below(self._fd, name, shown, _MAX_DEPTH)
        return True

    def _remove_below(self, parent: int, name: str, shown: str, depth: int) -> None:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=parent)
                return
            if depth <= 0:
                raise CheckpointCorruptError(f"{shown}: deeper than the {_MAX_DEPTH} levels robustdist makes; not "
                                             f"deleted. Fix: remove it by hand.")
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            try:
                for i, entry in enumerate(os.listdir(fd)):
                    if i >= _MAX_NAMES:
                        raise CheckpointCorruptError(f"{shown}: more than {_MAX_NAMES} names; not a directory "
                                                     "robustdist made. Fix: remove it by hand.")
                    self._remove_below(fd, entry, os.path.join(shown, entry), depth - 1)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=parent)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._error(shown, e, "remove it") from None

    def sync(self, *, strict: bool = False) -> None:
        """Make the renames and creations in this directory durable. ``strict``: a failure is an error (else
        ignored: some filesystems, FUSE mounts, refuse fsync on a directory)."""
        try:
            os.fsync(self._fd)
        except OSError as e:
            if strict:
                raise self._error(self.path, e, "sync the directory") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Confined:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- helpers
    def _shown(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _new(self, name: str, data: bytes, durable: bool) -> str:
        tmp = f"{name}.tmp-{uuid.uuid4().hex[:12]}"[-250:]
        try:
            fd = os.open(tmp, _NEW_FLAGS, 0o644, dir_fd=self._fd)
        except OSError as e:
            raise self._error(self._shown(name), e, "write it") from None
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
        except OSError as e:
            self._discard(tmp)
            raise self._error(self._shown(name), e, "write it") from None
        return tmp

    def _discard(self, tmp: str) -> None:  # a name this writer created itself
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=self._fd)

    def _error(self, shown: str, e: OSError, doing: str, *, wanted: str | None = None) -> CheckpointError:
        error = self._named(shown, e, doing, wanted)
        error.os_error = e  # type: ignore[attr-defined]  # the cause, for callers that tell "unwritable" apart
        return error

    def _named(self, shown: str, e: OSError, doing: str, wanted: str | None) -> CheckpointError:
        if e.errno in (errno.ELOOP, errno.EMLINK) or (wanted and e.errno == errno.ENOTDIR):
            found = "a symbolic link" if e.errno in (errno.ELOOP, errno.EMLINK) else "not a directory"
            return CheckpointCorruptError(
                f"{shown}: is {found}; expected {wanted or 'a file'} robustdist made there, never a link that may "
                f"point outside the directory. Fix: remove {shown}; robustdist recreates it.")
        if e.errno == errno.EEXIST:
            return CheckpointError(f"{shown}: already exists; expected a name robustdist creates fresh. Fix: remove "
                                   f"{shown}.")
        if e.errno in (errno.EISDIR, errno.ENOTEMPTY):
            return CheckpointCorruptError(
                f"{shown}: is a directory; expected a file robustdist writes there. Fix: remove the directory "
                f"{shown}; robustdist recreates the file.")
        return os_error(shown, e, doing)
