"""The shapes robustdist writes, checked before anything read from a checkpoint is used.

A manifest (``manifest.json``) is valid when it is exactly::

    {"format": 1, "step": int >= 0, "world_size": int >= 1,
     "files": {name: {"size": int >= 0, "crc32": 8 hex digits | "sha256": 64 hex digits}},
     "entries": {entry: "module" | "stateful" | "data" | "sharded"},
     "metadata": {...}, "config_fingerprint": str | None, "torch": str, "robustdist": str, "created": str}

where a file name is ``replicated.pt``, ``rank_<r>.pt`` (``r`` below ``world_size``), ``sharded/.metadata``
or ``sharded/__<r>_<n>.distcp``, and the files the entries need are listed. A payload (``replicated.pt``,
``rank_<r>.pt``) must be a dict holding what the manifest promises, and a saved RNG state must have the shape
:func:`robustdist.checkpoint._payload.capture_rng` gives it. Anything else is a
:class:`~robustdist.runtime.errors.CheckpointCorruptError` naming the file and the problem, so ``load()`` falls back
to the previous step instead of failing deep inside with a ``TypeError``. What a payload's entries must be to
fit the live objects they are restored into (a module, an optimizer, a scheduler) is checked by :mod:`._live`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from robustdist.runtime.errors import CheckpointCorruptError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPLICATED = "replicated.pt"
SHARDED_DIR = "sharded"
DCP_METADATA = f"{SHARDED_DIR}/.metadata"
KINDS = ("module", "stateful", "data", "sharded")
MAX_MANIFEST_BYTES = 16 << 20
MAX_DCP_METADATA_BYTES = 64 << 20
MAX_STEP = 2**63 - 1
MAX_VALUES = 1_000_000  # plain values in one payload, counted as a tree (save refuses more, so load can too)
MAX_PAYLOAD_VALUES = MAX_VALUES + 16  # in a payload file: the entries plus the payload's own records
MAX_PICKLE_TREE = 20 * MAX_VALUES  # pickle nodes behind one value (a tensor takes ~15: its storage, sizes, ...)

_RANK_FILE = re.compile(r"rank_(\d{5,})\.pt")
_DCP_FILE = re.compile(r"sharded/__(\d+)_(\d+)\.distcp")
_HEX = {"crc32": re.compile(r"[0-9a-f]{8}"), "sha256": re.compile(r"[0-9a-f]{64}")}


def weights_only_reason(e: BaseException) -> str:
    """The line of torch's weights_only message that names what was refused (it starts with boilerplate)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
    found = [line for line in lines if "WeightsUnpickler error" in line or "unsupported" in line.lower()]
    return (found or [line for line in lines if line] or [type(e).__name__])[0].split(". Please")[0][:300]


_TORCH_NAME = re.compile(r"\btorch\.([A-Za-z_][A-Za-z0-9_]{0,99})\b")
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+_-]{0,39}")


def another_torchs(refusal: BaseException, written_by: Any) -> str | None:
    """Where torch's weights-only refusal names a ``torch.<name>`` the installed torch lacks (a dtype a newer torch
    added, say) and the checkpoint's manifest says another torch wrote it: what to tell the user. None otherwise
    (the same torch lacking it, or a manifest whose version is no version: a crafted pickle)."""
    if not isinstance(written_by, str) or not _VERSION.fullmatch(written_by) or written_by == torch.__version__:
        return None
    import importlib.util

    names = vars(torch)  # not getattr: a name from the file must not import a torch submodule (find_spec runs none)
    missing = next((n for n in _TORCH_NAME.findall(str(refusal))
                    if n not in names and importlib.util.find_spec(f"torch.{n}") is None), None)
    if missing is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        newer = Version(written_by) > Version(torch.__version__)
    except InvalidVersion:
        newer = False
    fix = (f"upgrade torch to {written_by[:40]} or newer to load it" if newer else
           f"load it under torch {written_by[:40]} (or a torch that has torch.{missing})")
    return (f"it holds torch.{missing}, which torch {torch.__version__} (installed) does not have; its manifest says "
            f"torch {written_by} wrote it, so it is intact if that torch did (a file you do not trust can be made to "
            f"look like this: nothing of it was run). Fix: {fix}")


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def is_int(value: Any, minimum: int = 0, maximum: int = MAX_STEP) -> bool:
    """An exact ``int`` (not a bool) within ``[minimum, maximum]``."""
    return type(value) is int and minimum <= value <= maximum


def _bad(where: str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{where}: {problem}")


def _check_file_name(where: str, name: str, world_size: int) -> None:
    if name in (REPLICATED, DCP_METADATA) or _DCP_FILE.fullmatch(name):
        return
    match = _RANK_FILE.fullmatch(name)
    if match and rank_file(int(match.group(1))) == name and int(match.group(1)) < world_size:
        return
    raise _bad(where, f"lists the file {name!r:.100}, which robustdist never writes (expected replicated.pt, "
                      f"rank_<r>.pt with r < world_size {world_size}, or sharded/ files written by DCP)")


def _check_file_entry(where: str, name: str, entry: Any) -> None:
    if not isinstance(entry, dict) or not is_int(entry.get("size")):
        raise _bad(where, f"the entry for {name!r} is {entry!r:.100}; expected {{'size': int >= 0, 'crc32': hex}}")
    algorithms = [a for a in _HEX if a in entry]
    if not algorithms:
        raise _bad(where, f"the manifest records no checksum for {name}")
    for algorithm in algorithms:
        if not isinstance(entry[algorithm], str) or not _HEX[algorithm].fullmatch(entry[algorithm]):
            raise _bad(where, f"the {algorithm} of {name!r} is {entry[algorithm]!r:.100}; expected lowercase hex")


def check_manifest(where: str, manifest: Any, *, step: int | None) -> dict[str, Any]:
    """Validate a parsed manifest (see the module docstring); ``step``: what the directory name says."""
    if not isinstance(manifest, dict):
        raise _bad(where, f"is a JSON {type(manifest).__name__}; expected an object")
    if manifest.get("format") != FORMAT_VERSION or type(manifest.get("format")) is not int:
        raise _bad(where, f"not a robustdist manifest of format {FORMAT_VERSION} (format {manifest.get('format')!r:.40})")
    if not is_int(manifest.get("step")) or (step is not None and manifest["step"] != step):
        raise _bad(where, f"step is {manifest.get('step')!r:.40}; expected {step if step is not None else 'an int >= 0'}")
    world = manifest.get("world_size")
    if not is_int(world, 1, 1 << 24):
        raise _bad(where, f"world_size is {world!r:.40}; expected an int >= 1")
    files, entries = manifest.get("files"), manifest.get("entries", {})
    if not isinstance(files, dict):
        raise _bad(where, f"files is {type(files).__name__}; expected an object of file entries")
    for name, entry in files.items():
        _check_file_name(where, name, world)
        _check_file_entry(where, name, entry)
    if not isinstance(entries, dict):
        raise _bad(where, f"entries is {type(entries).__name__}; expected an object of entry kinds")
    for name, kind in entries.items():
        if kind not in KINDS:
            raise _bad(where, f"entry {name!r:.100} has kind {kind!r:.40}; expected one of {', '.join(KINDS)}")
    kinds = set(entries.values())
    if kinds - {"sharded"} and REPLICATED not in files:
        raise _bad(where, f"has entries to restore but lists no {REPLICATED}")
    if "sharded" in kinds and DCP_METADATA not in files:
        raise _bad(where, f"has sharded entries but lists no {DCP_METADATA}")
    if not isinstance(manifest.get("metadata", {}), dict):
        raise _bad(where, "metadata is not an object")
    fingerprint = manifest.get("config_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise _bad(where, f"config_fingerprint is {fingerprint!r:.40}; expected a string or null")
    return manifest


def check_replicated(where: str, payload: Any, entries: dict[str, str]) -> dict[str, Any]:
    """``replicated.pt`` must be a dict holding every non-sharded entry, modules as flat tensor dicts."""
    if not isinstance(payload, dict):
        raise _bad(where, f"holds a {type(payload).__name__}; expected a dict of entries")
    for name, kind in entries.items():
        if kind == "sharded":
            continue
        if name not in payload:
            raise _bad(where, f"lacks the entry {name!r} its manifest lists")
        value = payload[name]
        if kind == "module" and not (isinstance(value, dict) and all(
                isinstance(k, str) and (isinstance(t, torch.Tensor) or k.endswith("_extra_state"))
                for k, t in value.items())):
            raise _bad(where, f"entry {name!r} should be a model state dict (str -> tensor), found "
                              f"{type(value).__name__}")
        if kind == "stateful" and not isinstance(value, dict):
            raise _bad(where, f"entry {name!r} should be a state dict, found {type(value).__name__}")
        if kind == "data":
            _refuse_views(where, name, value)
    return payload


def _refuse_views(where: str, name: str, value: Any) -> None:
    """Plain data goes to the user as loaded: an expanded view in it (a 2 KB file holding a (2**18, 2**18) tensor
    over 4 bytes) would allocate hundreds of GB at its first use. The tree is already bounded (check_size)."""
    found = expanded_view(value)
    if found is not None:
        path, t = found
        raise _bad(where, f"entry {name!r}{path} is an expanded tensor view (shape {tuple(t.shape)[:8]}, strides "
                          f"{t.stride()[:8]}: more elements than its storage); robustdist never saves one")


def expanded_view(value: Any) -> tuple[str, torch.Tensor] | None:
    """The first tensor in ``value`` (dicts, lists, tuples) that :func:`overlapping` calls an expanded view, with
    its path (``['key'][0]``); None when there is none. The walk keeps no paths (a million values would cost a
    string each); only a tree that holds such a view is walked again to name where."""
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if overlapping(item):
                return _path_to(value, item), item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def _path_to(value: Any, target: torch.Tensor) -> str:
    """Where ``target`` is in ``value``, as ``['key'][0]``."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if item is target:
            return path
        if isinstance(item, dict):
            stack.extend((f"{path}[{k!r:.40}]", v) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
    return ""


def check_rank_payload(where: str, payload: Any) -> dict[str, Any]:
    """``rank_<r>.pt`` must be ``{"rng": <capture_rng() shape>, "per_rank": dict}``."""
    if not isinstance(payload, dict) or not isinstance(payload.get("per_rank"), dict):
        raise _bad(where, "expected a dict with 'rng' and 'per_rank' entries")
    rng = payload.get("rng")
    problem = _rng_problem(rng)
    if problem:
        raise _bad(where, f"the saved RNG state is malformed ({problem})")
    return payload


def _dense_cpu(t: Any) -> bool:
    """A plain CPU tensor: strided, not quantized or nested, on the CPU (not meta)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized and not t.is_nested
            and t.device.type == "cpu")


def _byte_tensor(t: Any) -> bool:
    return _dense_cpu(t) and t.dtype == torch.uint8 and t.dim() == 1


def _rng_problem(rng: Any) -> str | None:
    if not isinstance(rng, dict):
        return "not a dict"
    python = rng.get("python")
    if not (isinstance(python, list) and len(python) == 3 and is_int(python[0]) and isinstance(python[1], list)
            and len(python[1]) == 625 and all(is_int(x, 0, 2**32) for x in python[1])
            and (python[2] is None or type(python[2]) is float)):
        return "python: expected [version, 625 ints, gauss]"
    numpy = rng.get("numpy")
    if not (isinstance(numpy, dict) and _dense_cpu(numpy.get("keys"))
            and numpy["keys"].dtype == torch.int64 and tuple(numpy["keys"].shape) == (624,)
            and bool(((numpy["keys"] >= 0) & (numpy["keys"] < 2**32)).all()) and is_int(numpy.get("pos"), 0, 624)
            and is_int(numpy.get("has_gauss"), 0, 1) and type(numpy.get("gauss")) is float):
        return "numpy: expected 624 uint32 keys, pos, has_gauss and gauss"
    torch_state = rng.get("torch")
    if not _byte_tensor(torch_state) or torch_state.numel() != torch.get_rng_state().numel():
        return "torch: expected a CPU uint8 tensor of the generator's state size"
    cuda = rng.get("cuda", [])
    if not (isinstance(cuda, list) and len(cuda) <= 4096 and all(_byte_tensor(t) for t in cuda)):
        return "cuda: expected a list of CPU uint8 tensors"
    return _rng_refused(rng)


def _rng_refused(rng: dict[str, Any]) -> str | None:
    """Try each saved state on a scratch generator (well-shaped states can still be refused: a wrong version,
    an index past the state, an all-ones Mersenne Twister state), so restoring them cannot fail later."""
    import random

    import numpy as np

    version, internal, gauss = rng["python"]
    numpy = rng["numpy"]
    trials = (
        ("python", lambda: random.Random().setstate((version, tuple(internal), gauss))),
        ("numpy", lambda: np.random.RandomState().set_state(
            ("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"], numpy["gauss"]))),
        ("torch", lambda: torch.Generator().set_state(rng["torch"])),
    )
    for name, trial in trials:
        try:
            trial()
        except Exception as e:  # ValueError, RuntimeError, TypeError: whatever the generator says
            return f"{name}: the generator refused it ({type(e).__name__}: {str(e)[:120]})"
    if rng.get("cuda") and torch.cuda.is_available():
        for i, state in enumerate(rng["cuda"][: torch.cuda.device_count()]):
            wanted = torch.cuda.default_generators[i].get_state().numel()
            if state.numel() != wanted:
                return f"cuda: device {i}'s state has {state.numel()} bytes, expected {wanted}"
    return None


def check_size(where: str, value: Any, limit: int) -> None:
    """Refuse a payload holding more than ``limit`` values counted as a tree (every use of a shared object
    counts): a pickle can share one container many times (``x = [x, x]`` nested 40 deep is a few bytes),
    and code that walks the result as a tree (an optimizer's ``load_state_dict``) would never finish."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen + len(stack) > limit:  # what waits on the stack counts too: a list that holds itself 2000 times
            # would otherwise grow the stack by 2000 entries a step, to gigabytes, before the count reached limit
            raise _bad(where, f"holds more than {limit} values counted as a tree (shared or repeated references); "
                              "expected no more than its size in bytes")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def overlapping(t: torch.Tensor) -> bool:
    """True when ``t`` has more elements than the storage its strides span (an expanded view): casting or
    copying it (as an optimizer's ``load_state_dict`` does) would materialise a few bytes into gigabytes."""
    if t.layout != torch.strided or t.is_nested or t.numel() <= 1:
        return False
    try:  # a quantized tensor has strides too (an expanded quantized view dequantizes to its full size)
        strides = t.stride()
    except RuntimeError:
        return False
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, strides))
    return t.numel() > span
