"""The opcode scan's rules for the tensors a pickle rebuilds (a part of :mod:`._pickle_scan`'s stack machine).

torch's weights-only unpickler calls torch's rebuild functions with whatever arguments a pickle gives. What
torch.save writes, and so what these rules let through:

* a rebuild call's arguments are the tuple written right after it (after ``func`` and a type, inside
  ``_rebuild_from_type_v2(func, type, args, state)``), standing for at most :data:`MAX_TENSOR_ARGS` values;
* its backward hooks are an ``OrderedDict()`` made empty for that call and kept so (torch.save never saves hooks:
  whatever sits there is set on the tensor, past every check that walks the loaded payload);
* an *expanded view* (more elements than the storage its sizes and strides span, e.g. a stride-0 tensor of 2**26
  elements over one) is never an argument of another call. A view costs nothing until something copies it, and
  some rebuilds do: a per-channel quantizer's scales and zero points, a nested tensor's sizes and strides (1 GiB
  from a 1.3 KB file). The scan reads the sizes and strides a rebuild is given (the integers pushed for them) to
  tell; one it cannot read counts as expanded.
"""

from __future__ import annotations

from array import array
from typing import Any

from robustdist.runtime._serialization_compat import FROM_TYPE, REBUILD_HOOKS_AT

MAX_TENSOR_ARGS = 1024
"""Values a tensor's rebuild arguments may stand for (its storage, up to 64 sizes and strides, a few flags)."""
MAX_DIMS = 64
EMPTY_OD = 4  # flags: an OrderedDict made with no arguments
FROZEN = 8  # a tensor's backward hooks: nothing may be added to it
EXPANDED = 16  # an expanded tensor view, or a value holding one
_SHAPED = frozenset(c for c in REBUILD_HOOKS_AT if "_rebuild_tensor" in c or "_rebuild_qtensor" in c)
"""The rebuild calls given a storage, an offset, sizes and strides (arguments 0-3)."""


def overlapping(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """More elements than the storage span the strides cover (the test ``_schema.overlapping`` makes of a tensor)."""
    if len(sizes) != len(strides) or any(s < 0 for s in sizes):
        return True
    if 0 in sizes:
        return False
    numel = 1
    for s in sizes:
        numel *= s
    return numel > 1 + sum((s - 1) * abs(st) for s, st in zip(sizes, strides))


class TensorRules:
    """Mixed into the scan's machine, which provides ``stack``, ``marks``, ``flags``, ``sizes``, ``callables``
    and ``fail``."""

    stack: array
    marks: array
    flags: bytearray
    sizes: array
    callables: dict[int, str]

    def fail(self, problem: str) -> Exception:
        raise NotImplementedError

    def init_tensor_rules(self) -> None:
        self.args_of: dict[int, tuple[str, int, int]] = {}  # argument tuple -> (the call it was written for, its
        # backward hooks, whether the tensor is an expanded view); for _rebuild_from_type_v2: (it, func, args)
        self.shapes: dict[int, tuple[int, ...]] = {}  # tuple -> its integers, for tuples given to a shaped rebuild
        self.int_pos, self.int_val = array("q"), array("q")  # the integers on the stack, where a shape is written

    # -------------------------------------------------------------- integers and shapes
    def shape_context(self) -> bool:
        """Whether the values being pushed are the arguments of a shaped rebuild (or a tuple inside them)."""
        stack = self.stack
        for m in self.marks[-2:]:
            for back in (1, 2):  # right after the callable, or after func and a type (_rebuild_from_type_v2)
                if m >= back and self.callables.get(stack[m - back]) in _SHAPED:
                    return True
        return False

    def after_step(self, name: str, arg: Any, is_int: bool, keeps_stack: bool) -> None:
        """Keep the integers' positions true: forget those an opcode popped or replaced; remember a pushed one."""
        if keeps_stack:
            return
        top = len(self.stack) - 1
        while self.int_pos and self.int_pos[-1] >= top:
            self.int_pos.pop()
            self.int_val.pop()
        if is_int and isinstance(arg, int) and abs(arg) < 1 << 62 and len(self.int_pos) < 2 * MAX_DIMS \
                and self.shape_context():
            self.int_pos.append(top)
            self.int_val.append(arg)

    def note_shape(self, items: Any, base: int) -> None:
        """A tuple just made at stack position ``base`` from ``items``: remember its integers when it is a shape."""
        if not len(items) or len(items) > MAX_DIMS or not self.shape_context():
            return
        known = dict(zip(self.int_pos[-2 * MAX_DIMS:], self.int_val[-2 * MAX_DIMS:]))
        values = [known.get(base + i) for i in range(len(items))]
        if all(v is not None for v in values):
            self.shapes[self.stack[-1]] = tuple(values)  # type: ignore[arg-type]

    def _shape(self, node: int) -> tuple[int, ...] | None:
        return () if node in (0, 1) else self.shapes.get(node)  # a shared scalar entry: EMPTY_TUPLE (0-d)

    # -------------------------------------------------------------- argument tuples
    def note_args(self, items: Any) -> None:
        """A tuple just made: when it follows a rebuild callable (its arguments, as pickle writes them), or one and a
        type (the arguments of the ``func`` inside ``_rebuild_from_type_v2``), remember the call it was written
        for, its backward hooks and whether its sizes and strides make an expanded view."""
        stack = self.stack
        before = [self.callables.get(stack[i], "") for i in (-2, -3) if len(stack) >= -i]
        for depth, callable_ in enumerate(before):
            at = REBUILD_HOOKS_AT.get(callable_)
            if at is not None:
                expanded = 0
                if callable_ in _SHAPED:
                    sizes, strides = (self._shape(items[i]) if len(items) > i else None for i in (2, 3))
                    expanded = int(sizes is None or strides is None or overlapping(sizes, strides))
                self.args_of[stack[-1]] = (callable_, items[at] if len(items) > at else -1, expanded)
                return
            if callable_ == FROM_TYPE and depth == 0 and len(items) == 4:
                self.args_of[stack[-1]] = (callable_, items[0], items[2])
                return

    def check_tensor(self, callable_: str, args: int) -> bool:
        """A tensor's rebuild call (see the module docstring); returns whether it makes an expanded view."""
        if self.sizes[args] > MAX_TENSOR_ARGS:
            raise self.fail(f"a tensor is rebuilt from arguments standing for {self.sizes[args]} values; expected "
                            f"its storage, sizes, strides and flags (at most {MAX_TENSOR_ARGS})")
        if callable_ == FROM_TYPE:
            made_for, func, inner = self.args_of.get(args, ("", 0, 0))
            callable_, args = self.callables.get(func, ""), inner
            if made_for != FROM_TYPE:
                raise self.fail("_rebuild_from_type_v2 is called with arguments not written for it; torch.save "
                                "writes (func, type, args, state) right after it")
        if callable_ not in REBUILD_HOOKS_AT:
            return False
        made_for, hooks, expanded = self.args_of.get(args, ("", -1, 1))
        if made_for != callable_ or hooks < 0 or not self.flags[hooks] & EMPTY_OD or self.sizes[hooks] != 1:
            raise self.fail(f"a tensor's backward hooks ({callable_.replace(' ', '.')}) are not an empty "
                            "OrderedDict made for that call; torch.save never saves hooks")
        self.flags[hooks] |= FROZEN
        return bool(expanded)

    def check_not_expanded(self, args: int) -> None:
        """No call may be given an expanded view (it may copy it: see the module docstring)."""
        if self.flags[args] & EXPANDED:
            raise self.fail("a call is given an expanded tensor view (more elements than its storage: a stride-0 "
                            "or overlapping tensor), which it could copy out to its full size; torch.save writes "
                            "a view only as a tensor's own storage, sizes and strides")
