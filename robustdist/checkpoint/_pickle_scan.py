"""A pass over a pickle's opcodes, before anything unpickles it, that bounds what unpickling can cost.

``torch.load(weights_only=True)`` and robustdist's DCP metadata unpickler refuse code, but not cost: a pickle
can reference one object many times, so a few hundred bytes can describe a tree of 2**40 nodes. Unpickling
it is cheap, but *hashing* it is not (a tuple built as ``t = (t, t)`` forty deep, used as a dict key or a set
member, hashes for hours inside the unpickler), nor is walking it (``Optimizer.load_state_dict``). Ints that
collide in a hash table (``i * (2**61 - 1)``) make building a dict quadratic.

:func:`scan` runs a stack machine over the opcodes (``pickletools.genops``) that tracks, for every value, the
size of the tree it stands for, sharing sizes through the memo exactly as the unpickler shares objects, and
refuses:

* any value whose tree size exceeds the bound;
* a dict key that stands for more than 64 values, or holds a float or an int of magnitude 2**61 - 1 or more
  (python hashes such ints modulo 2**61 - 1, so they can be made to collide; robustdist's keys are names,
  parameter indices and DCP's small ``MetadataIndex`` records), so hashing a key is cheap and no dict
  degrades into a list;
* sets (``EMPTY_SET``, ``ADDITEMS``, ``FROZENSET``), which robustdist never writes, and opcodes that
  ``torch.save`` and DCP never emit;
* a memo index that skips ahead of the entries written (pickle writes them in order; the C unpickler sizes its
  memo table to twice the index, so a 9-byte pickle can cost gigabytes).

Each refusal is a :class:`~robustdist.runtime.errors.CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import pickletools
from typing import Any

from robustdist.runtime.errors import CheckpointCorruptError

MAX_KEY_INT = 2**61 - 1
MAX_KEY_SIZE = 64
_MARK = object()
_SCALARS = frozenset({"NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", "FLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING",
                      "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
                      "BINBYTES8", "BYTEARRAY8"})
_INTS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})
_IGNORED = frozenset({"PROTO", "FRAME", "STOP"})


class _Node:
    """A value on the machine's stack: the size of the tree it stands for, and whether it holds a number that
    must not be hashed (a float, or an int whose hash can be made to collide)."""

    __slots__ = ("big", "size")

    def __init__(self, size: int, big: bool = False):
        self.size, self.big = size, big

    @property
    def key_ok(self) -> bool:
        return self.size <= MAX_KEY_SIZE and not self.big


class _Machine:
    def __init__(self, where: str, limit: int):
        self.where, self.limit = where, limit
        self.stack: list[Any] = []
        self.memo: dict[Any, _Node] = {}

    def fail(self, problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.where}: refused before unpickling: {problem}")

    def node(self, items: list[_Node], extra: int = 1) -> _Node:
        size = extra + sum(i.size for i in items)
        if size > self.limit:
            raise self.fail(f"a value stands for a tree of more than {self.limit} values (one object referenced "
                            "many times); expected plain checkpoint data")
        return _Node(size, any(i.big for i in items))

    def pop_mark(self) -> list[_Node]:
        items: list[_Node] = []
        while self.stack:
            item = self.stack.pop()
            if item is _MARK:
                return items[::-1]
            items.append(item)
        raise self.fail("a MARK is missing")

    def pop(self, n: int = 1) -> list[_Node]:
        if len(self.stack) < n or any(x is _MARK for x in self.stack[-n:]):
            raise self.fail("the stack is too short")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def add_items(self, container: _Node, items: list[_Node], *, pairs: bool) -> None:
        if pairs:
            if len(items) % 2:
                raise self.fail("a dict update has an odd number of items")
            for key in items[0::2]:
                if not key.key_ok:
                    raise self.fail(f"a dict key stands for {key.size} values or holds a float or an int of "
                                    f"magnitude {MAX_KEY_INT} or more; expected a name, an index or a small record")
        grown = self.node(items, container.size)
        container.size, container.big = grown.size, container.big or grown.big

    def step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per opcode family, flat on purpose
        stack = self.stack
        if name in _INTS:
            stack.append(_Node(1, not (isinstance(arg, int) and abs(arg) < MAX_KEY_INT)))
        elif name in _SCALARS:
            stack.append(_Node(1, name == "BINFLOAT" or name == "FLOAT"))
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "GLOBAL", "PERSID"):
            stack.append(_Node(1))
        elif name == "MARK":
            stack.append(_MARK)
        elif name in ("TUPLE", "LIST"):
            stack.append(self.node(self.pop_mark()))
        elif name == "DICT":
            items, container = self.pop_mark(), _Node(1)
            self.add_items(container, items, pairs=True)
            stack.append(container)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            stack.append(self.node(self.pop(int(name[-1]))))
        elif name == "APPEND":
            value, = self.pop()
            self._into_top([value], pairs=False)
        elif name in ("APPENDS", "SETITEMS"):
            self._into_top(self.pop_mark(), pairs=name == "SETITEMS")
        elif name == "SETITEM":
            self._into_top(self.pop(2), pairs=True)
        elif name in ("REDUCE", "NEWOBJ"):
            stack.append(self.node(self.pop(2)[1:]))
        elif name == "NEWOBJ_EX":
            stack.append(self.node(self.pop(3)[1:]))
        elif name == "STACK_GLOBAL":
            self.pop(2)
            stack.append(_Node(1))
        elif name == "BINPERSID":
            stack.append(self.node(self.pop()))
        elif name == "BUILD":
            state, = self.pop()
            self._into_top([state], pairs=False)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not stack or stack[-1] is _MARK:
                raise self.fail("nothing to memoise")
            index = len(self.memo) if name == "MEMOIZE" else arg
            if not isinstance(index, int) or not 0 <= index <= len(self.memo):
                # pickle writes memo indices in order; the C unpickler sizes its memo table to twice the index, so
                # a 9-byte pickle with LONG_BINPUT 2**24 costs hundreds of MB (2**31: tens of GB)
                raise self.fail(f"memo index {index!r:.20} skips ahead of the {len(self.memo)} entries written; "
                                "pickle writes them in order")
            self.memo[index] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in self.memo:
                raise self.fail(f"memo entry {arg!r:.20} is read before it is written")
            stack.append(self.memo[arg])
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            stack.append(self.pop()[0])
            stack.append(stack[-1])
        elif name not in _IGNORED:
            raise self.fail(f"opcode {name}, which neither torch.save nor DCP writes (sets included)")

    def _into_top(self, items: list[_Node], *, pairs: bool) -> None:
        if not self.stack or self.stack[-1] is _MARK:
            raise self.fail("no container to add to")
        self.add_items(self.stack[-1], items, pairs=pairs)


def scan(data: bytes, where: str, limit: int) -> None:
    """Refuse a pickle that would be expensive to unpickle (see the module docstring)."""
    machine = _Machine(where, limit)
    try:
        for opcode, arg, _ in pickletools.genops(data):
            machine.step(opcode.name, arg)
    except CheckpointCorruptError:
        raise
    except Exception as e:  # a truncated or garbled stream: pickletools raises ValueError and friends
        raise machine.fail(f"not a well-formed pickle ({type(e).__name__}: {str(e)[:120]})") from None
