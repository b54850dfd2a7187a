"""Saved state checked against the live objects it is restored into, before anything is restored (step 2 of
the load protocol in :mod:`._loading`). Nothing here changes a live object.

torch's ``load_state_dict`` trusts what it is given: an optimizer takes any parameter groups and per-parameter
state, and a scheduler or grad scaler copies the saved dict into its ``__dict__``. A checksum-valid but forged
state would be accepted and break the next ``step()`` (AttributeError, KeyError, ZeroDivisionError). So:

* a module's state dict must fit the live module: the same keys (after adapting prefixes), shapes and dtypes
  (:func:`check_module`, a dry run of :func:`robustdist.parallel.state_dict.load_model_state_dict`);
* an optimizer's (:func:`check_optimizer`) must have the live optimizer's layout (as many groups, as many
  parameters in each), each group the live group's keys with values of the same kinds (numbers stay numbers,
  bools bools, tuples of numbers such tuples; an option flag a newer torch added may be missing, as torch fills
  it in, and so may ``initial_lr``, which an LR scheduler attached after the save adds), state only for
  listed parameters, each a dict of tensors (dense, with the parameter's shape, or a scalar: 0-d or one
  element, as ``step`` always is) and numbers; where the live optimizer already has state for the parameter,
  the same keys of the same kinds and shapes. (Optimizers whose state holds other shapes or lists, such as
  LBFGS, are refused; Adafactor's factored moments are allowed.)
* a scheduler's or grad scaler's (:func:`check_same_keys`): only keys the live state has, each of the same
  kind, no NaN or infinity where the live value is finite, and no zero or negative number where the live value
  is a positive int (a step size, a period, a total: the scheduler divides by it).

A layout that differs from the live object's (another model or optimizer) is the caller's mismatch, a
:class:`~robustdist.runtime.errors.CheckpointError` that says so; anything else is a
:class:`~robustdist.runtime.errors.CheckpointCorruptError` naming the entry and the key. Either way ``load()`` falls
back to an older checkpoint before anything is restored.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from robustdist.checkpoint._schema import overlapping
from robustdist.parallel.state_dict import load_model_state_dict, unwrap_model
from robustdist.runtime import _torch_compat
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError, StateDictMismatchError

__all__ = ["check_module", "check_optimizer", "check_same_keys", "validated"]

_COUNTERS = frozenset({"last_epoch", "_step_count"})  # counters: 0 is valid whatever the live value
_OPTIONAL_GROUP_KEYS = frozenset({"param_names", "initial_lr"})
_SHOWN = 8
# torch's stateful classes whose load_state_dict copies the saved dict into __dict__
DICT_UPDATERS = (torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def _bad(where: str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{where}: {problem}")


def validated(live: Any) -> bool:
    """Whether a live object's restore is fully checked here first (so restoring it cannot fail)."""
    return isinstance(live, (nn.Module, torch.optim.Optimizer, *DICT_UPDATERS))


class _DryRun(nn.Module):
    """Hands ``load_model_state_dict`` the live module's state dict and ignores the load: its checks only."""

    def __init__(self, target: nn.Module):
        super().__init__()
        self.__dict__["_target"] = target

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.__dict__["_target"].state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """What would be loaded (keys, shapes and dtypes already matched): each tensor must be copyable."""
        own = self.state_dict()
        for name, value in state_dict.items():
            mine = own.get(name)
            if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor):
                if value.layout != mine.layout or value.is_quantized != mine.is_quantized \
                        or value.is_nested or value.device.type == "meta":
                    raise CheckpointCorruptError(
                        f"the saved tensor {name!r:.80} is a {value.layout} {value.device.type} tensor"
                        f"{' (quantized)' if value.is_quantized else ''}; the live module's is a {mine.layout} "
                        f"tensor{' (quantized)' if mine.is_quantized else ''}")
        return None


def check_module(where: str, live: nn.Module, saved: dict[str, Any]) -> None:
    """The checks ``load_model_state_dict`` makes before it loads anything, without loading."""
    try:
        load_model_state_dict(_DryRun(unwrap_model(live)), saved)
    except StateDictMismatchError as e:
        raise CheckpointError(f"{where} does not fit the live {type(unwrap_model(live)).__name__} (the checkpoint "
                              f"is not corrupt: the live model differs from the one saved): {e}") from e


def _kind(value: Any) -> str:
    if value is None:
        return "none"
    if type(value) is bool:
        return "bool"
    for kind, types in (("number", (int, float)), ("tensor", torch.Tensor), ("text", (str, bytes)),
                        ("list", list), ("tuple", tuple), ("mapping", dict)):
        if isinstance(value, types):
            return kind
    return type(value).__name__


def _tensor_problem(t: torch.Tensor, noun: str = "state") -> str | None:
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
        return (f"holds a {'meta ' if t.device.type == 'meta' else ''}{t.layout} "
                f"{'quantized ' if t.is_quantized else ''}tensor; expected dense {noun}")
    if overlapping(t):
        return (f"holds an expanded tensor view (shape {tuple(t.shape)[:8]}, strides {t.stride()[:8]}); expected "
                f"densely stored {noun}")
    return None


tensor_problem = _tensor_problem
"""Why a saved tensor cannot be object state whatever the live object is (None when it can): ``_verify``'s check."""


def mismatch(saved: Any, live: Any, key: Any) -> str | None:
    """Why ``saved`` cannot replace the live value ``live`` of ``key`` (None when it can)."""
    s, k = _kind(saved), _kind(live)
    if k == "none":  # an optional scalar setting (foreach=None, a scheduler's custom scale function)
        return None if s in ("none", "bool", "number", "text") else f"is a {s}; the live value is None"
    if s == "none":
        return None if k == "bool" else f"is None; the live value is a {k}"
    if s != k:
        return f"is a {s}; the live value is a {k}"
    if k == "number":
        if not math.isfinite(saved) and math.isfinite(live):
            return f"is {saved}; the live value is a finite number"
        if type(live) is int and live > 0 and saved <= 0 and key not in _COUNTERS:
            return f"is {saved}; the live value is a positive int ({live}), which the object may divide by"
    elif k == "tensor":
        problem = _tensor_problem(saved)
        if problem or saved.shape != live.shape:
            return problem or f"is a tensor of shape {tuple(saved.shape)[:8]}; the live one has {tuple(live.shape)}"
    elif k in ("list", "tuple"):
        if len(saved) != len(live):
            return f"has {len(saved)} items; the live value has {len(live)}"
        for i, (a, b) in enumerate(zip(saved, live)):
            problem = mismatch(a, b, key)
            if problem:
                return f"item {i} {problem}"
    elif k == "mapping":
        extra = [str(x) for x in saved if x not in live]
        if extra:
            return f"has keys the live value lacks ({', '.join(extra[:_SHOWN])[:200]})"
        for name, value in saved.items():
            problem = mismatch(value, live[name], name)
            if problem:
                return f"key {name!r:.40} {problem}"
    return None


def _sizes(groups: list[Any]) -> str:
    shown = ", ".join(str(len(g["params"])) for g in groups[:_SHOWN])
    return f"{len(groups)} parameter group(s) of [{shown}{', ...' if len(groups) > _SHOWN else ''}] parameters"


def _check_layout(where: str, live: torch.optim.Optimizer, saved: Any) -> list[dict[str, Any]]:
    if not (isinstance(saved, dict) and set(saved) == {"state", "param_groups"} and isinstance(saved["state"], dict)
            and isinstance(saved["param_groups"], list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"])):
        raise _bad(where, "is not the state dict of an optimizer ({'state': dict, 'param_groups': [{'params': "
                          "list, ...}]})")
    groups = saved["param_groups"]
    for group in groups:
        if not all(type(i) in (int, str) for i in group["params"]):
            raise _bad(where, "a parameter group lists parameter ids that are not ints or strings")
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in live.param_groups]:
        raise CheckpointError(
            f"{where}: the saved optimizer has {_sizes(groups)}; the live {type(live).__name__} has "
            f"{_sizes(live.param_groups)}. The checkpoint is not corrupt: the live model or optimizer differs from "
            "the one saved. Fix: build the same model and optimizer (the same parameter groups, in the same order) "
            "as when saving, or load a checkpoint saved from this setup.")
    return groups


def _check_group(where: str, i: int, saved: dict[str, Any], live: dict[str, Any], owner: str) -> None:
    for key, value in live.items():
        if key == "params":
            continue
        if key not in saved:
            if key in _OPTIONAL_GROUP_KEYS or _kind(value) in ("bool", "none"):
                continue  # an option flag a newer torch added (the optimizer's __setstate__ fills it in), or a key
                # torch keeps from the live group or adds later (an LR scheduler attached after the save)
            raise _bad(where, f"parameter group {i} lacks {key!r:.40}, which the live {owner}'s groups have")
        problem = mismatch(saved[key], value, key)
        if problem:
            raise _bad(where, f"parameter group {i} key {key!r:.40} {problem}")


def _state_problem(name: str, value: Any, param: torch.Tensor, live: Any, factored: bool) -> str | None:
    """Why one saved per-parameter state value is implausible for ``param`` (``live``: the live value, if any)."""
    if _kind(value) == "number":
        scalar_ok = live is None or _kind(live) == "number" or (isinstance(live, torch.Tensor) and live.numel() <= 1)
        return None if scalar_ok else "is a number; the live optimizer keeps a tensor of the parameter's shape"
    if not isinstance(value, torch.Tensor):
        return f"is a {_kind(value)}; expected a tensor or a number"
    problem = _tensor_problem(value, "optimizer state")
    if problem:
        return problem
    shape, want = tuple(value.shape), tuple(param.shape)
    if isinstance(live, torch.Tensor):
        same = shape == tuple(live.shape) or (value.numel() <= 1 and live.numel() <= 1)
        return None if same else f"has shape {shape[:8]}; the live optimizer's has {tuple(live.shape)}"
    if live is not None:
        return f"is a tensor; the live optimizer keeps a {_kind(live)}"
    if value.numel() <= 1:
        return None
    if name == "step":
        return f"has shape {shape[:8]}; expected a scalar step count"
    if shape == want or (factored and len(shape) == len(want) and all(a in (b, 1) for a, b in zip(shape, want))):
        return None
    return f"has shape {shape[:8]}; expected the parameter's shape {want} or a scalar"


def check_optimizer(where: str, live: torch.optim.Optimizer, saved: Any) -> None:
    """A saved optimizer state dict must fit the live optimizer (see the module docstring)."""
    groups = _check_layout(where, live, saved)
    owner = type(live).__name__
    ids: dict[Any, torch.Tensor] = {}
    for i, (saved_group, live_group) in enumerate(zip(groups, live.param_groups)):
        _check_group(where, i, saved_group, live_group, owner)
        ids.update(zip(saved_group["params"], live_group["params"]))
    factored = owner == "Adafactor"
    for key, state in saved["state"].items():
        if key not in ids:
            raise _bad(where, f"holds state for parameter {key!r:.40}, which no parameter group lists")
        if not isinstance(state, dict) or not all(type(n) is str for n in state):
            raise _bad(where, f"the state of parameter {key!r:.40} is not a dict of named values")
        param = ids[key]
        own = live.state.get(param) or {}
        if own and set(state) != set(own):
            raise _bad(where, f"the state of parameter {key!r:.40} has keys {sorted(state)[:_SHOWN]}; the live "
                              f"{owner} keeps {sorted(own)[:_SHOWN]}")
        for name, value in state.items():
            problem = _state_problem(name, value, param, own.get(name), factored)
            if problem:
                raise _bad(where, f"the state of parameter {key!r:.40} key {name!r:.40} {problem}")


def check_same_keys(where: str, live: Any, saved: Any) -> None:
    """For torch's own stateful objects whose ``load_state_dict`` updates ``__dict__`` (LR schedulers, grad
    scalers): the saved state may only hold keys the live state has (fewer is fine: another torch version),
    each of the same kind (see :func:`mismatch`), so it cannot replace a method, an attribute of another type,
    or a number the object divides by with zero."""
    current = live.state_dict()
    if not isinstance(saved, dict) or not set(saved) <= set(current):
        extra = sorted(map(str, set(saved) - set(current))) if isinstance(saved, dict) else []
        raise _bad(where, f"does not have the keys of a {type(live).__name__} state dict"
                          + (f" (unexpected: {', '.join(extra)[:200]})" if extra else ""))
    for key, value in saved.items():
        if key in ("lr_lambdas", _torch_compat.SCHEDULERS_KEY):
            continue  # checked below
        problem = mismatch(value, current[key], key)
        if problem:
            raise _bad(where, f"key {key!r:.40} {problem} (in the live {type(live).__name__})")
    if "lr_lambdas" in saved:  # LambdaLR & co. update each callable object's __dict__ with its saved dict
        lambdas, live_lambdas = saved["lr_lambdas"], current["lr_lambdas"]
        if not (isinstance(lambdas, list) and isinstance(live_lambdas, list) and len(lambdas) == len(live_lambdas)
                and all(a is None or (isinstance(a, dict) and isinstance(b, dict) and set(a) <= set(b))
                        for a, b in zip(lambdas, live_lambdas))):
            raise _bad(where, "lr_lambdas does not match the live scheduler's (it may only restore attributes "
                              "its callable objects have)")
    inner = _torch_compat.inner_schedulers(live)  # SequentialLR, ChainedScheduler: one state per inner scheduler
    key = _torch_compat.SCHEDULERS_KEY
    if key in saved:
        if not (isinstance(inner, list) and isinstance(saved[key], list) and len(saved[key]) == len(inner)):
            raise _bad(where, f"holds a different number of inner schedulers than the live {type(live).__name__}")
        for i, (child, child_saved) in enumerate(zip(inner, saved[key])):
            check_same_keys(f"{where} inner scheduler {i}", child, child_saved)


FILE_CAP_FLOOR = 1 << 30
"""Bytes any payload file may hold, whatever the live state (plain data has no live size to go by)."""
FILE_CAP_RATIO = 100
"""A payload file may hold this many times the bytes of the live tensors it is restored into (an optimizer's state
is two or three times its parameters; a model of N bytes never needs a file of 100 N)."""


def tensor_bytes(value: Any, budget: int = 1_000_000) -> int:
    """The bytes of the tensors a live value holds: a module's parameters and buffers, an optimizer's parameters
    and state, the tensors in any other object's state dict or in plain data (at most ``budget`` values walked)."""
    if isinstance(value, nn.Module):
        return sum(t.numel() * t.element_size() for t in (*value.parameters(), *value.buffers()))
    if isinstance(value, torch.optim.Optimizer):
        params = [p for group in value.param_groups for p in group["params"]]
        return sum(p.numel() * p.element_size() for p in params) + tensor_bytes(list(value.state.values()), budget)
    if not isinstance(value, (dict, list, tuple, torch.Tensor)) and callable(getattr(value, "state_dict", None)):
        try:
            value = value.state_dict()
        except Exception:  # a live object whose state cannot be taken counts as holding none
            return 0
    total, stack = 0, [value]
    while stack and budget > 0:
        item, budget = stack.pop(), budget - 1
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def file_cap(live: list[Any], override: int | None) -> int:
    """The largest payload file restoring into ``live`` may read: ``override``, or
    :data:`FILE_CAP_FLOOR` plus :data:`FILE_CAP_RATIO` times the live tensors' bytes."""
    if override is not None:
        return override
    return FILE_CAP_FLOOR + FILE_CAP_RATIO * sum(tensor_bytes(v) for v in live)


def check_file_size(path: str, size: int, live: list[Any], override: int | None) -> None:
    """Refuse, before reading it, a payload file larger than the live state it fills can need: a
    :class:`CheckpointError`, not a corrupt verdict (``verify-checkpoint``, which has no live state, passes the
    step, and the step is never treated as damaged)."""
    cap = file_cap(live, override)
    if size > cap:
        how = "the max_file_bytes you passed" if override is not None else (
            f"{FILE_CAP_RATIO} times the {sum(tensor_bytes(v) for v in live)} bytes of live tensors it is restored "
            f"into, plus {FILE_CAP_FLOOR >> 20} MiB")
        raise CheckpointError(  # a judgment against the live state, as a shape mismatch is: not corruption
            f"{path}: {size} bytes, more than a payload restoring into the live state can need ({cap} bytes: {how}); "
            "refused without reading it (not found corrupt). Fix: if this checkpoint is yours and its plain data "
            "really is that large, pass AtomicCheckpointer(..., max_file_bytes=N) with N at least its size")
