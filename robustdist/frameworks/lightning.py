"""robustdist inside a Lightning ``Trainer``: a ``CheckpointIO`` plugin and a ``Callback``.

Lightning owns the loop, the DDP and the sampler; robustdist adds what it lacks, where Lightning users look::

    trainer = L.Trainer(plugins=[robustdist.frameworks.lightning.checkpoint_io()],
                        callbacks=[robustdist.frameworks.lightning.callback(hang_timeout=600, nan_policy="skip")])

* :func:`checkpoint_io` (a ``CheckpointIO``): each ``.ckpt`` is written to a temporary file beside its final
  name, fsynced, and renamed over it, then its size and CRC-32 go to ``<name>.ckpt.robustdist.json`` the same way
  (Lightning's own ``_atomic_save`` writes the bytes without an fsync, so a power loss can leave an empty file
  under the final name). ``load_checkpoint`` verifies the file against that record and reads it with
  ``weights_only=True`` unless Lightning asks otherwise; a damaged checkpoint (a record that disagrees, a torch
  file that is not an uncompressed zip, a pickle past robustdist's cost scan) falls back to the newest intact
  ``.ckpt`` of the same folder, with a warning, and raises :class:`~robustdist.runtime.errors.CheckpointCorruptError`
  when there is none. A ``.ckpt`` without a record (written before this plugin) loads, with a warning. When
  Lightning asks for ``weights_only=False`` (``trainer.fit(..., weights_only=False)``, for hyperparameters that are
  objects), or when classes were named in ``checkpoint_io(allowed_globals=[...])``, the file is still unpickled by
  torch's weights-only unpickler, allowing besides tensors and plain data only ``argparse.Namespace``, Lightning's
  ``AttributeDict`` and the classes named: Lightning's flag is not the user's consent to run what a file names.
* :func:`callback` (a ``Callback``): the watchdog on the LightningModule's forward, and ``nan_policy`` checked in
  ``on_before_optimizer_step`` (after backward, so under DDP on the all-reduced gradients: every rank reaches the
  same verdict with no extra collective). ``"raise"`` raises :class:`~robustdist.runtime.errors.NonFiniteLossError`
  naming the step; ``"skip"`` drops this step's gradients (the optimizer skips parameters without one) and counts
  it. A checkpoint saved mid-epoch is warned about once, with the fix: Lightning does not restore a plain
  ``DataLoader``'s position, so a resume from it replays the epoch's batches from the start (not bitwise).
* Under torchrun (or ``robustdist run``) with several processes, either of them, called before the ``Trainer`` is
  built, makes the process group with :func:`~robustdist.init.process_group.safe_init_process_group` (``backend``:
  robustdist's choice unless given) when there is none yet:
  Lightning then uses it, and each restarted attempt rendezvous on a fresh store (Lightning's own
  ``init_process_group`` reuses torchrun's store, and a restart may fail with "Connection refused").

Lightning is imported when one of them is first called, never at import.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import threading
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

from robustdist.checkpoint._confined import Confined
from robustdist.checkpoint._io import Crc32
from robustdist.checkpoint._safeio import check_torch_zip, open_in, read_in
from robustdist.checkpoint._schema import weights_only_reason
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, ConfigError, NonFiniteLossError
from robustdist.runtime.log import get_logger
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["RECORD_SUFFIX", "callback", "checkpoint_io"]

log = get_logger(__name__)

RECORD_SUFFIX = ".robustdist.json"
_MAX_RECORD = 64 << 10
_POLICIES = ("raise", "skip")
_classes: dict[str, type] = {}


def checkpoint_io(*, allowed_globals: Any = (), backend: str | None = None) -> Any:
    """A Lightning ``CheckpointIO`` that saves atomically and verifies on load (see the module docstring).
    ``allowed_globals``: classes (or ``"module.Name"`` strings, imported here) a checkpoint may hold: your
    hyperparameters' own types, from files you trust. ``backend``: the process group's backend where this call
    makes the group (default: nccl on a CUDA machine, else gloo; say ``"gloo"`` for a CPU Trainer there)."""
    allowed = _resolve(allowed_globals)
    _make_group(backend)
    return _class("io")(allowed)


def callback(*, hang_timeout: float | None = 1800.0, nan_policy: str = "raise", dump_dir: str | None = None,
             backend: str | None = None) -> Any:
    """A Lightning ``Callback``: the watchdog (``hang_timeout`` seconds, None for none) and the ``nan_policy``
    ("raise" or "skip") before each optimizer step (see the module docstring). ``backend``: as for
    :func:`checkpoint_io`."""
    if nan_policy not in _POLICIES:
        raise ConfigError(f"robustdist.frameworks.lightning.callback(nan_policy={nan_policy!r}); expected one of "
                          f"{', '.join(_POLICIES)}. Fix: pass one of those ('rollback' needs harden's loop).",
                          rank=_dist.error_rank())
    if hang_timeout is not None and (isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float))
                                     or not hang_timeout > 0):
        raise ConfigError(f"robustdist.frameworks.lightning.callback(hang_timeout={hang_timeout!r}); expected "
                          "seconds > 0, or None. Fix: pass e.g. 1800.", rank=_dist.error_rank())
    _make_group(backend)
    return _class("callback")(hang_timeout=hang_timeout, nan_policy=nan_policy, dump_dir=dump_dir)


def _make_group(backend: str | None) -> None:
    """Under torchrun (or ``robustdist run``), several processes and no process group yet: make it, robustdist's
    way (``backend``: None for robustdist's choice)."""
    if _dist.is_up():
        return
    from robustdist.runtime.topology import detect_topology

    topo = detect_topology()
    if topo.launcher != "torchrun" or topo.world_size < 2:
        return
    from robustdist.init.process_group import safe_init_process_group

    report = safe_init_process_group(backend=backend, topology=topo)
    log.info("made the process group for Lightning (backend %s; a fresh store per torchrun attempt); Lightning uses "
             "it, and its strategy's process_group_backend and timeout do not apply. Fix, for a CPU Trainer on a CUDA "
             "machine: checkpoint_io(backend='gloo')", report.backend)


def _resolve(allowed: Any) -> tuple[type, ...]:
    """``allowed_globals`` as classes: a class as given, ``"module.Name"`` imported. Only classes: a function
    allowed would be called with whatever arguments a file chooses."""
    if isinstance(allowed, (str, type)):
        allowed = [allowed]
    try:
        items = list(allowed)
    except TypeError:
        items = [allowed]
    out: list[type] = []
    for item in items:
        found: Any = item
        if isinstance(item, str):
            module, _, name = item.replace(":", ".").rpartition(".")
            try:
                found = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ConfigError(f"checkpoint_io(allowed_globals=[{item!r:.200}]): cannot import it "
                                  f"({type(e).__name__}: {str(e)[:200]}); expected 'module.Name' of an importable "
                                  "class. Fix: name the class by its module path, or pass the class itself.",
                                  rank=_dist.error_rank()) from None
        if not isinstance(found, type):
            raise ConfigError(f"checkpoint_io(allowed_globals=...) holds {item!r:.80}; expected classes (or "
                              "'module.Name' strings naming classes): a function allowed would run with arguments "
                              "the file chooses. Fix: pass e.g. [MyConfig] or ['mypackage.config.MyConfig'].",
                              rank=_dist.error_rank())
        out.append(found)
    return tuple(out)


def _lightning_types() -> list[Any]:
    """What Lightning itself puts in a checkpoint's hyperparameters besides plain data."""
    import argparse

    found: list[Any] = [argparse.Namespace]
    for module in ("lightning.fabric.utilities.data", "lightning.pytorch.utilities.parsing"):
        with contextlib.suppress(ImportError, AttributeError):
            kind = importlib.import_module(module).AttributeDict
            if kind not in found:
                found.append(kind)
    return found


def _class(kind: str) -> type:
    if kind not in _classes:
        _classes.update(_build())
    return _classes[kind]


def _build() -> dict[str, type]:
    import torch
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import Callback

    class RobustCheckpointIO(CheckpointIO):
        """Atomic, verified ``.ckpt`` files (robustdist.frameworks.lightning)."""

        def __init__(self, allowed: tuple[Any, ...] = ()) -> None:
            super().__init__()
            self.allowed = allowed

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            if storage_options is not None:
                raise TypeError("robustdist's CheckpointIO takes no storage_options")
            _save(checkpoint, os.fspath(path))

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
            # weights_only=False (Lightning's request), or types the user named: Lightning's own and the user's
            trusting = weights_only is False or bool(self.allowed)
            return _load(os.fspath(path), map_location, (*_lightning_types(), *self.allowed) if trusting else None)

        def remove_checkpoint(self, path: Any) -> None:
            folder, name = os.path.split(os.fspath(path))
            with Confined(folder or ".") as directory:
                for each in (name, name + RECORD_SUFFIX):  # the file and its record, never through a link
                    directory.remove(each, re.compile(re.escape(name) + f"(?:{re.escape(RECORD_SUFFIX)})?"))

    class RobustCallback(Callback):
        """The watchdog and the NaN policy (robustdist.frameworks.lightning)."""

        def __init__(self, *, hang_timeout: float | None, nan_policy: str, dump_dir: str | None) -> None:
            self.hang_timeout, self.nan_policy, self.dump_dir = hang_timeout, nan_policy, dump_dir
            self.watchdog: Any = None
            self.skipped = 0
            self.warned_mid_epoch = False

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            if self.hang_timeout is not None and self.watchdog is None:
                from robustdist.health.watchdog import Watchdog

                self.watchdog = Watchdog(self.hang_timeout, dump_dir=self.dump_dir, rank=trainer.global_rank,
                                         world_size=trainer.world_size).attach(pl_module)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            from robustdist.health.grad_check import tensors_finite

            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if tensors_finite(grads):
                return
            step = trainer.global_step
            if self.nan_policy == "raise":
                raise NonFiniteLossError(
                    f"step {step}: non-finite gradients before the optimizer step; expected finite values. Fix: "
                    "find the batch or the operation that produced them (torch.autograd.set_detect_anomaly(True) "
                    "names the backward op), lower the learning rate or clip gradients; nan_policy='skip' lets "
                    "training continue past it.", rank=_dist.error_rank())
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self.skipped += 1
            log.warning("step %d: non-finite gradients; this step's update is skipped (%d so far)", step, self.skipped)

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            progress = trainer.fit_loop.epoch_loop.batch_progress
            done = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step  # the run's last
            if self.warned_mid_epoch or done or trainer.global_rank != 0 or progress.is_last_batch \
                    or progress.current.ready == 0:
                return
            loader = trainer.train_dataloader
            if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
                return  # Lightning saves and restores a stateful loader's position
            self.warned_mid_epoch = True
            log.warning("the checkpoint at step %d is taken mid-epoch (after batch %d of epoch %d): Lightning does not "
                        "restore a plain DataLoader's position, so a resume from it replays the epoch's batches from "
                        "its start (steps trained twice; not bitwise the run without the fault). Fix: checkpoint at "
                        "epoch ends (ModelCheckpoint(every_n_epochs=1, save_last=True)), or train from a loader with "
                        "state_dict()/load_state_dict() (torchdata's StatefulDataLoader), which Lightning restores",
                        trainer.global_step, progress.current.ready, trainer.current_epoch)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self._close()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._close()

        def _close(self) -> None:
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None

        def state_dict(self) -> dict[str, Any]:
            return {"skipped": self.skipped}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.skipped = int(state.get("skipped", 0))

    del torch
    return {"io": RobustCheckpointIO, "callback": RobustCallback}


def _save(checkpoint: dict[str, Any], path: str) -> None:
    """Write ``path`` and its record as new files (``O_EXCL``, never through a link) under temporary names in the
    same directory, fsync them, rename both into place, fsync the directory (:class:`Confined`)."""
    import torch

    folder_path, name = os.path.split(path)
    tmp = f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    ours = re.compile(re.escape(tmp) + f"(?:{re.escape(RECORD_SUFFIX)})?")
    crc = Crc32()
    with Confined(folder_path or ".", create=True) as folder:
        try:
            with folder.open_new(tmp) as fh:
                torch.save(checkpoint, _Hashing(fh, crc))
                fh.flush()
                os.fsync(fh.fileno())
                size = fh.tell()
            record = json.dumps({"format": "robustdist-lightning/1", "size": size, "crc32": crc.hexdigest()})
            folder.put(tmp + RECORD_SUFFIX, record.encode(), durable=True)
            folder.rename(tmp, name)  # a crash between the two renames leaves a record that disagrees: refused
            folder.rename(tmp + RECORD_SUFFIX, name + RECORD_SUFFIX)
            folder.sync(strict=True)
        finally:
            for leftover in (tmp, tmp + RECORD_SUFFIX):
                with contextlib.suppress(CheckpointError):
                    folder.remove(leftover, ours)


class _Hashing:
    """A write-only file object that feeds what torch.save writes to a CRC."""

    def __init__(self, fh: Any, crc: Crc32) -> None:
        self.fh, self.crc = fh, crc

    def write(self, data: Any) -> int:
        self.crc.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _load(path: str, map_location: Any, allowed: tuple[Any, ...] | None) -> Any:
    """``allowed``: None for Lightning's ``weights_only=True``; the globals allowed besides plain data for
    ``weights_only=False``."""
    try:
        return _load_verified(path, map_location, allowed)
    except CheckpointCorruptError as e:
        fallback = _newest_intact(os.path.dirname(path) or ".", exclude=path)
        if fallback is None:
            fix = "" if "Fix:" in str(e) else " Fix: restore the file from a copy, or start without ckpt_path."
            raise CheckpointCorruptError(f"{e} No other intact .ckpt in {os.path.dirname(path) or '.'} to fall back "
                                         f"to.{fix}", rank=_dist.error_rank()) from None
        log.warning("%s is refused (%s); loading %s, the newest intact checkpoint beside it", path, e, fallback)
        return _load_verified(fallback, map_location, allowed)


def _load_verified(path: str, map_location: Any, allowed: tuple[Any, ...] | None) -> Any:
    import torch

    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    record = _record(folder, name)
    with open_in(folder, name, size=record["size"] if record else None,
                 max_size=None if record else 1 << 40) as fh:
        check_torch_zip(fh, path)
        if record is not None:
            crc = Crc32()
            while chunk := fh.read(8 << 20):
                crc.update(chunk)
            if crc.hexdigest() != record["crc32"]:
                raise CheckpointCorruptError(f"{path}: its CRC-32 differs from {name}{RECORD_SUFFIX}'s (the file "
                                             "changed or is damaged)")
            fh.seek(0)
        else:
            log.warning("%s has no %s record (written without robustdist's CheckpointIO): loaded unverified",
                        path, RECORD_SUFFIX)
        try:
            with _allowing(allowed or ()):
                return torch.load(fh, map_location=map_location, weights_only=True)
        except Exception as e:  # weights_only refusals, a damaged stream
            if allowed is None:
                raise CheckpointCorruptError(
                    f"{path}: torch.load(weights_only=True) failed ({type(e).__name__}: {weights_only_reason(e)}). "
                    "Fix: if the file is yours and its hyperparameters are objects, name their classes: "
                    "checkpoint_io(allowed_globals=['module.Name'])") from None
            raise CheckpointCorruptError(
                f"{path}: refused although Lightning asked for weights_only=False ({weights_only_reason(e)}); "
                "robustdist unpickles only tensors, plain data, argparse.Namespace, Lightning's AttributeDict and "
                "the globals named in checkpoint_io(allowed_globals=...), since unpickling anything else runs what "
                "the file names. Fix: if you trust this file and the global named is your own type, allow it: "
                "checkpoint_io(allowed_globals=['module.Name'])") from None


_allow_lock = threading.Lock()


@contextlib.contextmanager
def _allowing(allowed: tuple[Any, ...]) -> Iterator[None]:
    """torch's weights-only unpickler also accepts ``allowed`` while this runs: only the classes not allowed
    already are added, and only those are removed after (what the script allowed itself stays allowed)."""
    import torch

    if not allowed:
        yield
        return
    with _allow_lock:
        present = set(map(id, torch.serialization.get_safe_globals()))
        missing = [kind for kind in allowed if id(kind) not in present]
        with torch.serialization.safe_globals(missing):
            yield


def _record(folder: str, name: str) -> dict[str, Any] | None:
    record_name = name + RECORD_SUFFIX
    if not os.path.lexists(os.path.join(folder, record_name)):
        return None
    try:
        record = json_value(read_in(folder, record_name, max_size=_MAX_RECORD), _MAX_RECORD)
    except Unreadable as e:
        raise CheckpointCorruptError(f"{os.path.join(folder, record_name)}: not a JSON record robustdist wrote "
                                     f"({e})") from None
    if (not isinstance(record, dict) or record.get("format") != "robustdist-lightning/1"
            or not isinstance(record.get("size"), int) or isinstance(record.get("size"), bool)
            or not isinstance(record.get("crc32"), str) or not re.fullmatch(r"[0-9a-f]{8}", record["crc32"])):
        raise CheckpointCorruptError(f"{os.path.join(folder, record_name)}: not a robustdist checkpoint record")
    return record


def _newest_intact(folder: str, *, exclude: str) -> str | None:
    """The newest (by modification time) ``.ckpt`` in ``folder`` whose record verifies, other than ``exclude``."""
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".ckpt") and not n.startswith(".")]
    except OSError:
        return None
    candidates = []
    for name in names:
        path = os.path.join(folder, name)
        if os.path.abspath(path) == os.path.abspath(exclude) or os.path.islink(path):
            continue
        try:
            record = _record(folder, name)
            if record is None:
                continue
            with open_in(folder, name, size=record["size"]) as fh:
                value = 0
                while chunk := fh.read(8 << 20):
                    value = zlib.crc32(chunk, value)
            if f"{value:08x}" == record["crc32"]:
                candidates.append((os.lstat(path).st_mtime_ns, path))
        except (CheckpointCorruptError, OSError):
            continue
    return max(candidates)[1] if candidates else None
