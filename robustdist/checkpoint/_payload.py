"""What goes into a checkpoint: snapshots of live objects, the RNG state, and restoring both.

Everything robustdist writes with ``torch.save`` is made of types ``torch.load(weights_only=True)`` accepts
without any extra allow-listing: tensors, ``torch.dtype``/``torch.Size``/``torch.device``, and plain python
data (dict, OrderedDict, list, tuple, str, bytes, int, float, bool, None). numpy's RNG state is stored as a
tensor and plain ints. A value of another type is refused at *save* time, naming its key, so that a
checkpoint never turns out unloadable (or unsafe) at load time.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from robustdist.checkpoint import _schema
from robustdist.parallel.state_dict import load_model_state_dict, model_state_dict
from robustdist.runtime.errors import CheckpointError

_SCALARS = frozenset({str, bytes, int, float, bool, type(None), torch.dtype, torch.device})
_TENSORS = frozenset({torch.Tensor, nn.Parameter})


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def is_sharded(value: Any) -> bool:
    """True for a module or mapping whose state holds DTensors (FSDP2): it goes through DCP."""
    if isinstance(value, nn.Module):
        return any(_is_dtensor(t) for t in value.state_dict().values())
    if isinstance(value, dict):
        return any(_is_dtensor(t) for t in value.values())
    return False


MAX_VALUES = _schema.MAX_VALUES  # values (tree-counted) in one save: the same bound load() applies
MAX_KEY_CHARS = 4096
MAX_INT_BITS = 2000  # torch.save pickles larger ints as LONG4, which weights_only refuses


def plain(value: Any, path: str, budget: list[int] | None = None) -> Any:
    """``value`` as exactly the types ``torch.load(weights_only=True)`` gives back, or CheckpointError.

    Types are checked exactly, not with ``isinstance``: a subclass (a ``str`` Enum, an ``IntEnum``, a
    ``defaultdict``, a namedtuple, a tensor subclass) would be pickled as itself and refused at load time,
    which would block resume. numpy scalars (``np.float64(0.5)``, ``np.int64``, ``np.bool_``, common in
    metrics) are normalised to the python scalar they hold, and a ``torch.Size`` to the tuple that
    ``weights_only`` loads it as. Tensors are saved detached (an ``nn.Parameter`` loads as a tensor). Containers are rebuilt only where a value inside
    them changed."""
    budget = budget if budget is not None else [MAX_VALUES]
    budget[0] -= 1
    if budget[0] < 0:
        raise CheckpointError(f"checkpoint value {path} is part of a structure of more than {MAX_VALUES} values "
                              "counted as a tree (shared or repeated references); expected plain data of a "
                              "sensible size. Fix: store the data once, or as a tensor.")
    kind = type(value)
    if kind is int and abs(value).bit_length() > MAX_INT_BITS:
        raise CheckpointError(f"checkpoint value {path} is an integer of {abs(value).bit_length()} bits; "
                              f"torch.load(weights_only=True) loads integers of up to about {MAX_INT_BITS} bits. "
                              "Fix: store it as a str.")
    if kind is bytes and not value:
        raise CheckpointError(f"checkpoint value {path} is an empty bytes value (b''), which torch.save pickles as a "
                              "call to bytes() that torch.load(weights_only=True) refuses (a torch limitation); "
                              "expected non-empty bytes. Fix: store None (or a non-empty value) instead.")
    if kind in _TENSORS:
        _check_loadable(value, path)
        return value
    if kind in _SCALARS:
        return value
    if isinstance(value, np.generic) and isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    if kind is torch.Size:  # weights_only gives a torch.Size back as a tuple: save what load returns
        return tuple(value)
    if kind is dict or kind is OrderedDict:
        out, changed = {}, False
        for k, v in value.items():
            key = _plain_key(k, path)
            if type(key) is str and len(key) > MAX_KEY_CHARS:
                raise CheckpointError(f"checkpoint key {path}[{key[:40]!r}...] has {len(key)} characters; expected "
                                      f"at most {MAX_KEY_CHARS}. Fix: shorten it, or store the text as a value.")
            new = plain(v, f"{path}[{k!r}]", budget)
            changed = changed or new is not v or key is not k
            out[key] = new
        return value if not changed else (OrderedDict(out) if kind is OrderedDict else out)
    if kind is list or kind is tuple:
        items = [plain(v, f"{path}[{i}]", budget) for i, v in enumerate(value)]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)
    subclass = next((b.__name__ for b in (str, int, float, bytes, dict, list, tuple, torch.Tensor)
                     if isinstance(value, b)), None)
    what = f" (a subclass of {subclass}: torch.save would pickle the subclass, and weights_only=True refuses it at " \
        "load)" if subclass else ""
    raise CheckpointError(
        f"checkpoint value {path} is a {kind.__module__}.{kind.__qualname__}{what}; expected exactly tensors or plain "
        "data (dict, list, tuple, str, int, float, bool, None), which load safely with weights_only=True. Fix: store "
        "its state_dict() or convert it to plain data (e.g. an Enum's .value, float(x), dict(d))."
    )


def _tensor_kind(t: torch.Tensor) -> tuple[Any, ...]:
    """What decides how torch.save writes ``t``: layout, nested, quantized (and its scheme), dtype."""
    return (t.layout, t.is_nested, t.is_quantized, t.qscheme() if t.is_quantized else None, t.dtype)


_LOADABLE: dict[tuple[Any, ...], str | None] = {}  # tensor kind -> None (loads) or why weights_only refuses it
_PROBE_BYTES = 1 << 16


def _check_loadable(t: torch.Tensor, path: str) -> None:
    """Refuse at save a tensor that this torch's ``torch.load(weights_only=True)`` would refuse at load (torch 2.15
    dropped nested tensors from its allow-list): a save must never load as nothing. A plain strided tensor always
    loads; any other kind is tried once per process with a small tensor of the same kind (``t`` itself when it is
    small, otherwise its first element's worth), and the answer is kept."""
    if t.layout == torch.strided and not t.is_nested and not t.is_quantized:
        return
    kind = _tensor_kind(t)
    if kind not in _LOADABLE:
        _LOADABLE[kind] = _weights_only_refusal(_probe_of(t))
    why = _LOADABLE[kind]
    if why is not None:
        raise CheckpointError(
            f"checkpoint value {path} is a {_kind_name(t)} tensor, which this torch ({torch.__version__}) refuses to "
            f"load with weights_only=True ({why}); expected tensors it loads back, so the checkpoint would be "
            "skipped at resume. Fix: save a plain form (a nested tensor's .unbind() as a list, or "
            ".to_padded_tensor(0); a sparse tensor's .to_dense() or its indices and values).")


def _kind_name(t: torch.Tensor) -> str:
    if t.is_nested:
        return f"nested ({t.layout})"
    if t.is_quantized:
        return f"quantized ({t.qscheme()})"
    return str(t.layout).removeprefix("torch.")


def _probe_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    try:
        small = t.element_size() * max(1, t.numel()) <= _PROBE_BYTES if not t.is_nested else t.numel() < 4096
    except (RuntimeError, NotImplementedError):
        small = False
    if small:
        return t
    if t.is_nested:
        return torch.nested.nested_tensor([torch.zeros(1, dtype=t.dtype), torch.zeros(2, dtype=t.dtype)],
                                          layout=t.layout)
    return t  # a large sparse or quantized tensor: tried as it is, once per kind


def _weights_only_refusal(t: torch.Tensor) -> str | None:
    import io
    import warnings

    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():  # torch's own notices about prototype/deprecated tensor kinds
            warnings.simplefilter("ignore")
            torch.save(t, buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
    except Exception as e:  # an UnpicklingError or whatever the refused rebuild raises
        return _schema.weights_only_reason(e)
    return None


def json_metadata(metadata: Any) -> dict[str, Any]:
    """``save(metadata=...)`` as the JSON object the manifest stores (CheckpointError if it is not one)."""
    import json

    if metadata is None:
        return {}
    try:
        if not isinstance(metadata, dict):
            raise TypeError(f"a {type(metadata).__name__}, not a dict")
        text = json.dumps(metadata, allow_nan=False)
        if len(text) > 1 << 20:
            raise ValueError(f"{len(text)} characters of JSON, more than the 1 MiB the manifest allows for it")
        return json.loads(text)
    except (TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"metadata is not plain JSON data ({str(e)[:200]}); expected a dict of str, numbers, "
                              "bools, None, lists and dicts. Fix: convert it, or put the value in state.") from e


def _plain_key(key: Any, path: str) -> Any:
    if isinstance(key, np.integer):
        key = int(key)
    if type(key) is str or (type(key) is int and abs(key) < 2**61 - 1):
        return key
    raise CheckpointError(f"checkpoint key {path}[{key!r:.80}] is a {type(key).__name__}; expected str keys or int "
                          "keys below 2**61 - 1 in magnitude, which load safely. Fix: convert the key (e.g. to a str).")


def _dense(t: torch.Tensor) -> bool:
    """A plain strided tensor whose elements each have their own memory (a reusable staging buffer fits it)."""
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.numel() == 0:
        return False
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.numel() == span and all(s >= 0 for s in t.stride())


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` that torch.save writes exactly as it writes ``t``: an expanded or overlapping view
    keeps its strides over a copy of its storage (not a materialised copy, which could be far larger)."""
    if t.device.type != "cpu":
        return t.to("cpu")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return t.clone()
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


def snapshot(value: Any, *, clone: bool, staging: dict[tuple[Any, ...], torch.Tensor] | None = None,
             key: tuple[Any, ...] = ()) -> Any:
    """A CPU copy of ``value`` (tensors detached; copied when ``clone``, for saving in the background).

    With ``staging`` (a dict kept between saves), a copy goes into the buffer the previous save used for the
    same ``key`` (the path of entry names and container keys, so no two tensors of one save share a buffer)
    when shape, dtype and strides match: copying into memory already mapped is several times faster than
    allocating a fresh copy (benchmarks/findings.md), which is what an async save blocks on."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if not clone:
            return t.to("cpu") if t.device.type != "cpu" else t
        if staging is None or not _dense(t):
            return _copy(t)
        buf = staging.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.stride() != t.stride() \
                or buf.data_ptr() == t.data_ptr():
            buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            staging[key] = buf
        return buf.copy_(t)
    def child(k: Any, v: Any) -> Any:
        return snapshot(v, clone=clone, staging=staging, key=(*key, k))
    if isinstance(value, dict):
        return type(value)((k, child(k, v)) for k, v in value.items()) if isinstance(value, OrderedDict) \
            else {k: child(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [child(i, v) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(child(i, v) for i, v in enumerate(value))
    return value


def refuse_views(value: Any, path: str) -> None:
    """Plain data and an object's state must hold no expanded tensor view: load refuses one (plain data goes to the
    user as loaded, an object's state to its ``load_state_dict``, and a first use could materialise a few bytes into
    gigabytes), so it is refused here, at save."""
    found = _schema.expanded_view(value)
    if found is not None:
        where, t = found
        raise CheckpointError(
            f"checkpoint value {path}{where} is an expanded tensor view (shape {tuple(t.shape)[:8]}, strides "
            f"{t.stride()[:8]}: more elements than the storage it spans), which load refuses. "
            "Fix: save value.clone() (or .contiguous()), or the small tensor it was expanded from.")


def entry_state(name: str, value: Any) -> tuple[str, Any]:
    """``(kind, state)`` for one entry of the user's ``state`` dict."""
    if isinstance(value, nn.Module):
        return "module", model_state_dict(value)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return "stateful", value.state_dict()
    return "data", value


def scaler_skips(live: Any, saved: Any) -> bool:
    """A ``GradScaler`` with nothing to restore: a disabled live scaler (its load is a no-op), or a saved state of
    ``{}`` (saved disabled: bf16 then, fp16 now), which torch's load refuses. The live scaler keeps its state."""
    return isinstance(live, torch.amp.GradScaler) and (not live.is_enabled() or saved == {})


def restore_entry(name: str, live: Any, saved: Any, kind: str) -> None:
    """Load ``saved`` into the live object ``live`` (modules prefix-tolerantly)."""
    if kind == "module":
        load_model_state_dict(live, saved)
    elif kind == "stateful":
        if scaler_skips(live, saved):
            return
        live.load_state_dict(saved)
    # plain data has no live object to restore into: it is returned in LoadedCheckpoint.state


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    rng: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": {"keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    n = rng["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


def reseed(step: int, rank: int) -> None:
    """Deterministic RNG for a rank that has no saved RNG state (the world grew on resume)."""
    seed = int(np.random.SeedSequence([step, rank, 0x5EED]).generate_state(1, np.uint32)[0])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
