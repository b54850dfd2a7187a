"""Pickling and numpy access for tensors whose dtype numpy cannot represent (bfloat16, float8).

What is true on current torch (verified on 2.13): bf16 tensors already pickle; what fails is
``tensor.numpy()`` ("Got unsupported ScalarType BFloat16"), which metric logging and Ray's numpy paths hit,
and the default tensor pickle embeds a whole legacy ``torch.save`` blob per storage, well below memcpy
speed (``benchmarks/RESULTS.md``, P3). And ``torch.save`` consults the global ``copyreg`` dispatch table,
so a careless global patch changes what checkpoints contain.

* :func:`patch_bf16_pickle` registers a ``copyreg`` reducer for ``torch.Tensor`` and ``nn.Parameter``. For
  bfloat16 and the float8 dtypes it pickles the raw bits as a ``uint16``/``uint8`` numpy array (bit-exact,
  NaN payloads included; with protocol 5 the data is a ``PickleBuffer`` that Ray and other protocol-5
  consumers can take out of band). Which bits:

  - normally the tensor's own elements, never a view's whole base storage; it comes back contiguous;
  - when its elements overlap in memory so that there are more of them than storage slots its strides span
    (``expand``, broadcasting, overlapping ``unfold``/``as_strided``), the spanned storage slots plus the
    strides, so the pickle is never larger than that span; it comes back with the same strides (an
    expanded tensor stays expanded, as with torch's own pickle).

  Shape, dtype, device, ``requires_grad`` and ``Parameter``-ness are kept. Every other tensor gets torch's
  own reduction, unchanged: other dtypes, tensors whose data cannot be read (``meta`` device, functorch
  and functionalization wrappers, tensors without storage), and every tensor pickled by ``torch.save`` or
  copied by ``copy.copy``. So checkpoints are byte-identical with and without the patch. torch's
  ``multiprocessing`` shared-memory reductions take precedence in ``ForkingPickler`` as before. Nothing is
  patched at import; :func:`unpatch_bf16_pickle` restores the exact previous entries (a user's own reducer
  included); :func:`bf16_pickle_patch` is the context-manager form.
* Ray: serializers registered on the driver do not reach workers. :func:`install_ray_serializers` registers
  the same representation with ``ray.util.register_serializer`` in the calling process; pass
  ``runtime_env={"worker_process_setup_hook": "robustdist.ray.hook.worker_setup"}`` to ``ray.init`` so
  every worker runs it too, right after the worker first imports torch (``RobustGPUActor`` calls it in its
  own process). :func:`ray_worker_setup`, the former hook, still works but imports torch before Ray sets
  ``OMP_NUM_THREADS``; it warns.
* :func:`to_numpy` upcasts bf16/float8 exactly to float32 (or gives the raw bits); :func:`to_python` gives a
  scalar for metric logging.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import pickle
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from robustdist.runtime import _serialization_compat
from robustdist.runtime.log import warn

__all__ = [
    "bf16_pickle_patch",
    "install_ray_serializers",
    "patch_bf16_pickle",
    "ray_worker_setup",
    "to_numpy",
    "to_python",
    "unpatch_bf16_pickle",
]

_lock = threading.Lock()
_MISSING = object()
_saved: dict[type, Any] = {}  # the dispatch entries we replaced (or _MISSING), while patched


def _raw_dtypes() -> dict[torch.dtype, torch.dtype]:
    """dtype -> the unsigned integer dtype of the same width, for every dtype numpy cannot represent."""
    out = {torch.bfloat16: torch.uint16}
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            out[dtype] = torch.uint8
    return out


RAW_DTYPES = _raw_dtypes()
_BY_NAME = {str(d).removeprefix("torch."): d for d in RAW_DTYPES}


def _torch_reduction_wanted() -> bool:
    """True when the caller is torch.save (which must stay untouched) or copy.copy (which shares storage)."""
    owners = {*_serialization_compat.torch_save_code(), copy.copy.__code__}
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code in owners:
            return True
        frame = frame.f_back
    return False


def _raw_bits(t: torch.Tensor) -> np.ndarray:
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return data.resolve_neg().contiguous().view(RAW_DTYPES[t.dtype]).numpy()


def _data_accessible(t: torch.Tensor) -> bool:
    """False for tensors with no readable data: ``meta``, no storage, functorch/functionalization wrappers."""
    if t.device.type == "meta" or not _serialization_compat.has_storage(t):
        return False
    try:
        t.untyped_storage().data_ptr()  # wrappers raise here ("invalid python storage", "Cannot access storage")
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _eligible(t: torch.Tensor) -> bool:
    return (t.dtype in RAW_DTYPES and t.layout == torch.strided and (t.is_leaf or not t.requires_grad)
            and type(t) in (torch.Tensor, torch.nn.Parameter) and not _serialization_compat.has_python_state(t)
            and _data_accessible(t))


def _span(t: torch.Tensor) -> int:
    """How many storage slots the tensor's strides cover, from its first element to its last (0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _payload(t: torch.Tensor) -> tuple[Any, ...]:
    """The arguments of :func:`_rebuild` for an eligible tensor: its own elements, or, when they overlap so
    that there are more of them than the slots their strides span, that span plus the strides."""
    head = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
    tail = (str(t.device), t.requires_grad, isinstance(t, torch.nn.Parameter))
    span = _span(t)
    if t.numel() <= span:
        return (*head, _raw_bits(t), *tail)
    window = t.detach().as_strided((span,), (1,), t.storage_offset())
    return (*head, _raw_bits(window), *tail, tuple(t.stride()))


def _rebuild(dtype_name: str, shape: tuple[int, ...], raw: np.ndarray, device: str, requires_grad: bool,
             is_param: bool, strides: tuple[int, ...] | None = None) -> torch.Tensor:
    array = raw if raw.flags.writeable else raw.copy()  # out-of-band buffers can be read-only
    t = torch.from_numpy(array).view(_BY_NAME[dtype_name])
    if device != "cpu":
        t = t.to(device)
    t = t.reshape(shape) if strides is None else t.as_strided(shape, strides)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


def _reduce(t: torch.Tensor) -> Any:
    if not _eligible(t) or _torch_reduction_wanted():
        return t.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    return _rebuild, _payload(t)


def patch_bf16_pickle() -> None:
    """Register the reducer for ``torch.Tensor`` and ``nn.Parameter`` in ``copyreg`` (idempotent)."""
    with _lock:
        if _saved:
            return
        for cls in (torch.Tensor, torch.nn.Parameter):
            _saved[cls] = copyreg.dispatch_table.get(cls, _MISSING)
            copyreg.dispatch_table[cls] = _reduce


def unpatch_bf16_pickle() -> None:
    """Restore exactly the dispatch entries that were there before :func:`patch_bf16_pickle`."""
    with _lock:
        for cls, previous in _saved.items():
            if previous is _MISSING:
                copyreg.dispatch_table.pop(cls, None)
            else:
                copyreg.dispatch_table[cls] = previous
        _saved.clear()


@contextlib.contextmanager
def bf16_pickle_patch() -> Iterator[None]:
    """``with bf16_pickle_patch(): ...``: patched inside, previous state restored after (if it patched)."""
    already = bool(_saved)
    patch_bf16_pickle()
    try:
        yield
    finally:
        if not already:
            unpatch_bf16_pickle()


# ------------------------------------------------------------------------------------------------ Ray
def _ray_serialize(t: torch.Tensor) -> Any:
    if _eligible(t):
        return ("raw", *_payload(t))
    return ("torch", t.__reduce_ex__(pickle.DEFAULT_PROTOCOL))  # torch's own reduction for every other tensor


def _ray_deserialize(payload: Any) -> torch.Tensor:
    if payload[0] == "raw":
        return _rebuild(*payload[1:])
    func, args = payload[1][:2]
    return func(*args)


def install_ray_serializers() -> None:
    """Register the bf16/float8 representation with Ray in *this* process (driver or worker)."""
    import ray.util

    for cls in (torch.Tensor, torch.nn.Parameter):
        ray.util.register_serializer(cls, serializer=_ray_serialize, deserializer=_ray_deserialize)


def ray_worker_setup() -> None:
    """Deprecated Ray setup hook: use ``"robustdist.ray.hook.worker_setup"`` (:mod:`robustdist.ray.hook`).

    Still installs the serializers, so old configs keep working, but warns once: importing this module
    imports torch before Ray sets ``OMP_NUM_THREADS`` for the worker, so torch uses every core's threads.
    """
    warn("robustdist.bf16.ray_worker_setup imports torch before Ray sets OMP_NUM_THREADS for this worker, "
         "so torch uses one thread per core of the machine instead of the task's CPUs (oversubscription, "
         "and results that differ in the last bit). Use runtime_env={'worker_process_setup_hook': "
         "'robustdist.ray.hook.worker_setup'} instead: it installs the same serializers after torch is "
         "imported, without changing the thread count", once="bf16.ray_worker_setup")
    install_ray_serializers()


# ------------------------------------------------------------------------------------------------ numpy
def to_numpy(t: torch.Tensor, *, raw: bool = False) -> np.ndarray:
    """``t`` as a numpy array: bf16/float8 exactly upcast to float32 (or ``raw=True``: their bits as
    ``uint16``/``uint8``); other dtypes through ``.detach().cpu().numpy()``."""
    if t.dtype in RAW_DTYPES:
        if raw:
            return _raw_bits(t)
        return t.detach().cpu().to(torch.float32).numpy()
    return t.detach().cpu().resolve_conj().resolve_neg().numpy()


def to_python(t: torch.Tensor | Any) -> Any:
    """A one-element tensor (any dtype) as a python number, for metric logging; other values unchanged."""
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().to(torch.float32).item() if t.dtype in RAW_DTYPES else t.detach().cpu().item()
    return t


