"""``Accelerator.save_state``/``load_state``, atomic and verified.

Accelerate writes a checkpoint straight into its final folder, file by file: a job killed inside
``save_state`` leaves a newest ``checkpoint_<n>`` without its weights, and ``load_state`` (or a script that
picks the newest folder) loads it. Here ``save_state(accelerator, directory, step)`` lets Accelerate write
into a staging folder (``.tmp-checkpoint_<step>-<token>``), then rank 0 records every file's size and CRC-32 in
``robustdist-manifest.json``, fsyncs, and renames the folder to ``checkpoint_<step>``: a checkpoint is complete
or absent. ``load_state(accelerator, directory)`` loads the newest ``checkpoint_<step>`` that verifies, and falls
back to an older one (with a warning naming what was wrong) when the newest is damaged::

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    h = robustdist.harden(model, loader, cfg, optimizer=optimizer)   # watchdog and step guard; no second wrap
    step = robustdist.frameworks.accelerate.load_state(accelerator, "ckpt") or 0
    ...
    robustdist.frameworks.accelerate.save_state(accelerator, "ckpt", step)

Both are collective (every process calls them, as Accelerate's own). The directory is input: each file is
opened confined to its checkpoint folder (no links, regular files only, sizes checked first), every torch file
must be an uncompressed torch zip whose pickle passes robustdist's cost scan, and a file the manifest does not
list is refused (Accelerate loads ``custom_checkpoint_<i>.pkl`` by listing the folder, and those with
``weights_only=False``, so they must also load with ``weights_only=True`` here first). Verification is split
over the ranks (each checks every ``world_size``-th file) and agreed before anything is loaded.

Supported: the DDP and single-process paths Accelerate handles with plain files (``MULTI_CPU``, ``MULTI_GPU``,
``NO``); ``automatic_checkpoint_naming`` is refused (Accelerate then ignores the folder it is given). The
directory must be one that every rank sees (Accelerate writes each rank's RNG file there).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
import sys
import uuid
from collections.abc import Callable
from typing import Any

from robustdist.checkpoint._cleanup import remove
from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._io import Crc32, checksum_entry
from robustdist.checkpoint._safeio import check_torch_zip, lexists_dir, open_in, read_in
from robustdist.runtime import dist as _dist
from robustdist.runtime.dist import Collectives
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, ConfigError
from robustdist.runtime.log import get_logger
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["MANIFEST", "committed_states", "in_charge", "is_prepared_loader", "load_state", "prepared_scaler",
           "save_state"]

log = get_logger(__name__)

MANIFEST = "robustdist-manifest.json"
FORMAT = "robustdist-accelerate/1"
_MAX_MANIFEST = 4 << 20
_MAX_FILES = 10_000
_DIR_RE = re.compile(r"^checkpoint_(0|[1-9]\d{0,17})$")
_OLD_RE = re.compile(r"^\.old-checkpoint_(0|[1-9]\d{0,17})-[0-9a-f]{8}$")
_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")
_STAGING = ".tmp-checkpoint_"
_TRASH = ".trash-checkpoint_"
_OLD = ".old-checkpoint_"  # a re-save's committed copy, for the instant between its two renames
_REJECTED = ".rejected-checkpoint_"  # newer-numbered checkpoints of a run that resumed from an older one: kept
_CUSTOM = re.compile(r"^custom_checkpoint_\d+\.pkl$")
_OPS = ("save_state", "load_state")


def in_charge() -> int | None:
    """The number of processes of the Accelerator this process created, or None when there is none (Accelerate
    not imported, or no ``Accelerator`` yet). Never imports accelerate."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.is_initialized():
        return None
    return int(state.AcceleratorState().num_processes)


def is_prepared_loader(loader: Any) -> bool:
    """True for a loader ``accelerator.prepare`` returned (Accelerate's ``DataLoaderShard`` and friends)."""
    return type(loader).__module__.startswith("accelerate.")


def prepared_scaler(optimizer: Any) -> Any:
    """The GradScaler of an optimizer ``accelerator.prepare`` returned (``mixed_precision="fp16"``), else None."""
    if optimizer is None or not type(optimizer).__module__.startswith("accelerate."):
        return None
    return getattr(optimizer, "scaler", None)


_REFUSED: dict[str, set[int]] = {}
_OURS = re.compile(r"\.(?:tmp|trash|old)-checkpoint_[A-Za-z0-9_.-]{1,200}|checkpoint_\d{1,18}")
"""The names this module deletes in the directory (never ``.rejected-*`` or anything else)."""
"""Per directory (its real path), the steps load_state refused in this process: the next save sets them aside."""
_CALLS = {"accelerate-save": itertools.count(1), "accelerate-load": itertools.count(1)}


def _collectives(timeout: float, arrival_timeout: float, scope: str) -> Collectives:
    """Bounded collectives whose token every rank computes alike (the attempt, and how many such calls this
    process made): no collective runs before ``arrive``, so a call made under ``if is_main_process:`` fails there,
    named, within ``arrival_timeout``, instead of pairing with another rank's unrelated collective."""
    rank, world = (_dist.rank(), _dist.world_size()) if _dist.is_up() else (0, 1)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")[:8]
    return Collectives(None, rank, world, timeout=timeout, arrival_timeout=arrival_timeout, error=CheckpointError,
                       scope=scope, noun="checkpoint", owner="Accelerate checkpoint", ops=_OPS,
                       knob="arrival_timeout=", token=f"a{attempt}-{next(_CALLS[scope])}")


def _check_accelerator(accelerator: Any, what: str) -> None:
    config = getattr(accelerator, "project_configuration", None)
    if config is None or not hasattr(accelerator, "save_state"):
        raise ConfigError(f"robustdist.frameworks.accelerate.{what} was given {type(accelerator).__name__}; expected "
                          "an accelerate.Accelerator. Fix: pass the Accelerator the script prepared its objects "
                          "with.", rank=_dist.error_rank())
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", str(getattr(accelerator,
                                                                                       "distributed_type", "")))
    if kind in _UNSUPPORTED:
        raise ConfigError(
            f"robustdist.frameworks.accelerate.{what}: the Accelerator runs {kind}, whose checkpoints are not plain "
            "files this module can verify (FSDP's sharded .metadata, DeepSpeed's and Megatron's own formats load "
            "with pickle); expected DDP or one process (MULTI_CPU, MULTI_GPU, NO). Fix: use accelerator.save_state"
            "/load_state there, or harden's strategy 'fsdp' with h.save/h.resume.", rank=_dist.error_rank())
    if getattr(config, "automatic_checkpoint_naming", False):
        raise ConfigError(
            f"robustdist.frameworks.accelerate.{what}: the Accelerator has ProjectConfiguration("
            "automatic_checkpoint_naming=True), under which Accelerate ignores the folder it is given and writes "
            "checkpoint_<n> in place (not atomically); expected it off. Fix: drop automatic_checkpoint_naming "
            "(robustdist names the folders checkpoint_<step> and keeps keep_last of them).",
            rank=_dist.error_rank())


def committed_states(directory: str | os.PathLike[str]) -> list[int]:
    """The steps of the committed checkpoints in ``directory`` (``checkpoint_<step>`` folders, not links, that
    hold a manifest), oldest first. Staging, trash and set-aside folders never count; a re-save's ``.old-`` copy
    counts while its final name is missing (a crash between the re-save's two renames)."""
    return sorted(_committed(os.fspath(directory)))


def _committed(base: str) -> dict[int, str]:
    """step -> folder name, for every committed checkpoint."""
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found: dict[int, str] = {}
    for name in sorted(names, key=lambda n: n.startswith(".")):  # final names first, then .old- copies
        match = _DIR_RE.match(name) or _OLD_RE.match(name)
        if match is None or int(match.group(1)) in found:
            continue
        path = os.path.join(base, name)
        if lexists_dir(path) and os.path.lexists(os.path.join(path, MANIFEST)):
            found[int(match.group(1))] = name
    return found


def _foreign(base: str) -> list[str]:
    """``checkpoint_<n>`` folders without a manifest: Accelerate's own, or a copy robustdist never committed."""
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if _DIR_RE.match(n) and not os.path.lexists(os.path.join(base, n, MANIFEST)))


def save_state(accelerator: Any, directory: str | os.PathLike[str], step: int, *, keep_last: int | None = 3,
               timeout: float = 1800.0, arrival_timeout: float = 600.0, **save_kwargs: Any) -> str:
    """``accelerator.save_state`` into ``<directory>/checkpoint_<step>``, committed atomically (see the module
    docstring). Collective. Keeps the newest ``keep_last`` committed checkpoints (None keeps all). Returns the
    committed folder. ``save_kwargs`` go to ``accelerator.save_state`` (e.g. ``safe_serialization``)."""
    _check_accelerator(accelerator, "save_state")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**18:
        raise ConfigError(f"save_state(step={step!r}); expected an int in [0, 10**18). Fix: pass the training step.",
                          rank=_dist.error_rank())
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"save_state(keep_last={keep_last!r}); expected an int >= 1 or None. Fix: pass e.g. 3.",
                          rank=_dist.error_rank())
    base = os.fspath(directory)
    coll = _collectives(timeout, arrival_timeout, "accelerate-save")
    coll.arrive("save_state")
    staging = os.path.join(base, f"{_STAGING}{step}-{coll.token}")
    _agree(coll, "prepare", lambda: _prepare(base, staging) if coll.rank == 0 else None)
    _agree(coll, "write", lambda: accelerator.save_state(staging, **save_kwargs), cleanup=staging)
    final = os.path.join(base, f"checkpoint_{step}")
    _agree(coll, "commit", lambda: _commit(base, staging, final, step, coll.world_size, keep_last)
           if coll.rank == 0 else None, cleanup=staging)
    log.info("committed Accelerate checkpoint %s", final)
    return final


def _agree(coll: Collectives, stage: str, fn: Callable[[], Any], *, cleanup: str | None = None) -> None:
    """Run ``fn`` on this rank, then agree: if any rank failed, every rank raises the same CheckpointError (and
    rank 0 removes ``cleanup``)."""
    failures = coll.attempt(f"save_state {stage}", fn)
    if not failures:
        return
    if cleanup is not None and coll.rank == 0:
        remove(cleanup, _OURS)
    shown = "; ".join(f"rank {r}: {f}" for r, f in sorted(failures.items()))
    doing = {"prepare": "prepared the staging folder for", "write": "wrote", "commit": "committed"}[stage]
    raise CheckpointError(f"save_state failed while it {doing} the checkpoint "
                          f"({shown}); nothing was committed, the newest committed checkpoint is unchanged. Fix: "
                          "see the error above; the next save_state retries.", rank=coll.rank, ranks=failures)


def _prepare(base: str, staging: str) -> None:
    with Confined(base, create=True, what="the checkpoint directory") as folder:
        if not lexists_dir(base):
            raise CheckpointError(f"{base}: is not a directory (a link or a file); expected the checkpoint "
                                  "directory. Fix: point save_state at a real directory.")
        for name in folder.names():  # staging folders of saves that never committed (a crash mid-save)
            if name.startswith((_STAGING, _TRASH)) and _OURS.fullmatch(name):
                remove(os.path.join(base, name), _OURS)
            match = _OLD_RE.match(name)
            if match is not None:  # a re-save that crashed between its renames: its old copy is still committed
                final = f"checkpoint_{match.group(1)}"
                if folder.lstat(final) is not None:
                    remove(os.path.join(base, name), _OURS)
                else:
                    folder.rename(name, final)
        folder.sub(os.path.basename(staging), fresh=True).close()


def _walk(folder: str) -> tuple[list[str], list[str]]:
    """(relative names of the regular files under ``folder``, the names of anything else), links not followed."""
    files, others = [], []
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(os.path.join(folder, rel) if rel else folder) as entries:
            for entry in entries:
                name = f"{rel}/{entry.name}" if rel else entry.name
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    pending.append(name)
                elif stat.S_ISREG(mode):
                    files.append(name)
                else:
                    others.append(name)
                if len(files) + len(others) > _MAX_FILES:
                    raise CheckpointCorruptError(f"{folder}: holds more than {_MAX_FILES} entries")
    return sorted(files), sorted(others)


def _commit(base: str, staging: str, final: str, step: int, world: int, keep_last: int | None) -> None:
    files, others = _walk(staging)
    if others:
        raise CheckpointError(f"{staging}: Accelerate left {others[0]!r}, which is not a regular file; expected "
                              "files only")
    missing = [r for r in range(world) if f"random_states_{r}.pkl" not in files]
    if missing:
        raise CheckpointError(
            f"{staging}: holds no random_states_<rank>.pkl of rank(s) {missing[:8]}; expected one per rank: the "
            "directory is not one every rank sees. Fix: point save_state at a shared filesystem.")
    entries = {}
    for name in files:
        path = os.path.join(staging, name)
        with open_in(staging, name) as fh:  # the other ranks' files too: fsync makes them durable from here
            os.fsync(fh.fileno())
        entries[name] = checksum_entry(path)
    name = os.path.basename(final)
    with Confined(base) as folder:
        with folder.sub(os.path.basename(staging)) as files:  # never through a link swapped in for it
            files.write(MANIFEST, json.dumps({"format": FORMAT, "step": step, "world_size": world, "files": entries},
                                             indent=2, sort_keys=True).encode())
            written = files.stat()
        _commit_renames(base, folder, staging, name, step, written)
    log.debug("committed %s", name)
    _set_aside(base, step)
    if keep_last is not None:
        for old in [s for s in committed_states(base) if s < step][: max(0, len(committed_states(base)) - keep_last)]:
            aside = f"{_TRASH}{old}-{uuid.uuid4().hex[:8]}"
            try:
                with Confined(base) as folder:
                    folder.rename(_committed(base)[old], aside)
                remove(os.path.join(base, aside), _OURS)
            except (CheckpointError, KeyError) as e:  # rotation is housekeeping: the new checkpoint is committed
                log.warning("could not rotate checkpoint_%d out of %s (%s); it stays", old, base, e)


def _commit_renames(base: str, folder: Confined, staging: str, name: str, step: int,
                    written: os.stat_result) -> None:
    """Rename the staging directory to ``name`` (a re-save moves the old copy aside first), then check that what
    now has the name is the directory whose manifest was written: a staging directory swapped for a link or
    another directory mid-save is never committed (what took the name is removed, the old copy put back)."""
    final = os.path.join(base, name)
    aside = None
    if folder.lstat(name) is not None:
        if not (lexists_dir(final) and os.path.lexists(os.path.join(final, MANIFEST))):
            raise CheckpointError(f"{final}: exists, and robustdist did not commit it (no {MANIFEST}); expected "
                                  "it absent or robustdist's. Nothing is overwritten. Fix: move it away, or save "
                                  "to another directory.")
        aside = f"{_OLD}{step}-{uuid.uuid4().hex[:8]}"
        folder.rename(name, aside)  # until the next rename, .old- is the committed copy (committed_states)
    folder.rename(os.path.basename(staging), name)
    now = folder.lstat(name)
    if now is None or (now.st_dev, now.st_ino) != (written.st_dev, written.st_ino):
        remove(final, _OURS)  # a link is removed as a link (what it points at untouched)
        if aside is not None:
            folder.rename(aside, name)
        raise CheckpointCorruptError(f"{staging}: was replaced by a link or another directory while the checkpoint "
                                     "was committed; expected the staging directory robustdist wrote. Nothing was "
                                     f"committed. Fix: make sure nothing else writes {base}.")
    folder.sync(strict=True)
    if aside is not None:
        remove(os.path.join(base, aside), _OURS)


def _set_aside(base: str, step: int) -> None:
    """Keep, renamed ``.rejected-checkpoint_<n>-<token>`` (never loaded, never deleted), the checkpoints that should
    no longer count: those numbered past ``step`` belong to a run that later resumed from an older one (refused,
    or abandoned), and those a ``load_state`` of this process refused. So the newest checkpoint is the one just
    committed, and rotation never keeps a refused checkpoint in place of a good one."""
    refused = _REFUSED.pop(os.path.realpath(base), set())
    for newer, name in sorted(_committed(base).items()):
        if newer > step or (newer in refused and newer != step):
            target = os.path.join(base, f"{_REJECTED}{newer}-{uuid.uuid4().hex[:8]}")
            try:
                with Confined(base) as folder:
                    folder.rename(name, os.path.basename(target))
                log.warning("%s %s: set aside as %s (kept, never loaded)", name,
                            "was refused by load_state" if newer in refused else
                            f"is numbered past the step just saved ({step}), from a run that resumed from an older "
                            "checkpoint", target)
            except CheckpointError as e:
                log.warning("could not set %s aside (%s)", name, e)


def load_state(accelerator: Any, directory: str | os.PathLike[str], *, timeout: float = 1800.0,
               arrival_timeout: float = 600.0, **load_kwargs: Any) -> int | None:
    """Load the newest committed checkpoint in ``directory`` that verifies into the Accelerator's prepared
    objects (``accelerator.load_state``); a damaged one is skipped with a warning, falling back to the next older.
    Collective. Returns its step, or None when ``directory`` holds no committed checkpoint (a fresh start).
    Raises :class:`~robustdist.runtime.errors.CheckpointCorruptError` when there are some but none verifies."""
    _check_accelerator(accelerator, "load_state")
    base = os.fspath(directory)
    coll = _collectives(timeout, arrival_timeout, "accelerate-load")
    coll.arrive("load_state")
    if coll.rank == 0:
        foreign = _foreign(base)
        if foreign:
            log.warning("%s holds %s without %s (written by accelerator.save_state itself, or not committed): not "
                        "loaded, and never overwritten or rotated. Fix: to resume from one, load it with "
                        "accelerator.load_state once, then save with robustdist.frameworks.accelerate.save_state",
                        base, ", ".join(foreign[:5]), MANIFEST)
    listing = coll.broadcast(sorted(_committed(base).items(), reverse=True), "load_state list")
    refused: list[str] = []
    for step, name in listing:
        folder = os.path.join(base, name)
        problem = None
        try:
            _verify(folder, step, coll.rank, coll.world_size)
        except CheckpointCorruptError as e:
            problem = str(e)
        except (OSError, ValueError, RecursionError, MemoryError) as e:  # a hostile folder: named, then the next
            problem = f"{folder}: unreadable ({type(e).__name__}: {str(e)[:200]})"
        problems = list(coll.problems(problem, "load_state verify").values())
        if not problems:  # agreed: every rank falls back together
            failures = list(coll.attempt("load_state load", lambda: accelerator.load_state(folder, **load_kwargs),
                                         limit=300).values())
            if not failures:
                if refused:
                    log.warning("loaded %s, an older checkpoint: %s", folder, "; ".join(refused))
                else:
                    log.info("loaded Accelerate checkpoint %s", folder)
                return step
            problems = [f"accelerator.load_state failed: {failures[0]}"]
        refused.append(f"{name} refused ({problems[0][:300]})")
        _REFUSED.setdefault(os.path.realpath(base), set()).add(step)
        log.warning("%s: refused (%s); trying an older checkpoint", folder, problems[0][:300])
    if refused:
        raise CheckpointCorruptError(
            f"{base}: none of its {len(refused)} committed checkpoint(s) verifies: {'; '.join(refused)}. Expected at "
            "least one intact. The prepared objects may hold part of a refused checkpoint (Accelerate loads file by "
            "file): do not train on them. Fix: restore the folder from a copy, or move it away and restart afresh.",
            rank=coll.rank)
    return None


def _verify(folder: str, step: int, rank: int, world: int) -> None:
    """Raise CheckpointCorruptError when ``folder`` is not the complete checkpoint its manifest describes; this
    rank checks the contents of every ``world``-th file."""
    try:
        manifest = json_value(read_in(folder, MANIFEST, max_size=_MAX_MANIFEST), _MAX_MANIFEST)
    except Unreadable as e:
        raise CheckpointCorruptError(f"{folder}/{MANIFEST}: {e}") from None
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("step") != step
            or not isinstance(entries, dict) or len(entries) > _MAX_FILES):
        raise CheckpointCorruptError(f"{folder}/{MANIFEST}: not a robustdist Accelerate manifest of step {step}")
    for name, entry in entries.items():
        if (not isinstance(name, str) or not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or isinstance(entry.get("size"), bool) or not isinstance(entry.get("crc32"), str)):
            raise CheckpointCorruptError(f"{folder}/{MANIFEST}: a malformed entry ({str(name)[:80]!r})")
    files, others = _walk(folder)
    unlisted = [n for n in files + others if n != MANIFEST and n not in entries]
    if unlisted:
        raise CheckpointCorruptError(f"{folder}: holds {unlisted[0]!r}, which its manifest does not list (Accelerate "
                                     "would load it); expected only the files save_state wrote")
    for i, (name, entry) in enumerate(sorted(entries.items())):
        if i % world != rank:
            with open_in(folder, name, size=entry["size"]):  # present, confined, regular, the right size
                continue
        _check_file(folder, name, entry)


def _check_file(folder: str, name: str, entry: dict[str, Any]) -> None:
    where = os.path.join(folder, name)
    crc = Crc32()
    with open_in(folder, name, size=entry["size"]) as fh:
        if not name.endswith(".safetensors"):  # Accelerate's other files are torch.save zips
            check_torch_zip(fh, where)
        while chunk := fh.read(8 << 20):
            crc.update(chunk)
    if crc.hexdigest() != entry["crc32"]:
        raise CheckpointCorruptError(f"{where}: its CRC-32 differs from the manifest's (the file changed or is "
                                     "damaged)")
    if _CUSTOM.match(os.path.basename(name)):  # Accelerate loads these with weights_only=False: code must not run
        import torch

        try:
            with open_in(folder, name, size=entry["size"]) as fh:
                torch.load(fh, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(
                f"{where}: does not load with weights_only=True ({type(e).__name__}: {str(e)[:160]}); Accelerate "
                "would unpickle it with weights_only=False, which can run code. Expected plain state (tensors, "
                "numbers, containers). Fix: make the registered object's state_dict() return plain data.") from None
