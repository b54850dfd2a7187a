"""The in-memory tier's files on one node (see :mod:`robustdist.checkpoint.local.tier`).

Layout, under the node's ``local_dir`` (``/dev/shm/...`` by default)::

    owner_<r:05d>/own/step_<step:010d>/       rank r's own copy, written by rank r
    owner_<r:05d>/replica/step_<step:010d>/   a copy of rank r's state that a rank on this node holds for it

Each step directory holds ``payload.pt`` (the owner's RNG, per-rank entries and local shards), for owner 0
``replicated.pt`` too (the replicated entries, as in the durable tier), and ``meta.json``: the format, step,
owner, world size, lineage (which durable directory, and which configuration, the copy belongs to), entry kinds,
and each file's size and checksum (:mod:`.sums`). A copy is written into ``.tmp-step_<step>-<token>`` and renamed into place
after its meta, so it is never half-visible: a crash mid-write leaves the previous step's copy as it was.

Each data file is bound to its copy (:func:`bind`): what it serialises is ``{"copy": {"file", "step", "owner",
"lineage", "save"}, "value": ...}``, inside the bytes its checksum covers, and a restore takes the value only where
the binding is the copy it asked for (:func:`unbind`). A copy whose ``meta.json`` was edited to another step, or a
step directory copied over another, or another rank's or run's file, is then a corrupt copy, not a restore of the
wrong state.

The directory is input like a durable one (a stale tmpfs, another job, a hostile user on a shared node):
every name is matched by pattern, directories are real directories (never links), ``meta.json`` is read
bounded and validated, and data files are read through :func:`.._safeio.open_in` (confined, regular files,
exact size, not sparse) and checked against their checksum before use (:func:`read_verified`, or as they are copied
into place: :mod:`.mapped`). A copy that fails any of that is not a source.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from robustdist.checkpoint import _faults
from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._layout import step_dirname
from robustdist.checkpoint._safeio import check_torch_zip, lexists_dir, open_in, read_in
from robustdist.checkpoint._schema import KINDS, MAX_STEP, is_int
from robustdist.checkpoint.local import memory, sums
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError
from robustdist.runtime.log import get_logger
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["PAYLOAD", "REPLICATED", "Holding", "bind", "unbind", "check_root", "commit_copy", "make_root", "open_root",
           "check_dense", "check_room", "expected_sum", "read_verified", "remove_copy", "remove_root", "remove_stale", "rotate", "rotate_all", "scan", "siblings", "step_path",
           "tier_root"]

FORMAT = 3
META = "meta.json"
PAYLOAD = "payload.pt"
REPLICATED = "replicated.pt"
ROLES = ("own", "replica")
MAX_META_BYTES = 1 << 20
MAX_OWNERS = 1 << 16
MAX_STEPS_PER_OWNER = 64
_OWNER_RE = re.compile(r"owner_(\d{5})")
_STEP_RE = re.compile(r"step_(\d{10,19})")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SAVE = re.compile(r"[0-9a-f]{12,32}")
_OLD_RE = re.compile(r"\.old-step_(\d{10,19})-[0-9a-f]{12}")
_LEFTOVER_RE = re.compile(r"\.(?:tmp|old)-[A-Za-z0-9_.-]{1,190}")
PREFIX = "robustdist-"
log = get_logger(__name__)


@dataclass(frozen=True)
class Holding:
    """One copy of one owner's state for one step, found on this node."""

    owner: int
    role: str
    step: int
    path: str
    world_size: int
    lineage: str
    save: str
    """The id every rank of one save shares (rank 0's token): copies of one step from different saves (a
    failed save repeated after a restart) are never combined."""
    files: dict[str, dict[str, Any]]
    kinds: dict[str, str]
    root: str = ""
    """The tier's directory: every read walks from it one component at a time, never through a link (an owner
    or role directory swapped for a link after the scan is refused, not followed)."""

    @property
    def relative(self) -> str:
        """``path`` below ``root``."""
        return os.path.relpath(self.path, self.root)

    def describe(self) -> str:
        return f"{'its own copy' if self.role == 'own' else 'the replica'} of rank {self.owner}'s step {self.step}"


def step_path(root: str, owner: int, role: str, step: int) -> str:
    return os.path.join(root, f"owner_{owner:05d}", role, step_dirname(step))


def tier_root(base: str, lineage: str) -> str:
    """The tier's own directory under ``base``: ``<base>/robustdist-<uid>-<hash of the lineage>``. Only this
    directory is ever written, rotated or removed, so jobs that share ``base`` never touch each other's copies."""
    digest = hashlib.sha256(lineage.encode()).hexdigest()[:16]
    return os.path.join(base, f"{PREFIX}{os.getuid()}-{digest}")


def siblings(root: str) -> list[tuple[str, int]]:
    """Other tiers of this user beside ``root`` (stale ones hold RAM on a tmpfs), with their sizes."""
    from robustdist.checkpoint.local.memory import held_bytes

    base, own = os.path.split(root)
    mine = f"{PREFIX}{os.getuid()}-"
    out = []
    for name in _listdir(base)[:1000]:
        path = os.path.join(base, name)
        if name.startswith(mine) and name != own and lexists_dir(path):
            out.append((path, held_bytes(path, limit=10_000)))
    return out


def check_root(root: str, st: os.stat_result | None = None) -> None:
    """The tier's directory must be a real directory owned by this user and closed to others: ``/dev/shm`` is
    shared by every user of the node, and a directory someone else made (or a link planted at its name) would
    let them read or replace the copies. ``st``: the status of the directory already opened (else its path's)."""
    st = st if st is not None else os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory" if not stat.S_ISDIR(
            st.st_mode) else f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else \
            f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
        raise CheckpointError(f"the in-memory checkpoint directory {root} is {what}; expected a directory of this "
                              f"user's (uid {os.getuid()}) that no one else can write. Fix: remove it, or set "
                              "checkpoint.local_dir to a directory of your own.")


def make_root(root: str) -> None:
    """Create the tier's directory (and the base above it, as the user named it) and check it."""
    base, name = os.path.split(root)
    with Confined(base, create=True) as folder:
        folder.mkdir(name, 0o700)
    check_root(root)


def open_root(root: str) -> Confined:
    """The tier's directory, opened from its base without following a link, and checked as :func:`check_root`
    does (on the directory opened, not on whatever its path names a moment later)."""
    base, name = os.path.split(root)
    with Confined(base) as folder:
        own = folder.sub(name)
    try:
        check_root(root, own.stat())
    except BaseException:
        own.close()
        raise
    return own


def remove_root(root: str) -> None:
    """Delete the tier's directory and everything in it (never through a link)."""
    base, name = os.path.split(root)
    with Confined(base) as folder:
        folder.remove_tree(name, re.compile(re.escape(name)))


def _role(root: str, owner: int, role: str, *, create: bool) -> Confined | None:
    """This owner's role directory, opened confined (``create``: made when missing); None when it is missing."""
    with open_root(root) as tier:
        owner_name = f"owner_{owner:05d}"
        if not create and tier.kind(owner_name) is None:
            return None
        with tier.sub(owner_name, create=create, mode=0o700) as folder:
            if not create and folder.kind(role) is None:
                return None
            return folder.sub(role, create=create, mode=0o700)


def _remove_matching(root: str, owner: int, role: str, pattern: re.Pattern[str],
                     wanted: Callable[[re.Match[str]], bool]) -> None:
    """Delete the entries of this owner's role directory that match ``pattern`` and that ``wanted`` picks."""
    with contextlib.suppress(CheckpointError):
        folder = _role(root, owner, role, create=False)
        if folder is None:
            return
        with folder:
            for name in folder.names():
                m = pattern.fullmatch(name)
                if m and wanted(m):
                    _remove(folder, name, pattern)


def remove_copy(root: str, owner: int, role: str, step: int) -> None:
    """Delete this owner's copy (of ``role``) of ``step``, under its name or set aside: one whose bytes were found
    changed, so that no later load copies part of it into live objects again."""
    _remove_matching(root, owner, role, _STEP_RE, lambda m: int(m.group(1)) == step)
    _remove_matching(root, owner, role, _OLD_RE, lambda m: int(m.group(1)) == step)


def remove_stale(root: str, owner: int, role: str) -> None:
    """Put back a copy a re-save set aside when a crash came before the staging copy took its name (it is then the
    step's only copy, which :func:`scan` offers as a source), then remove the staging and set-aside directories an
    interrupted write of this owner's copies left. Only a real directory under a step's own spelling, the only one
    set aside for its step, is put back; one that cannot be renamed stays where it is (still a source)."""
    kept: set[str] = set()
    with contextlib.suppress(CheckpointError):
        folder = _role(root, owner, role, create=False)
        if folder is None:
            return
        with folder:
            aside: dict[str, list[str]] = {}
            for name in folder.names():
                m = _OLD_RE.fullmatch(name)
                if m and m.group(1) == f"{int(m.group(1)):010d}":
                    aside.setdefault(f"step_{m.group(1)}", []).append(name)
            for final, names in aside.items():
                if len(names) > 1 or folder.kind(names[0]) != "a directory" or folder.kind(final) is not None:
                    continue
                where = os.path.join(folder.path, names[0])
                try:
                    folder.rename(names[0], final)
                except CheckpointError as e:
                    kept.add(names[0])
                    log.warning("in-memory tier: could not put back %s (%s); it stays a source", where, e)
                else:
                    log.warning("in-memory tier: put back %s, set aside by a re-save that a crash interrupted", where)
    _remove_matching(root, owner, role, _LEFTOVER_RE, lambda m: m.group(0) not in kept)


def _remove(folder: Confined, name: str, pattern: re.Pattern[str]) -> None:
    try:
        folder.remove_tree(name, pattern)
    except CheckpointError as e:
        log.warning("in-memory tier: could not remove %s: %s", os.path.join(folder.path, name), e)


def bind(value: Any, name: str, *, step: int, owner: int, lineage: str, save: str) -> dict[str, Any]:
    """``value`` as data file ``name`` of owner ``owner``'s copy of step ``step`` (save ``save``) of the tier of
    ``lineage`` serialises it."""
    return {"copy": {"file": name, "step": step, "owner": owner, "lineage": lineage, "save": save}, "value": value}


def unbind(found: Any, name: str, *, step: int, owner: int, lineage: str, save: str, where: str) -> Any:
    """The value :func:`bind` wrapped, where ``found`` is bound to exactly this file of this copy; else
    CheckpointCorruptError naming what it is bound to."""
    want = {"file": name, "step": step, "owner": owner, "lineage": lineage, "save": save}
    copy = found.get("copy") if isinstance(found, dict) and set(found) == {"copy", "value"} else None
    if copy != want:
        shown = ({k: str(v)[:80] for k, v in copy.items()} if isinstance(copy, dict) and len(copy) <= 8 else
                 "nothing (not a bound file)")
        raise CheckpointCorruptError(f"{where}: its data is bound to {shown}; expected {name} of rank {owner}'s step "
                                     f"{step} (save {save}) of this run's tier. The copy was moved, renamed or "
                                     "edited (a stale copy of another step, rank or run): not a source.")
    return found["value"]


def commit_copy(root: str, owner: int, role: str, step: int, token: str, files: dict[str, Any],
                meta: dict[str, Any], checksums: dict[str, int] | None = None) -> int:
    """Write ``files`` (name -> bytes-like) and ``meta.json`` into a staging directory, then rename it into place
    (an existing copy of the same step is set aside first and deleted after). ``checksums``: the files' checksums
    (:mod:`.sums`) where the caller already has them (computed over these bytes, or checked against them on
    arrival); the others are computed here. Returns the bytes written. Every
    file is created fresh in a directory made fresh, all of it reached from the tier's directory without
    following a link (:class:`.._confined.Confined`).

    No fsync: the tier is in memory (tmpfs); it protects against process and node loss, not power loss."""
    final = step_dirname(step)
    staging = f".tmp-{final}-{token}"
    folder = _role(root, owner, role, create=True)
    assert folder is not None
    with folder:
        written = 0
        try:
            with folder.sub(staging, fresh=True, mode=0o700) as copy:
                entries = {}
                for name, data in files.items():
                    view = memoryview(data).cast("B")
                    written += copy.put(name, view)
                    got = checksums[name] if checksums is not None and name in checksums else sums.of(view)
                    entries[name] = {"size": len(view), "sum": f"{got:016x}"}
                _faults.phase("local_writing")
                copy.put(META, json.dumps({**meta, "format": FORMAT, "owner": owner, "step": step,
                                           "files": entries}).encode())
            old = None
            if folder.kind(final) is not None:
                old = f".old-{final}-{token}"
                folder.rename(final, old)
            folder.rename(staging, final)
            if old is not None:
                _remove(folder, old, _LEFTOVER_RE)
        except BaseException:
            with contextlib.suppress(CheckpointError):
                folder.remove_tree(staging, _LEFTOVER_RE)
            raise
    return written


def rotate(root: str, owner: int, role: str, keep: set[int]) -> None:
    """Delete this owner's copies (of ``role``) of every step not in ``keep``."""
    _remove_matching(root, owner, role, _STEP_RE, lambda m: int(m.group(1)) not in keep)


def rotate_all(root: str, keep: set[int]) -> None:
    """Delete every copy under ``root`` (every owner, both roles) of a step not in ``keep``: after a complete
    save, copies of other steps are older, or stale ones of an earlier rank-to-node mapping."""
    for owner_name in _listdir(root)[:MAX_OWNERS]:
        m = _OWNER_RE.fullmatch(owner_name)
        if m and lexists_dir(os.path.join(root, owner_name)):
            for role in ROLES:
                rotate(root, int(m.group(1)), role, keep)


def _check_meta(path: str, meta: Any, owner: int, step: int) -> dict[str, Any]:
    def bad(problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{os.path.join(path, META)}: {problem}")

    if isinstance(meta, dict) and type(meta.get("format")) is int and 0 < meta["format"] < FORMAT:
        raise bad(f"a copy in format {meta['format']} (an older robustdist's), not {FORMAT}: ignored")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f"expected a dict with format {FORMAT}")
    if meta.get("owner") != owner or meta.get("step") != step:
        raise bad(f"names owner {meta.get('owner')!r:.20} step {meta.get('step')!r:.30}; its directory says owner "
                  f"{owner} step {step}")
    if not is_int(meta.get("world_size"), 1, MAX_OWNERS) or owner >= meta["world_size"]:
        raise bad(f"world_size {meta.get('world_size')!r:.20} is not an int above the owner {owner}")
    if not isinstance(meta.get("lineage"), str) or len(meta["lineage"]) > 200:
        raise bad("lineage is not a short string")
    if not isinstance(meta.get("save"), str) or not _SAVE.fullmatch(meta["save"]):
        raise bad("save is not a save id")
    kinds = meta.get("kinds")
    if not isinstance(kinds, dict) or len(kinds) > 4096 or not all(
            isinstance(k, str) and 0 < len(k) <= 256 and v in KINDS for k, v in kinds.items()):
        raise bad("kinds is not a map of entry names to entry kinds")
    files = meta.get("files")
    allowed = {PAYLOAD, REPLICATED} if owner == 0 else {PAYLOAD}
    if not isinstance(files, dict) or PAYLOAD not in files or not set(files) <= allowed:
        raise bad(f"files is not a map holding {PAYLOAD} (and, for rank 0, {REPLICATED}) only")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and set(entry) == {"size", "sum"} and is_int(entry["size"], 0, 1 << 50)
                and isinstance(entry["sum"], str) and _HEX16.fullmatch(entry["sum"])):
            raise bad(f"the entry of {name} is not {{'size': int, 'sum': 16 hex digits}}")
    return meta


def _listdir(path: str) -> list[str]:
    if not lexists_dir(path):
        return []
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def scan(root: str) -> tuple[list[Holding], list[str]]:
    """Every valid copy under ``root`` on this node, and a line per copy that was skipped as invalid."""
    found: list[Holding] = []
    skipped: list[str] = []
    for owner_name in _listdir(root)[:MAX_OWNERS]:
        m = _OWNER_RE.fullmatch(owner_name)
        if not m:
            continue
        owner = int(m.group(1))
        if not lexists_dir(os.path.join(root, owner_name)):
            skipped.append(f"{os.path.join(root, owner_name)}: not a real directory (a symbolic link?); refused")
            continue
        for role in ROLES:
            base = os.path.join(root, owner_name, role)
            if os.path.lexists(base) and not lexists_dir(base):
                skipped.append(f"{base}: not a real directory (a symbolic link?); refused")
                continue
            listing = _listdir(base)
            finals = {n for n in listing if _STEP_RE.fullmatch(n)}
            # a re-save of a step moves the previous copy aside for the instant between its two renames
            names = sorted(finals | {n for n in listing if (m := _OLD_RE.fullmatch(n)) and
                                     f"step_{m.group(1)}" not in finals})
            for name in names[-MAX_STEPS_PER_OWNER:]:
                step = int(name.split("step_")[1].split("-")[0])
                path = os.path.join(base, name)
                if step > MAX_STEP:
                    continue
                if not lexists_dir(path):
                    skipped.append(f"{path}: not a real directory (a symbolic link?); refused")
                    continue
                try:
                    raw = read_in(root, f"{owner_name}/{role}/{name}/{META}", max_size=MAX_META_BYTES)
                    meta = _check_meta(path, json_value(raw, MAX_META_BYTES), owner, step)
                except (CheckpointCorruptError, Unreadable) as e:
                    skipped.append(f"{path}: {str(e)[:300]}")
                    continue
                found.append(Holding(owner=owner, role=role, step=step, path=path, world_size=meta["world_size"],
                                     lineage=meta["lineage"], save=meta["save"], files=meta["files"],
                                     kinds=meta["kinds"], root=root))
    return found, skipped


_CHUNK = sums.BLOCK


def expected_sum(holding: Holding, name: str) -> int:
    """The checksum ``meta.json`` records for file ``name`` of the copy."""
    return int(holding.files[name]["sum"], 16)


def check_room(holding: Holding, name: str) -> None:
    """Refuse, without reading it, a file larger than the RAM available."""
    size = holding.files[name]["size"]
    available = memory.free(holding.path)[1]
    if available is not None and size > available:
        raise CheckpointCorruptError(f"{os.path.join(holding.path, name)}: {memory.size(size)}, more than the RAM "
                                     f"available ({memory.size(available)}); refused without reading it")


def check_dense(fh: Any, size: int, where: str) -> None:
    """Refuse a file with a hole (a sparse file claiming more bytes than it holds): the tier writes every byte, and
    a hole would cost the memory its claimed size asks for, not its own."""
    fd = fh.fileno()
    at = os.lseek(fd, 0, os.SEEK_CUR)  # put back below: ``fh``'s buffer stands for this offset
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
    except (OSError, AttributeError):  # no hole detection on this file system: nothing to refuse
        return
    finally:
        os.lseek(fd, at, os.SEEK_SET)
    if hole < size:
        raise CheckpointCorruptError(f"{where}: a sparse file (a hole at byte {hole} of {size}); the tier writes every "
                                     "byte of its copies, so this is not one: refused without reading it")


def read_verified(holding: Holding, name: str) -> bytearray:
    """One file of a copy, read confined and bounded into one buffer, its checksum computed a chunk at a time as
    each chunk arrives, and checked against ``meta.json``: a file larger than the RAM available is refused
    outright, and the file must be a torch zip (checked from the file: its directory and pickle, not its data)
    without holes before the memory for it is taken. Every failure is a :class:`CheckpointCorruptError` (the copy is excluded,
    the next source or the durable tier used), never a raw ``MemoryError``."""
    entry = holding.files[name]
    shown = os.path.join(holding.path, name)
    check_room(holding, name)
    with open_in(holding.root, f"{holding.relative}/{name}", size=entry["size"]) as fh:
        check_torch_zip(fh, shown)  # a torch zip at all (read from the file: its ends and pickle, not the whole)
        check_dense(fh, entry["size"], shown)
        fh.seek(0)
        try:
            data = bytearray(entry["size"])
        except MemoryError:
            raise CheckpointCorruptError(f"{shown}: {memory.size(entry['size'])} do not fit in memory") from None
        view = memoryview(data)
        got, digest = 0, sums.Digest()
        while got < len(data):
            n = fh.readinto(view[got:got + _CHUNK])
            if not n:
                raise CheckpointCorruptError(f"{shown}: shorter than its meta says")
            digest.add(view[got:got + n], got)
            got += n
    if digest.value() != expected_sum(holding, name):
        raise CheckpointCorruptError(f"{shown}: its checksum differs from its meta.json (the bytes changed)")
    return data
