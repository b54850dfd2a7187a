"""The parts :func:`robustdist.parallel.fsdp.wrap_fsdp` is built from: which modules get their own ``fully_shard``,
the ``fully_shard`` keyword arguments, and materialising a meta-device model.

Which modules (``shard_policy`` / ``fsdp.shard_modules``), bottom-up as FSDP2 wants (children before their
parents), the root always last and handled by the caller:

* ``"auto"``: every direct element of an ``nn.ModuleList`` that holds parameters (transformer blocks), the
  outermost lists only (a block's own list of heads or experts is not split further); none when the model
  has no ``ModuleList`` (only the root is sharded);
* class names (config) or classes (``shard_policy``): modules whose ``type(m).__name__`` is named, or that
  are instances of a given class. A name or class that matches no submodule is a ConfigError listing the
  classes the model does contain;
* a callable ``(module) -> bool``.

Materialising a meta-device model (after sharding, so each rank only ever allocates its shard):

1. ``to_empty(device=...)`` (to the CPU under CPU offload);
2. every parameter and buffer is marked uninitialised: floating/complex tensors are filled with NaN (each
   rank its local shard), and for the others the tensor's version counter is noted;
3. the init runs under ``torch.no_grad()``: ``init_weights(model)`` when given, else the root's
   ``reset_parameters()`` if it has one, and then, for whatever is still uninitialised, the
   ``reset_parameters()`` of the highest submodules whose tensors are *all* still uninitialised (so
   nothing already initialised is overwritten; a warning names them when the root's own method missed
   them). A buffer the init re-creates (``self.freqs = ...``, ``register_buffer``) counts as initialised;
4. anything still uninitialised on any rank (the ranks agree through an ``all_gather_object`` per check) is a
   ConfigError naming it and the fix (``init_weights=``). Buffers are then moved to the compute device.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from robustdist.runtime import _torch_compat
from robustdist.runtime import dist as _dist
from robustdist.runtime.errors import ConfigError
from robustdist.runtime.log import get_logger, warn

log = get_logger(__name__)

Policy = Callable[[nn.Module], bool]
SHOWN = 8  # names listed in a message; the rest are counted


# ---------------------------------------------------------------------------------------------- which modules
def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def class_name(module: nn.Module) -> str:
    """The module's own class name (``fully_shard`` swaps in a class named ``FSDP<name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _classes_in(model: nn.Module) -> list[str]:
    return sorted({class_name(m) for m in model.modules()})


def _no_match(what: str, missing: list[str], model: nn.Module, fix: str) -> ConfigError:
    present = _classes_in(model)
    lowered = {p.lower(): p for p in present}
    hints = []
    for name in missing:
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        if close:
            hints.append(f"did you mean {lowered[close[0]]!r} for {name!r}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return ConfigError(
        f"{what} names {', '.join(map(repr, missing))}, but no module of {class_name(model)} is of "
        f"{'that class' if len(missing) == 1 else 'those classes'}{hint}; expected class names of its modules: "
        f"{', '.join(present)}. Fix: {fix}", rank=_dist.error_rank())


def resolve_policy(shard_policy: Any, shard_modules: tuple[str, ...] | str, model: nn.Module) -> tuple[Policy, str]:
    """The predicate that picks submodules for their own ``fully_shard``, and its description for the log.
    ``shard_policy`` (classes, class names, or a callable) overrides ``shard_modules`` (config)."""
    if shard_policy is None or shard_policy == "auto":
        if shard_modules == "auto" or shard_policy == "auto":
            return _auto_policy(model), "auto (the elements of every nn.ModuleList)"
        names = tuple(shard_modules)
        return _names_policy(names, model, "fsdp.shard_modules", "correct fsdp.shard_modules, or use 'auto'."), \
            f"fsdp.shard_modules={list(names)}"
    if isinstance(shard_policy, (type, str)):
        shard_policy = (shard_policy,)
    if callable(shard_policy):
        return shard_policy, f"shard_policy={getattr(shard_policy, '__name__', repr(shard_policy))}"
    if isinstance(shard_policy, Iterable):
        items = tuple(shard_policy)
        if all(isinstance(i, (type, str)) for i in items):
            classes = tuple(i for i in items if isinstance(i, type))
            names = tuple(i for i in items if isinstance(i, str))
            fix = "pass classes (or class names) that the model contains, or a callable (module) -> bool."
            by_name = _names_policy(names, model, "shard_policy", fix) if names else None
            missing = [c.__name__ for c in classes if not any(isinstance(m, c) for m in model.modules())]
            if missing:
                raise _no_match("shard_policy", missing, model, fix)
            return (lambda m: isinstance(m, classes) or (by_name is not None and by_name(m))), \
                f"shard_policy={[getattr(i, '__name__', i) for i in items]}"
    raise ConfigError(f"shard_policy={shard_policy!r}; expected module classes, class names, or a callable "
                      "(module) -> bool. Fix: pass e.g. shard_policy={TransformerBlock} or "
                      "shard_policy=lambda m: isinstance(m, TransformerBlock).", rank=_dist.error_rank())


def _names_policy(names: tuple[str, ...], model: nn.Module, what: str, fix: str) -> Policy:
    present = set(_classes_in(model))
    missing = [n for n in names if n not in present]
    if missing:
        raise _no_match(what, missing, model, fix)
    wanted = frozenset(names)
    return lambda m: class_name(m) in wanted


def _auto_policy(model: nn.Module) -> Policy:
    """The elements of the outermost ``nn.ModuleList`` s (not a block's own lists, e.g. of heads or experts)."""
    members: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(f"{p}.") for p in members):
            members.update({f"{name}.{key}" if name else key: id(child) for key, child in m.named_children()})
    chosen = set(members.values())
    return lambda m: id(m) in chosen


def select_modules(model: nn.Module, policy: Policy) -> list[tuple[str, nn.Module]]:
    """The submodules (not the root) ``policy`` picks that hold parameters, children before parents."""
    chosen = []
    for name, module in reversed(list(model.named_modules())):
        if module is model or not policy(module):
            continue
        if next(module.parameters(), None) is None:
            log.debug("%s (%s) holds no parameters: not sharded on its own", name, class_name(module))
            continue
        chosen.append((name, module))
    return chosen


def mesh_of(model: nn.Module) -> Any:
    """The device mesh of the first DTensor parameter (an already sharded submodule), or None."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


# ---------------------------------------------------------------------------------------------- fully_shard kwargs
def fully_shard_kwargs(mesh: Any, *, mixed_precision: str | None, cpu_offload: bool,
                       reshard_after_forward: bool) -> dict[str, Any]:
    """``fully_shard`` keyword arguments: the mesh, ``reshard_after_forward``, a ``MixedPrecisionPolicy``
    (bf16/fp16 parameters, fp32 reductions) and a ``CPUOffloadPolicy`` (pinned memory only with CUDA)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if mixed_precision is not None:
        if mixed_precision not in dtypes:
            raise ConfigError(f"fsdp.mixed_precision={mixed_precision!r}; expected None, 'bf16' or 'fp16'. Fix: pass "
                              "one of those.", rank=_dist.error_rank())
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtypes[mixed_precision], reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return kwargs


# ---------------------------------------------------------------------------------------------- meta models
def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def meta_state(model: nn.Module) -> bool:
    """True when every parameter and buffer is on the meta device, False when none is; mixed is refused."""
    tensors = _tensors(model)
    meta = [n for n, t in tensors.items() if t.is_meta]
    if not meta:
        return False
    if len(meta) == len(tensors):
        return True
    real = [n for n, t in tensors.items() if not t.is_meta]
    raise ConfigError(
        f"{class_name(model)} has {len(meta)} tensor(s) on the meta device ({_show(meta)}) and {len(real)} "
        f"elsewhere ({_show(real)}); expected all of them on meta (materialised after sharding) or none. Fix: "
        "build the whole model under `with torch.device('meta'):`, or materialise it before wrap_fsdp.",
        rank=_dist.error_rank())


def _show(names: list[str]) -> str:
    more = f", ... ({len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _marks(model: nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Mark every tensor uninitialised: NaN in floating ones, the version counter of the others."""
    marks: dict[str, tuple[torch.Tensor, int | None]] = {}
    with torch.no_grad():
        for name, t in _tensors(model).items():
            if t.is_floating_point() or t.is_complex():
                _local(t).fill_(float("nan"))
                marks[name] = (t, None)
            else:
                marks[name] = (t, _torch_compat.tensor_version(t))
    return marks


def _uninitialised(model: nn.Module, marks: dict[str, tuple[torch.Tensor, int | None]]) -> list[str]:
    """Names still uninitialised on *any* rank (one all_gather_object when a group of several is up)."""
    now = _tensors(model)
    mine = []
    with torch.no_grad():
        for name, (before, version) in marks.items():
            t = now.get(name)
            if t is None or t is not before:
                continue  # removed or re-created by the init
            if bool(torch.isnan(_local(t)).any()) if version is None else _torch_compat.tensor_version(t) == version:
                mine.append(name)
    if not _dist.is_multi():
        return mine
    found = set().union(*_dist.gather_objects(mine))
    return [n for n in marks if n in found]


def _gap_modules(model: nn.Module, missing: set[str]) -> list[tuple[str, nn.Module]]:
    """The highest submodules with ``reset_parameters`` whose tensors are all in ``missing``."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or not callable(getattr(module, "reset_parameters", None)):
            continue
        if any(name.startswith(f"{c}.") for c, _ in chosen):
            continue
        owned = {f"{name}.{n}" for n in _tensors(module)}
        if owned and owned <= missing:
            chosen.append((name, module))
    return chosen


def materialise(model: nn.Module, device: torch.device, init_weights: Callable[[nn.Module], Any] | None, *,
                cpu_offload: bool = False) -> None:
    """Materialise a (sharded) meta-device ``model`` on ``device`` and initialise it (module docstring)."""
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    marks = _marks(model)
    with torch.no_grad():
        how = _initialise(model, marks, init_weights)
    missing = _uninitialised(model, marks)
    if missing:
        raise ConfigError(
            f"{class_name(model)} was built on the meta device; after to_empty() and {how}, {len(missing)} "
            f"tensor(s) are still uninitialised: {_show(missing)}; expected every parameter and buffer to be "
            "initialised (or re-created, for buffers). Fix: pass init_weights=fn (harden(..., init_weights=fn) or "
            "wrap_fsdp(..., init_weights=fn)), where fn(model) initialises them in place, or give their modules a "
            "reset_parameters().", rank=_dist.error_rank())
    _buffers_to(model, device)
    log.info("materialised %s from the meta device on %s with %s", class_name(model), device, how)


def _initialise(model: nn.Module, marks: dict[str, tuple[torch.Tensor, int | None]],
                init_weights: Callable[[nn.Module], Any] | None) -> str:
    """Run the init path; return how it was initialised, for messages."""
    root = class_name(model)
    if init_weights is not None:
        init_weights(model)
        return f"init_weights={getattr(init_weights, '__name__', repr(init_weights))}"
    own = callable(getattr(model, "reset_parameters", None))
    if own:
        model.reset_parameters()
    missing = _uninitialised(model, marks)
    gaps = _gap_modules(model, set(missing))
    if own and gaps:
        warn(f"{root}.reset_parameters() left {_show(missing)} uninitialised after to_empty(); robustdist called "
             f"reset_parameters() of {_show([n for n, _ in gaps])} for them. Fix: make {root}.reset_parameters() "
             "initialise every parameter and buffer, or pass init_weights=.", once=("fsdp-init-gaps", root))
    for _, module in gaps:
        module.reset_parameters()
    if own:
        return f"{root}.reset_parameters()" + (" and its submodules' reset_parameters()" if gaps else "")
    return (f"its submodules' reset_parameters() ({root} has none itself)" if gaps
            else f"no init (neither {root} nor the modules holding them have reset_parameters())")


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Put every buffer on the compute device (an init may re-create them elsewhere; CPU offload keeps
    parameters on the CPU but not buffers, which FSDP does not manage)."""
    for module in model.modules():
        buffers = _torch_compat.module_buffers(module)
        for name, buf in buffers.items():
            if buf is not None and not _on(buf, device):
                buffers[name] = buf.to(device)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)
